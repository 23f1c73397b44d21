"""Command line: ``python -m pycudaflash {check,info,warm}``.

``check``
    Runs the forward and backward passes on random problems (standard-normal
    inputs) over every masking mode and several head dimensions, compares
    them with the float64 reference and prints a table of relative errors and
    times.  Exits with status 1 when an error exceeds the bound.
``info``
    Prints versions, the usable backends and, when PyCUDA imports, the
    device, the CUDA compiler and the kernel cache directory.
``warm``
    Compiles every kernel variant into the disk cache and, where torch is
    installed, the torch operators' C++ host path.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

#: Relative-norm error bound of the ``check`` command for float32 results.
#: A sanity bound only; the tests hold the backends to tighter ones.
CHECK_BOUND_FLOAT32 = 1e-5
#: Sanity bounds per dtype (16-bit inputs: a few units of the type's rounding).
CHECK_BOUNDS = {"float32": CHECK_BOUND_FLOAT32, "float16": 2e-3, "bfloat16": 1.5e-2}


# --------------------------------------------------------------------------
# Problems
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One check problem.

    ``cuda`` and ``numpy`` give ``(B, H, Nq, Nk, D)`` for each backend (the
    NumPy sizes are smaller so the run stays short on a few CPU cores).
    ``extras`` builds the masking keyword arguments from the sizes and a
    random generator.
    """

    name: str
    cuda: Tuple[int, int, int, int, int]
    numpy: Tuple[int, int, int, int, int]
    extras: Callable[[Tuple[int, int, int, int, int], np.random.Generator], Dict[str, Any]]
    quick: bool = False


def _no_extras(dims: Tuple[int, ...], rng: np.random.Generator) -> Dict[str, Any]:
    return {}


def _causal(mode: Any) -> Callable[..., Dict[str, Any]]:
    def make(dims: Tuple[int, ...], rng: np.random.Generator) -> Dict[str, Any]:
        return {"causal": mode}

    return make


def _window(left: Optional[int], right: Optional[int], causal: Any = False) -> Callable[..., Dict[str, Any]]:
    def make(dims: Tuple[int, ...], rng: np.random.Generator) -> Dict[str, Any]:
        return {"window": (left, right), "causal": causal}

    return make


