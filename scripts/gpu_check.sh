#!/usr/bin/env bash
# Full GPU check in one go: kernel cache warm-up, the whole test suite on the
# CUDA backend, compute-sanitizer (memcheck, racecheck) on small runs of every
# mask mode and dtype and of the torch operator, host time per call and the
# training step beside torch SDPA, and the kernel benchmarks against torch
# SDPA (SKIP_BENCH=1 leaves those out).
# Usage: scripts/gpu_check.sh [OUTDIR]   (logs, JSON and plot land in OUTDIR)
# PYTEST_ARGS adds pytest options; PYTEST_TIMEOUT, SANITIZER_TIMEOUT and
# BENCH_TIMEOUT (seconds) bound each stage.
set -uo pipefail
out=${1:-gpu-check-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYCUDAFLASH_TEST_COMPILE=${PYCUDAFLASH_TEST_COMPILE:-1}  # (the compile-every-variant test runs here)
status=0

python3 -m pycudaflash info 2>&1 | tee "$out/info.log"

t0=$(date +%s)
python3 -c "
import time, pycudaflash.compiler as c, pycudaflash.cuda_backend as cb
cb.activate(); t=time.perf_counter(); r=c.warm_cache(jobs=16)
print(f'kernel cache: {len(r)} variants ready in {time.perf_counter()-t:.1f} s')
cb.deactivate()" 2>&1 | grep -v -i warning | tee "$out/warm.log"

python3 -m pycudaflash check 2>&1 | grep -v -i warning | tee "$out/check.log" || status=1

timeout ${PYTEST_TIMEOUT:-3600} python3 -m pytest -q -p no:cacheprovider -rs ${PYTEST_ARGS:-} tests 2>&1 | tee "$out/pytest.log" || status=1
echo "pytest took $(( $(date +%s) - t0 )) s" | tee -a "$out/pytest.log"

# (--report-api-errors no: cuda-bindings probes driver entry points with cuGetProcAddress when
# it loads, and memcheck reports each probe the driver answers with CUDA_ERROR_INVALID_VALUE, 34
# on the H200 machine, before any kernel runs; every driver call of this library checks its result.)
for tool in memcheck racecheck; do
  timeout ${SANITIZER_TIMEOUT:-3600} compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 9 \
    python3 scripts/sanitize_cases.py 2>&1 \
    | grep -v -E "Warning:|warn\(" | tee "$out/sanitizer-$tool.log" || status=1
done

timeout ${BENCH_TIMEOUT:-3600} python3 scripts/host_overhead.py --json "$out/host.json" 2>&1 | tee "$out/host.log" || status=1
timeout ${BENCH_TIMEOUT:-3600} python3 scripts/train_step.py --json "$out/train.json" 2>&1 | tee "$out/train.log" || status=1

if [ -z "${SKIP_BENCH:-}" ]; then
  timeout ${BENCH_TIMEOUT:-3600} python3 scripts/bench.py --dtype float32 --head-dim 64 128 --seqlen 1024 4096 --causal both \
    --json "$out/bench-float32.json" --plot "$out/bench-float32.png" 2>&1 | tee "$out/bench-float32.log" || status=1
  for dt in float16 bfloat16; do
    timeout ${BENCH_TIMEOUT:-3600} python3 scripts/bench.py --dtype $dt --head-dim 64 128 256 --seqlen 1024 4096 16384 \
      --causal both --json "$out/bench-$dt.json" --plot "$out/bench-$dt.png" 2>&1 | tee "$out/bench-$dt.log" || status=1
  done
fi
exit $status
