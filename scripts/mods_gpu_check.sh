#!/usr/bin/env bash
# The GPU tests of the score and mask modifiers and their speed, in about four minutes:
# the kernel variants the tests need compiled in parallel first, then tests/test_mods_gpu.py
# (every backend, dtype and modifier), then scripts/mods_speed.py.  (The CUDA runs of the
# modifier property test, tests/test_mod_properties.py, belong to the full suite.)
# Usage: scripts/mods_gpu_check.sh [OUTDIR]   (default: $OUT, else mods-gpu-out)
set -uo pipefail
out=${1:-${OUT:-mods-gpu-out}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0

python3 - <<'PY' 2>&1 | grep -v -i warning | tee "$out/warm.log"
import itertools, time, sys
sys.path.insert(0, "tests")
import numpy as np
import test_mods_gpu as t
from pycudaflash import compiler, cuda_backend
from pycudaflash._validate import validate_forward

cuda_backend.activate()
arch = compiler.arch_of_current_device()
todo = {}
for dtype, mods, shape in itertools.product(t.DTYPES, t.MODS, t.SHAPES):
    q, k, v, _, kw = t._problem(shape, mods, dtype)
    prob = validate_forward(q, k, v, **kw)
    hd = compiler.head_dim_bucket(prob.D, dtype)
    for kind in ("fwd", "bwd"):
        for hopper in (False, True):
            p = compiler.pass_name(kind, dtype, arch, hd, prob.mask_kind, hopper=hopper, mods=True)
            d = compiler.defines(p, hd, prob.mask_kind, dtype, arch, groups=prob.kv_heads != prob.H,
                                 mods=(prob.score_mod, prob.mask_mod))
            todo[(p, tuple(sorted(d.items())))] = (p, d)
t0 = time.perf_counter()
r = compiler.warm_cache(arch, jobs=16, variants=list(todo.values()))
print(f"kernel cache: {len(r)} modifier variants ready in {time.perf_counter() - t0:.1f} s")
cuda_backend.deactivate()
PY

timeout ${PYTEST_TIMEOUT:-1500} python3 -m pytest -q -p no:cacheprovider -rs tests/test_mods_gpu.py \
    2>&1 | tee "$out/pytest_mods.log" || status=1
timeout ${BENCH_TIMEOUT:-600} python3 scripts/mods_speed.py --out "$out/mods_speed.json" 2>&1 \
    | grep -v -i warning | tee "$out/mods_speed.log" || status=1
exit $status