def _key_lengths(dims: Tuple[int, ...], rng: np.random.Generator) -> Dict[str, Any]:
    # One full sequence, one partial, one empty (every row masked), more random.
    B, _, _, Nk, _ = dims
    lengths = [Nk, max(1, Nk // 3), 0] + list(rng.integers(1, Nk + 1, size=max(0, B - 3)))
    return {"key_lengths": np.asarray(lengths[:B], dtype=np.int32)}


def _bool_mask(dims: Tuple[int, ...], rng: np.random.Generator) -> Dict[str, Any]:
    # Random pattern shared by the heads (broadcast over H); every row sees at
    # least one key except row 1 of batch 0, which sees none.
    B, _, Nq, Nk, _ = dims
    mask = rng.random((B, 1, Nq, Nk)) < 0.7
    mask[:, :, np.arange(Nq), rng.integers(0, Nk, size=Nq)] = True
    mask[0, 0, min(1, Nq - 1), :] = False
    return {"mask": mask}


def _float_mask(dims: Tuple[int, ...], rng: np.random.Generator) -> Dict[str, Any]:
    # A normal bias with scattered -inf, and one row of batch 0 all -inf.
    B, H, Nq, Nk, _ = dims
    bias = rng.standard_normal((B, H, Nq, Nk)).astype(np.float32)
    bias[rng.random((B, H, Nq, Nk)) < 0.2] = -np.inf
    bias[:, :, np.arange(Nq), rng.integers(0, Nk, size=Nq)] = 0.5
    bias[0, 0, Nq // 2, :] = -np.inf
    return {"mask": bias}


CASES: List[Case] = [
    Case("none", (2, 4, 512, 512, 64), (2, 2, 384, 384, 64), _no_extras, quick=True),
    Case("none_d16_nq!=nk", (2, 3, 300, 700, 16), (2, 2, 200, 450, 16), _no_extras),
    Case("causal_top_left", (2, 4, 384, 640, 128), (2, 2, 320, 480, 128), _causal("top_left"), quick=True),
    Case("causal_top_left_d256", (1, 2, 1024, 1024, 256), (1, 2, 384, 384, 256), _causal(True)),
    Case("causal_bottom_right", (2, 4, 640, 384, 64), (2, 2, 480, 320, 64), _causal("bottom_right"), quick=True),
    Case("causal_bottom_right_d16", (2, 2, 2048, 2048, 16), (2, 2, 640, 640, 16), _causal("bottom_right")),
    Case("window", (2, 3, 500, 700, 64), (2, 2, 390, 510, 64), _window(64, 32), quick=True),
    Case("window_bottom_right", (2, 2, 700, 1100, 128), (2, 2, 450, 630, 128), _window(96, 0, "bottom_right")),
    Case("window_left_only", (2, 2, 513, 513, 256), (1, 2, 300, 300, 256), _window(48, None)),
    Case("key_lengths", (3, 2, 300, 517, 128), (3, 2, 180, 351, 128), _key_lengths, quick=True),
    Case("bool_mask", (2, 2, 256, 320, 64), (2, 2, 192, 240, 64), _bool_mask, quick=True),
    Case("float_mask", (2, 2, 257, 255, 128), (2, 2, 193, 191, 128), _float_mask, quick=True),
    Case("float_mask_d16", (2, 3, 129, 383, 16), (2, 2, 97, 287, 16), _float_mask),
]


@dataclass
class Row:
    """Errors and times of one check case."""

    name: str
    dims: Tuple[int, int, int, int, int]
    errors: Dict[str, float] = field(default_factory=dict)
    fwd_ms: float = math.nan
    bwd_ms: float = math.nan
    failure: Optional[str] = None

    def ok(self, bound: float) -> bool:
        return self.failure is None and all(e <= bound for e in self.errors.values())


# --------------------------------------------------------------------------
# Running the cases
# --------------------------------------------------------------------------


class _Runner:
    """Runs one problem on a backend and reports host results and times."""

    name = "?"

    def forward(self, arrays: Dict[str, np.ndarray], kw: Dict[str, Any]) -> Tuple[np.ndarray, np.ndarray, float]:
        raise NotImplementedError

    def backward(self, arrays: Dict[str, np.ndarray], kw: Dict[str, Any]) -> Tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _NumpyRunner(_Runner):
    """The NumPy backend, timed by the host clock around each call."""

    name = "numpy"

    def forward(self, arrays: Dict[str, np.ndarray], kw: Dict[str, Any]) -> Tuple[np.ndarray, np.ndarray, float]:
        from .api import flash_attn_forward

        t0 = time.perf_counter()
        out, lse = flash_attn_forward(arrays["q"], arrays["k"], arrays["v"], backend="numpy", **kw)
        ms = (time.perf_counter() - t0) * 1e3
        return np.asarray(out), np.asarray(lse), ms

    def backward(self, arrays: Dict[str, np.ndarray], kw: Dict[str, Any]) -> Tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        from .api import flash_attn_backward

        t0 = time.perf_counter()
        dq, dk, dv = flash_attn_backward(
            arrays["dout"], arrays["q"], arrays["k"], arrays["v"], arrays["out"], arrays["lse"],
            backend="numpy", **kw,
        )
        ms = (time.perf_counter() - t0) * 1e3
        return np.asarray(dq), np.asarray(dk), np.asarray(dv), ms


class _CudaRunner(_Runner):
    """The CUDA backend on device arrays and a stream, timed with CUDA events."""

    name = "cuda"

    def __init__(self, warmup: int, repeat: int) -> None:
        from . import cuda_backend

        cuda_backend.activate()
        import pycuda.driver as drv

        self.stream = drv.Stream()
        self.dtype = "float32"
        self.warmup = warmup
        self.repeat = repeat

    def _device_kw(self, kw: Dict[str, Any]) -> Dict[str, Any]:
        import pycuda.gpuarray as gpuarray

        dkw = dict(kw)
        # GPUArrays of ml_dtypes.bfloat16 export the opaque '<V2': name the dtype.
        dkw["dtype"] = self.dtype
        if isinstance(dkw.get("mask"), np.ndarray):
            dkw["mask"] = gpuarray.to_gpu(np.ascontiguousarray(dkw["mask"]))
        return dkw

    def forward(self, arrays: Dict[str, np.ndarray], kw: Dict[str, Any]) -> Tuple[np.ndarray, np.ndarray, float]:
        import pycuda.gpuarray as gpuarray

        from .api import flash_attn_forward
        from .timing import time_cuda

        s = self.stream
        q, k, v = (gpuarray.to_gpu(arrays[n]) for n in ("q", "k", "v"))
        out = gpuarray.empty(q.shape, q.dtype)
        lse = gpuarray.empty(q.shape[:3], np.float32)
        dkw = self._device_kw(kw)

        def call(_: int) -> None:
            flash_attn_forward(q, k, v, stream=s, out=out, lse=lse, **dkw)

        call(0)
        s.synchronize()
        host_out, host_lse = out.get(), lse.get()
        res = time_cuda(call, stream=s, warmup=self.warmup, repeat=self.repeat)
        return host_out, host_lse, res.median_ms

    def backward(self, arrays: Dict[str, np.ndarray], kw: Dict[str, Any]) -> Tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        import pycuda.gpuarray as gpuarray

        from .api import flash_attn_backward
        from .timing import time_cuda

        s = self.stream
        dout, q, k, v, out, lse = (
            gpuarray.to_gpu(np.ascontiguousarray(arrays[n])) for n in ("dout", "q", "k", "v", "out", "lse")
        )
        dq = gpuarray.empty(q.shape, q.dtype)
        dk = gpuarray.empty(k.shape, k.dtype)
        dv = gpuarray.empty(v.shape, v.dtype)
        dkw = self._device_kw(kw)

        def call(_: int) -> None:
            flash_attn_backward(dout, q, k, v, out, lse, stream=s, dq=dq, dk=dk, dv=dv, **dkw)

        call(0)
        s.synchronize()
        host = (dq.get(), dk.get(), dv.get())
        res = time_cuda(call, stream=s, warmup=self.warmup, repeat=self.repeat)
        return host[0], host[1], host[2], res.median_ms

    def close(self) -> None:
        self.stream.synchronize()
        from . import cuda_backend

        cuda_backend.deactivate()


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _run_case(case: Case, runner: _Runner, rng: np.random.Generator, dtype: str = "float32") -> Row:
    from .reference import reference_backward, reference_forward
    from .testing import relative_error

    dims = case.cuda if runner.name == "cuda" else case.numpy
    B, H, Nq, Nk, D = dims
    row = Row(case.name, dims)
    dt = _np_dtype(dtype)
    arrays = {
        "q": rng.standard_normal((B, H, Nq, D)).astype(dt),
        "k": rng.standard_normal((B, H, Nk, D)).astype(dt),
        "v": rng.standard_normal((B, H, Nk, D)).astype(dt),
        "dout": rng.standard_normal((B, H, Nq, D)).astype(dt),
    }
    kw = case.extras(dims, rng)
    runner.dtype = dtype
    try:
        out, lse, row.fwd_ms = runner.forward(arrays, kw)
        ref_out, ref_lse = reference_forward(arrays["q"], arrays["k"], arrays["v"], **kw)
        row.errors["out"] = relative_error(out, ref_out)
        row.errors["lse"] = relative_error(lse, ref_lse)
        arrays["out"], arrays["lse"] = out, lse
        dq, dk, dv, row.bwd_ms = runner.backward(arrays, kw)
        rdq, rdk, rdv = reference_backward(arrays["dout"], arrays["q"], arrays["k"], arrays["v"], **kw)
        row.errors["dq"] = relative_error(dq, rdq)
        row.errors["dk"] = relative_error(dk, rdk)
        row.errors["dv"] = relative_error(dv, rdv)
    except Exception as exc:  # reported in the table; the run goes on
        row.failure = f"{type(exc).__name__}: {exc}"
    return row


def _fmt_err(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2e}"


def _fmt_ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3f}"


def _print_table(rows: Sequence[Row], bound: float) -> None:
    head = ["case", "B", "H", "Nq", "Nk", "D", "out err", "lse err", "dq err", "dk err", "dv err",
            "fwd ms", "bwd ms", "status"]
    body = []
    for r in rows:
        e = r.errors
        body.append(
            [r.name, *(str(x) for x in r.dims)]
            + [_fmt_err(e.get(n)) for n in ("out", "lse", "dq", "dk", "dv")]
            + [_fmt_ms(r.fwd_ms), _fmt_ms(r.bwd_ms), "ok" if r.ok(bound) else "FAIL"]
        )
    widths = [max(len(line[c]) for line in [head] + body) for c in range(len(head))]
    left = {0}
    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    print(line(head))
    print("  ".join("-" * w for w in widths))
    for cells in body:
        print(line(cells))
    for r in rows:
        if r.failure:
            print(f"  {r.name}: {r.failure}")


def cmd_check(args: argparse.Namespace) -> int:
    """Run the check command; returns the exit status."""
    from ._backends import cuda_status

    usable, reason = cuda_status()
    if args.backend is None:
        backend = "cuda" if usable else "numpy"
        why = f"CUDA is usable: {reason}" if usable else f"CUDA is not usable: {reason}"
        print(f"backend: {backend} ({why})")
    else:
        backend = args.backend
        if backend == "cuda" and not usable:
            print(f"backend 'cuda' was requested but {reason}", file=sys.stderr)
            return 2
        print(f"backend: {backend} (requested)")

    cases = [c for c in CASES if c.quick] if args.quick else list(CASES)
    bound = CHECK_BOUNDS[args.dtype]
    print(f"dtype {args.dtype}, seed {args.seed}, {len(cases)} cases, "
          f"bound {bound:.0e} on each relative-norm error against the float64 reference")
    if backend == "cuda":
        print("times: median device time from CUDA events (ms)")
    else:
        print("times: host wall-clock of one call (ms)")
    print()

    rng = np.random.default_rng(args.seed)
    runner: _Runner
    if backend == "cuda":
        runner = _CudaRunner(warmup=2, repeat=5 if args.quick else 10)
    else:
        runner = _NumpyRunner()
    rows: List[Row] = []
    t0 = time.perf_counter()
    try:
        for case in cases:
            rows.append(_run_case(case, runner, rng, args.dtype))
    finally:
        runner.close()
    elapsed = time.perf_counter() - t0
    _print_table(rows, bound)
    failed = [r.name for r in rows if not r.ok(bound)]
    print()
    if failed:
        print(f"FAILED: {len(failed)} of {len(rows)} cases ({', '.join(failed)}) in {elapsed:.1f} s")
        return 1
    print(f"all {len(rows)} cases passed in {elapsed:.1f} s")
    return 0


# --------------------------------------------------------------------------
# info
# --------------------------------------------------------------------------


def _na(exc: BaseException) -> str:
    return f"n/a ({type(exc).__name__}: {exc})"


def cmd_info(args: argparse.Namespace) -> int:
    """Print versions, backends, device and compiler details; returns 0."""
    import platform

    import pycudaflash

    from ._backends import available_backends, cuda_status

    usable, reason = cuda_status()
    print(f"pycudaflash        {pycudaflash.__version__}")
    print(f"python             {platform.python_version()}")
    print(f"numpy              {np.__version__}")
    print(f"backends           {', '.join(available_backends())}")
    print(f"cuda               {'usable' if usable else 'unavailable'}: {reason}")
    try:
        import torch

        from . import _fastpath

        print(f"torch              {torch.__version__}; C++ host path of the operators: {_fastpath.status()}")
    except Exception as exc:
        print(f"torch              {_na(exc)}")

    try:
        import pycuda
        import pycuda.driver as drv
    except Exception as exc:
        print(f"pycuda             {_na(exc)}")
        return 0
    print(f"pycuda             {getattr(pycuda, 'VERSION_TEXT', None) or getattr(pycuda, '__version__', '?')}")
    try:
        drv.init()
        print(f"cuda driver        {drv.get_driver_version()}")
        dev = drv.Device(0)
        major, minor = dev.compute_capability()
        mem_gib = dev.total_memory() / 2**30
        print(f"device 0           {dev.name()} (compute capability {major}.{minor}, {mem_gib:.1f} GiB)")
        print(f"device count       {drv.Device.count()}")
    except Exception as exc:
        print(f"device             {_na(exc)}")
    from . import compiler

    print(f"nvcc               {compiler.nvcc_version()}")
    try:
        print(f"kernel cache dir   {compiler.cache_dir()}")
    except Exception as exc:
        print(f"kernel cache dir   {_na(exc)}")
    return 0


def warm_torch_ops() -> Tuple[bool, str]:
    """Build the torch operators' C++ host path (:mod:`pycudaflash._fastpath`) where torch is
    installed and the path is on, unless built already: ``(ok, what happened)``."""
    try:
        importlib.import_module("torch")
    except Exception as exc:
        return True, f"C++ host path: not built, torch is not importable ({type(exc).__name__}: {exc})"
    from . import _fastpath

    if not _fastpath.enabled():
        return True, f"C++ host path: off (${_fastpath.ENV}=0)"
    built = _fastpath.library_path().exists()
    t0 = time.perf_counter()
    try:
        path = _fastpath.build_if_missing()
    except Exception as exc:  # (the first CUDA call would warn with the same message)
        return False, f"C++ host path: the build failed ({type(exc).__name__}: {exc})"
    if built:
        return True, f"C++ host path: built already, {path}"
    return True, f"C++ host path: built in {time.perf_counter() - t0:.0f} s, {path}"


def cmd_warm(args: argparse.Namespace) -> int:
    """Compile every kernel variant for this GPU (or ``--arch``) into the disk cache, in parallel,
    and (beside them) the torch operators' C++ host path."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        torch_ops = pool.submit(warm_torch_ops)  # (one compiler process beside the nvcc ones)
        status = _warm_variants(args)
        ok, line = torch_ops.result()
    print(line)
    return status if ok else 1


def _warm_variants(args: argparse.Namespace) -> int:
    """The kernel variants of ``warm``; the exit status."""
    from . import compiler

    try:
        importlib.import_module("pycuda.compiler")  # (variants compile through PyCUDA's disk cache)
    except Exception as exc:
        print(f"warm needs PyCUDA and nvcc: {_na(exc)}", file=sys.stderr)
        return 1

    arch = args.arch
    pushed = False
    if arch is None:
        from . import _driver

        ctx, pushed = _driver.enter(None)
        arch = compiler.arch_of_current_device()
    try:
        variants = list(compiler.all_variants(arch=arch))
        print(f"building {len(variants)} kernel variants for {arch} with {args.jobs} nvcc processes "
              f"into {compiler.cache_dir()}", flush=True)
        t0 = time.perf_counter()

        def progress(done: int, total: int, pass_: str, defs: Dict[str, int], seconds: float) -> None:
            hd, mask = defs.get("HEAD_DIM"), defs.get("MASK_MODE")
            print(f"[{done:3d}/{total}] {pass_:9s} head dim {hd:3d} mask mode {mask} {seconds:6.1f} s", flush=True)

        compiler.warm_cache(arch=arch, jobs=args.jobs, variants=variants, progress=progress)
        print(f"done in {time.perf_counter() - t0:.0f} s")
    finally:
        if pushed:
            _driver.leave(pushed)
    return 0


# --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m pycudaflash``."""
    parser = argparse.ArgumentParser(
        prog="python -m pycudaflash",
        description="FlashAttention forward and backward in CUDA, driven by PyCUDA.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_check = sub.add_parser(
        "check",
        help="compare forward and backward with the float64 reference on random problems",
        description="Run forward and backward on random problems over every masking mode and several "
                    "head dimensions; compare with the float64 reference; exit 1 if an error exceeds "
                    f"{CHECK_BOUND_FLOAT32:.0e} (relative norm).",
    )
    p_check.add_argument("--backend", choices=("cuda", "numpy"), default=None,
                         help="backend to check (default: cuda when usable, else numpy)")
    p_check.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p_check.add_argument("--dtype", choices=tuple(CHECK_BOUNDS), default="float32",
                         help="input dtype (default float32)")
    p_check.add_argument("--quick", action="store_true", help="run a smaller set of cases")
    p_check.set_defaults(func=cmd_check)
    p_info = sub.add_parser("info", help="print versions, backends, device and kernel cache")
    p_info.set_defaults(func=cmd_info)
    p_warm = sub.add_parser("warm", help="compile every kernel variant into the disk cache, with progress",
                            description="Compile every kernel variant for this GPU (or --arch) in parallel, "
                                        "and the torch operators' C++ host path where torch is installed, "
                                        "so that no later call waits for a compiler.")
    p_warm.add_argument("--arch", default=None, help="target, e.g. sm_90 (default: the current GPU's)")
    p_warm.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                        help="parallel nvcc processes (default: CPUs, at most 16)")
    p_warm.set_defaults(func=cmd_warm)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
