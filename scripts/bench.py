#!/usr/bin/env python3
"""Benchmark pycudaflash's forward and backward kernels, with torch SDPA as a peer.

Method
------
* Shapes: for each head dimension ``D``, sequence length ``N`` and causal
  mode, ``B = tokens // N`` and ``H = hd_total // D`` (a fixed number of
  tokens and a fixed model width, as in the FlashAttention benchmarks);
  ``Nq = Nk = N``; layout (B, H, N, D), or with ``--layout bnhd`` (B, N, H, D)
  storage viewed as (B, H, N, D), the layout FlashAttention itself uses.
* Inputs are standard-normal tensors in ``--dtype`` (float32, float16 or
  bfloat16) allocated by torch on the GPU and passed as they are to
  ``pycudaflash.flash_attn_forward/backward`` (through
  ``__cuda_array_interface__``; bfloat16, which that interface exports as
  the opaque ``'<V2'``, is identified through ``__dlpack__``), so both
  implementations read the same memory.  torch initialises CUDA first and ``cuda_backend.activate()`` then
  makes its primary context current for PyCUDA, so both share one context.
  Without torch, the inputs are PyCUDA ``GPUArray`` objects and only
  pycudaflash is timed.
* The L2 cache (60 MB on an H100/H200) is defeated by rotating through
  several independent input sets: at least ``--min-sets`` (4) and enough that
  they total at least ``--min-mb`` (256 MB).  Call ``i`` uses set ``i mod n``.
* Timing: CUDA events around every call, ``--warmup`` untimed calls first,
  the median of ``--reps`` calls reported.  With ``--rounds R`` every
  implementation of a config is timed R times in turn (ours, each peer,
  ours, ...), ``--reps`` calls each, and the median of all R x reps calls
  is reported, so that a change of the GPU's clock during a config falls on
  every implementation alike.  Before each implementation's timed calls the
  device is synchronised and left idle for ``--settle`` seconds (0.5): the
  GPU's clock lags its power draw, and a kernel timed right after a heavier
  one (cuDNN's) otherwise runs for the first 100 ms or so at a lower clock
  than it holds on its own (seen on the H200: our N 4096 forward 8-15 %
  slower in every round that followed cuDNN's, none without it).
  pycudaflash runs on its own ``pycuda.driver.Stream``
  (``pycudaflash.timing.time_cuda``); torch runs on its current stream,
  timed with ``torch.cuda.Event`` the same way.  The
  events measure device time; Python overhead shows only when the device
  runs out of queued work (small problems).
* Backward: only the backward call is timed.  pycudaflash's forward is run
  once per set beforehand to get ``out`` and ``lse``.  For torch, one graph
  per set is built once (forward with ``requires_grad`` inputs) and
  ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)`` is timed,
  which runs torch's backward kernel alone (plus its small bookkeeping)
  without recomputing the forward.
* FLOPs follow FlashAttention's convention (``pycudaflash.timing.attention_flops``):
  ``4 B H N^2 D`` for the forward, halved when causal, times 2.5 for the
  backward.
* Peers per dtype: float32 -- torch SDPA's memory-efficient backend;
  float16/bfloat16 -- its flash, memory-efficient and cuDNN backends.  A peer
  that raises (a head dim or dtype it does not support, for instance) is
  reported as ``n/a`` with the reason.
* Table: one row per config, with the TFLOP/s of every implementation side
  by side and ``ratio`` = ours / the first peer's TFLOP/s (torch's flash
  backend for float16/bfloat16, its memory-efficient one for float32; above
  1: ours is faster).
* Plot: TFLOP/s against sequence length, one panel per (D, causal mode), one
  line per implementation and pass; written to ``--plot``, or next to the
  ``--json`` file (same name, ``.png``) when only that is given.
* Before timing a config, ours is compared with each peer on set 0 and, for
  N <= 4096, with the float64 reference on one (batch, head) slice.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

DTYPES = ("float32", "float16", "bfloat16")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(
        description="Time pycudaflash forward/backward with CUDA events and compare with torch SDPA.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="storage dtype of q, k, v")
    p.add_argument("--head-dim", type=int, nargs="+", default=[64, 128], help="head dimensions D")
    p.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096], help="sequence lengths N (Nq = Nk)")
    p.add_argument("--causal", choices=("none", "causal", "both"), default="both", help="causal modes to run")
    p.add_argument("--tokens", type=int, default=16384, help="batch size is tokens // seqlen")
    p.add_argument("--hd-total", type=int, default=2048, help="heads are hd_total // head_dim")
    p.add_argument("--reps", type=int, default=30, help="timed calls per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before each measurement")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every implementation of a config this many times in turn (median of all calls)")
    p.add_argument("--settle", type=float, default=0.5,
                   help="seconds the idle device settles before each implementation's timed calls")
    p.add_argument("--min-sets", type=int, default=4, help="minimum number of rotated input sets")
    p.add_argument("--min-mb", type=float, default=256.0, help="minimum total size of the input sets (MB)")
    p.add_argument("--layout", choices=("bhnd", "bnhd"), default="bhnd",
                   help="memory layout of q, k, v, dout and our outputs: (B, H, N, D), or (B, N, H, D) "
                        "viewed as (B, H, N, D)")
    p.add_argument("--deterministic", action="store_true", help="time the deterministic backward")
    p.add_argument("--no-peer", action="store_true", help="do not time torch even when it is importable")
    p.add_argument("--peers", metavar="NAMES",
                   help="comma-separated subset of the dtype's peers to time (flash, mem-eff, cudnn); "
                        "default: all of them")
    p.add_argument("--json", metavar="PATH", help="write every result to this JSON file")
    p.add_argument("--plot", metavar="PATH",
                   help="write a PNG of TFLOP/s against sequence length (default with --json: "
                        "next to the JSON file)")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if not 0 <= args.settle <= 60:
        p.error("--settle must be between 0 and 60 seconds")
    for d in args.head_dim:
        if d < 1 or args.hd_total // d < 1:
            p.error(f"head dim {d} needs --hd-total >= {d}")
    for n in args.seqlen:
        if n < 1 or args.tokens // n < 1:
            p.error(f"seqlen {n} needs --tokens >= {n}")
    return args


# --------------------------------------------------------------------------
# Arrays: torch tensors when torch is usable, else PyCUDA GPUArrays
# --------------------------------------------------------------------------


def _storage_shape(shape: Tuple[int, ...], layout: str) -> Tuple[int, ...]:
    """Shape of the allocation behind a (B, H, N, D) array in ``layout``."""
    if layout == "bnhd" and len(shape) == 4:
        B, H, N, D = shape
        return (B, N, H, D)
    return shape


class TorchArrays:
    """Allocates device arrays with torch (shared with pycudaflash)."""

    def __init__(self, torch: Any, dtype: str, layout: str = "bhnd") -> None:
        self.torch = torch
        self.dtype = getattr(torch, dtype)
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.layout = layout

    def _view(self, x: Any) -> Any:
        return x.transpose(1, 2) if self.layout == "bnhd" and x.dim() == 4 else x

    def randn(self, shape: Tuple[int, ...]) -> Any:
        storage = _storage_shape(shape, self.layout)
        return self._view(self.torch.randn(storage, device="cuda", dtype=self.dtype))

    def empty(self, shape: Tuple[int, ...], float32: bool = False) -> Any:
        dt = self.torch.float32 if float32 else self.dtype
        return self._view(self.torch.empty(_storage_shape(shape, self.layout), device="cuda", dtype=dt))

    def host(self, x: Any) -> Any:
        return x.detach().float().cpu().numpy()

    def sync(self) -> None:
        self.torch.cuda.synchronize()


class PycudaArrays:
    """Allocates device arrays with PyCUDA (when torch is not available).

    bfloat16 arrays hold ``ml_dtypes.bfloat16`` elements; their
    ``__cuda_array_interface__`` says only ``'<V2'``, so pycudaflash is called
    with ``dtype=`` (see :func:`run_ours`).
    """

    def __init__(self, dtype: str, layout: str = "bhnd") -> None:
        import numpy as np

        from pycudaflash.testing import numpy_dtype

        self.np = np
        self.dtype = numpy_dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.rng = np.random.default_rng(0)
        self.layout = layout

    def _view(self, base: Any) -> Any:
        """A (B, N, H, D) GPUArray viewed as (B, H, N, D) through its strides."""
        if self.layout != "bnhd" or len(base.shape) != 4:
            return base
        import pycuda.gpuarray as gpuarray

        B, N, H, D = base.shape
        it = base.dtype.itemsize
        return gpuarray.GPUArray((B, H, N, D), base.dtype, gpudata=base.gpudata,
                                 strides=(N * H * D * it, D * it, H * D * it, it), base=base)

    def randn(self, shape: Tuple[int, ...]) -> Any:
        import pycuda.gpuarray as gpuarray

        host = self.rng.standard_normal(_storage_shape(shape, self.layout), dtype=self.np.float32)
        return self._view(gpuarray.to_gpu(host.astype(self.dtype)))

    def empty(self, shape: Tuple[int, ...], float32: bool = False) -> Any:
        import pycuda.gpuarray as gpuarray

        dt = self.np.float32 if float32 else self.dtype
        return self._view(gpuarray.empty(_storage_shape(shape, self.layout), dt))

    def host(self, x: Any) -> Any:
        if self.layout == "bnhd" and len(x.shape) == 4:
            x = x.base  # the (B, N, H, D) storage; .get() of a strided view is not supported
            return x.get().astype(self.np.float32).transpose(0, 2, 1, 3)
        return x.get().astype(self.np.float32)

    def sync(self) -> None:
        import pycuda.driver as drv

        drv.Context.synchronize()


@dataclass
class InputSet:
    """One independent set of inputs and our output buffers."""

    q: Any
    k: Any
    v: Any
    dout: Any
    out: Any
    lse: Any
    dq: Any
    dk: Any
    dv: Any


def make_sets(arr: Any, shape: Tuple[int, int, int, int], n: int) -> List[InputSet]:
    """``n`` input sets of shape (B, H, N, D) with our output buffers."""
    sets = []
    for _ in range(n):
        sets.append(InputSet(
            q=arr.randn(shape), k=arr.randn(shape), v=arr.randn(shape), dout=arr.randn(shape),
            out=arr.empty(shape), lse=arr.empty(shape[:3], float32=True),
            dq=arr.empty(shape), dk=arr.empty(shape), dv=arr.empty(shape),
        ))
    arr.sync()
    return sets


def n_sets_needed(set_bytes: int, min_sets: int, min_mb: float, cap: int = 64) -> int:
    """Number of input sets: at least ``min_sets`` and at least ``min_mb`` in all."""
    need = math.ceil(min_mb * 1e6 / max(1, set_bytes))
    return max(1, min(cap, max(min_sets, need)))


# --------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------


@dataclass
class Measure:
    """Median time and throughput of one pass of one implementation."""

    ms: float = math.nan
    tflops: float = math.nan
    timing: Optional[dict] = None
    error: Optional[str] = None

    def as_dict(self) -> dict:
        return {"ms": self.ms, "tflops": self.tflops, "timing": self.timing, "error": self.error}


@dataclass
class ImplResult:
    """Forward and backward of one implementation on one config."""

    name: str
    fwd: Measure = field(default_factory=Measure)
    bwd: Measure = field(default_factory=Measure)
    check: Dict[str, float] = field(default_factory=dict)  # ours vs this peer
    error: Optional[str] = None

    def as_dict(self) -> dict:
        return {"name": self.name, "fwd": self.fwd.as_dict(), "bwd": self.bwd.as_dict(),
                "check_vs_ours": self.check, "error": self.error}


@dataclass
class ConfigResult:
    """Every measurement of one (dtype, D, N, causal) config."""

    dtype: str
    D: int
    N: int
    causal: bool
    B: int
    H: int
    n_sets: int
    set_mb: float
    ours: ImplResult
    peers: List[ImplResult] = field(default_factory=list)
    ref_check: Dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "dtype": self.dtype, "D": self.D, "N": self.N, "causal": self.causal, "B": self.B, "H": self.H,
            "n_sets": self.n_sets, "set_mb": self.set_mb, "ours": self.ours.as_dict(),
            "peers": [p.as_dict() for p in self.peers], "ref_check": self.ref_check,
        }


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def _measure(timing: Any, flops: float) -> Measure:
    from pycudaflash.timing import tflops

    return Measure(ms=timing.median_ms, tflops=tflops(flops, timing.median_ms), timing=timing.as_dict())


# --------------------------------------------------------------------------
# pycudaflash
# --------------------------------------------------------------------------


def settle(seconds: float) -> None:
    """Wait for all of the device's work, then leave it idle ``seconds``
    (the same start for every implementation's timed calls: see --settle)."""
    import pycuda.driver as drv

    drv.Context.synchronize()
    if seconds > 0:
        time.sleep(seconds)


def run_ours(sets: List[InputSet], causal: bool, args: argparse.Namespace, stream: Any,
             flops_f: float, flops_b: float) -> ImplResult:
    """Time pycudaflash's forward, then (after one forward per set) its backward."""
    from pycudaflash import flash_attn_backward, flash_attn_forward
    from pycudaflash.timing import time_cuda

    res = ImplResult("pycudaflash")
    n = len(sets)

    # dtype= names the element type of bfloat16 GPUArrays (opaque '<V2'); torch
    # tensors identify themselves through __dlpack__ and merely agree with it.
    dtype = args.dtype

    def fwd(i: int) -> None:
        s = sets[i]
        flash_attn_forward(s.q, s.k, s.v, causal=causal, stream=stream, out=s.out, lse=s.lse,
                           dtype=dtype)

    def bwd(i: int) -> None:
        s = sets[i]
        flash_attn_backward(s.dout, s.q, s.k, s.v, s.out, s.lse, causal=causal,
                            deterministic=args.deterministic, stream=stream, dq=s.dq, dk=s.dk, dv=s.dv,
                            dtype=dtype)

    try:
        settle(args.settle)
        timing = time_cuda(fwd, stream=stream, warmup=args.warmup, repeat=args.reps, rotate=n)
        res.fwd = _measure(timing, flops_f)
    except Exception as exc:
        res.fwd.error = _reason(exc)
        res.bwd.error = "no forward"
        return res
    try:
        for i in range(n):  # every set's out/lse, whatever reps covered
            fwd(i)
        stream.synchronize()
        timing = time_cuda(bwd, stream=stream, warmup=args.warmup, repeat=args.reps, rotate=n)
        res.bwd = _measure(timing, flops_b)
    except Exception as exc:
        res.bwd.error = _reason(exc)
    stream.synchronize()
    return res


def merge_rounds(rounds: List[ImplResult], flops_f: float, flops_b: float) -> ImplResult:
    """One implementation's rounds of a config as one result: the first
    round's name, error and checks, each pass timed by all calls of all
    rounds (an error in any round makes that pass an error)."""
    from pycudaflash.timing import TimingResult

    first = rounds[0]
    if len(rounds) == 1:
        return first
    res = ImplResult(first.name, check=dict(first.check), error=first.error)
    for pas, flops in (("fwd", flops_f), ("bwd", flops_b)):
        ms = [getattr(r, pas) for r in rounds]
        bad = next((m for m in ms if m.error or m.timing is None), None)
        if bad is not None:
            setattr(res, pas, Measure(error=bad.error or "not timed"))
            continue
        times = [t for m in ms for t in m.timing["times_ms"]]
        setattr(res, pas, _measure(TimingResult.from_times(times), flops))
    return res


def reference_check(arr: Any, s: InputSet, causal: bool) -> Dict[str, float]:
    """Relative-norm errors of ours against the float64 reference on slice [0, 0]."""
    from pycudaflash.reference import reference_backward, reference_forward
    from pycudaflash.testing import relative_error

    def host(x: Any) -> Any:
        return arr.host(x)[:1, :1]

    q, k, v, dout = host(s.q), host(s.k), host(s.v), host(s.dout)
    ref_out, ref_lse = reference_forward(q, k, v, causal=causal)
    rdq, rdk, rdv = reference_backward(dout, q, k, v, causal=causal)
    pairs = (("out", s.out, ref_out), ("lse", s.lse, ref_lse), ("dq", s.dq, rdq), ("dk", s.dk, rdk),
             ("dv", s.dv, rdv))
    return {name: relative_error(host(got), ref) for name, got, ref in pairs}


# --------------------------------------------------------------------------
# torch peers
# --------------------------------------------------------------------------


def peer_backends(torch: Any, dtype: str) -> List[Tuple[str, Any, Optional[str]]]:
    """``(name, SDPBackend member or None, reason if unavailable)`` for this dtype."""
    wanted = [("torch-mem-eff", "EFFICIENT_ATTENTION")]
    if dtype != "float32":
        wanted = [("torch-flash", "FLASH_ATTENTION")] + wanted + [("torch-cudnn", "CUDNN_ATTENTION")]
    try:
        from torch.nn.attention import SDPBackend
    except Exception as exc:
        return [(name, None, f"torch.nn.attention is unavailable ({_reason(exc)})") for name, _ in wanted]
    out = []
    for name, member in wanted:
        be = getattr(SDPBackend, member, None)
        missing = None if be is not None else f"SDPBackend.{member} not in torch {torch.__version__}"
        out.append((name, be, missing))
    return out


def time_torch(torch: Any, fn: Callable[[int], Any], *, warmup: int, repeat: int, rotate: int) -> Any:
    """Like ``time_cuda`` for torch's current stream, with ``torch.cuda.Event``."""
    from pycudaflash.timing import TimingResult

    for n in range(warmup):
        fn(n % rotate)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
    for r in range(repeat):
        starts[r].record()
        fn((warmup + r) % rotate)
        ends[r].record()
    ends[-1].synchronize()
    return TimingResult.from_times([s.elapsed_time(e) for s, e in zip(starts, ends)])


def _torch_rel(torch: Any, got: Any, ref: Any) -> float:
    a, b = got.detach().double(), ref.detach().double()
    den = float(torch.linalg.vector_norm(b))
    return float(torch.linalg.vector_norm(a - b)) / max(den, 1e-300)


def run_peer(torch: Any, name: str, backend: Any, sets: List[InputSet], causal: bool,
             args: argparse.Namespace, flops_f: float, flops_b: float, ours: ImplResult,
             check: bool = True) -> ImplResult:
    """Time one torch SDPA backend on the same inputs; with ``check``, compare it with ours on set 0."""
    from torch.nn.attention import sdpa_kernel

    F = torch.nn.functional
    res = ImplResult(name)
    n = len(sets)
    graphs: List[Any] = []
    try:
        with sdpa_kernel(backend):
            if check:  # against ours on set 0 (ours' buffers hold its results)
                s0 = sets[0]
                qg, kg, vg = (t.detach().requires_grad_(True) for t in (s0.q, s0.k, s0.v))
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                gq, gk, gv = torch.autograd.grad(o, (qg, kg, vg), s0.dout)
                if ours.fwd.error is None:
                    res.check["out"] = _torch_rel(torch, s0.out, o)
                if ours.bwd.error is None:
                    res.check.update(dq=_torch_rel(torch, s0.dq, gq), dk=_torch_rel(torch, s0.dk, gk),
                                     dv=_torch_rel(torch, s0.dv, gv))
                del qg, kg, vg, o, gq, gk, gv

            def fwd(i: int) -> Any:
                s = sets[i]
                return F.scaled_dot_product_attention(s.q, s.k, s.v, is_causal=causal)

            settle(args.settle)
            with torch.no_grad():
                timing = time_torch(torch, fwd, warmup=args.warmup, repeat=args.reps, rotate=n)
                res.fwd = _measure(timing, flops_f)

            for s in sets:
                leaves = tuple(t.detach().requires_grad_(True) for t in (s.q, s.k, s.v))
                graphs.append((F.scaled_dot_product_attention(*leaves, is_causal=causal), leaves, s.dout))

            def bwd(i: int) -> Any:
                o_i, leaves_i, dout_i = graphs[i]
                return torch.autograd.grad(o_i, leaves_i, dout_i, retain_graph=True)

            timing = time_torch(torch, bwd, warmup=args.warmup, repeat=args.reps, rotate=n)
            res.bwd = _measure(timing, flops_b)
    except Exception as exc:
        res.error = _reason(exc)
        if res.fwd.error is None and math.isnan(res.fwd.ms):
            res.fwd.error = res.error
        if res.bwd.error is None and math.isnan(res.bwd.ms):
            res.bwd.error = res.error
    finally:
        graphs.clear()  # free the retained graphs
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return res


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------

#: Short names of the implementations in table headers.
SHORT_NAMES = {"pycudaflash": "ours", "torch-flash": "flash", "torch-mem-eff": "mem-eff",
               "torch-cudnn": "cudnn"}


def _short(name: str) -> str:
    return SHORT_NAMES.get(name, name)


def _f(x: Optional[float], digits: int = 2) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def _ratio(ours: float, peer: float) -> float:
    return ours / peer if peer and not math.isnan(peer) else math.nan


def table_columns(results: Sequence[ConfigResult]) -> List[str]:
    """Headers: the config, then per pass our time, every implementation's
    TFLOP/s and ours / the first peer."""
    peers = [_short(p.name) for p in results[0].peers] if results else []
    cols = ["dtype", "D", "N", "causal", "B", "H"]
    for pas in ("fwd", "bwd"):
        cols += [f"{pas} ms", f"{pas} ours"] + [f"{pas} {p}" for p in peers]
        if peers:
            cols.append(f"{pas} ours/{peers[0]}")
    return cols


def table_row(r: ConfigResult) -> List[str]:
    """One row per config: times in ms, throughputs in TFLOP/s, n/a where a run failed."""
    row = [r.dtype, str(r.D), str(r.N), "yes" if r.causal else "no", str(r.B), str(r.H)]
    for pas in ("fwd", "bwd"):
        ours = getattr(r.ours, pas)
        peers = [getattr(p, pas) for p in r.peers]
        row += [_f(ours.ms, 3), _f(ours.tflops)] + [_f(m.tflops) for m in peers]
        if peers:
            row.append(_f(_ratio(ours.tflops, peers[0].tflops)))
    return row


def print_table(results: Sequence[ConfigResult]) -> None:
    """Aligned table of :func:`table_columns` and one :func:`table_row` per config."""
    if not results:
        return
    cols = table_columns(results)
    rows = [table_row(r) for r in results]
    widths = [max(len(x[c]) for x in [cols] + rows) for c in range(len(cols))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths))

    print(line(cols))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(line(row))


def write_plot(path: str, results: List[ConfigResult]) -> None:
    """PNG of TFLOP/s against N: one panel per (D, causal), one line per implementation and pass.

    Each implementation keeps its colour in every panel; forward lines are
    solid, backward lines dashed.  A run that failed (``n/a``) leaves a gap.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted({r.D for r in results})
    modes = sorted({r.causal for r in results})
    names: List[str] = []
    for r in results:
        for impl in [r.ours] + r.peers:
            if impl.name not in names:
                names.append(impl.name)
    colours = {name: f"C{i % 10}" for i, name in enumerate(names)}
    fig, axes = plt.subplots(len(dims), len(modes), figsize=(6 * len(modes), 4 * len(dims)),
                             squeeze=False)
    for a, d in enumerate(dims):
        for b, c in enumerate(modes):
            ax = axes[a][b]
            rs = sorted((r for r in results if r.D == d and r.causal == c), key=lambda r: r.N)
            series: Dict[Tuple[str, str], List[Tuple[int, float]]] = {}
            for r in rs:
                for impl in [r.ours] + r.peers:
                    for pas, m in (("fwd", impl.fwd), ("bwd", impl.bwd)):
                        if not math.isnan(m.tflops):
                            series.setdefault((impl.name, pas), []).append((r.N, m.tflops))
            for (name, pas), pts in series.items():
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", color=colours[name], linestyle="-" if pas == "fwd" else "--",
                        label=f"{_short(name)} {pas}")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{rs[0].dtype if rs else ''} D={d} {'causal' if c else 'non-causal'}")
            ax.set_xlabel("sequence length N")
            ax.set_ylabel("TFLOP/s")
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            if series:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def _import_pycudaflash() -> None:
    """Make the package importable when the script runs from a source checkout."""
    try:
        import pycudaflash  # noqa: F401
    except ImportError:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import pycudaflash  # noqa: F401


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = parse_args(argv)
    _import_pycudaflash()

    # torch first, so that its CUDA initialisation creates the primary context
    # that pycudaflash then shares.
    torch: Any = None
    if args.no_peer:
        no_peer_reason = "--no-peer was given"
    else:
        try:
            import torch as _torch

            if not _torch.cuda.is_available():
                raise RuntimeError("torch.cuda.is_available() is False")
            _torch.cuda.init()
            _torch.empty(1, device="cuda")
            _torch.cuda.synchronize()
            torch = _torch
            no_peer_reason = ""
        except Exception as exc:
            no_peer_reason = f"torch is not usable ({_reason(exc)})"

    from pycudaflash import cuda_backend, cuda_status
    from pycudaflash.timing import attention_flops

    usable, why = cuda_status()
    if not usable:
        print(f"CUDA is not usable: {why}", file=sys.stderr)
        return 2
    ctx = cuda_backend.activate()
    import pycuda.driver as drv

    stream = drv.Stream()
    device = ctx.get_device()
    env = {
        "device": device.name(),
        "compute_capability": ".".join(map(str, device.compute_capability())),
        "torch": getattr(torch, "__version__", None),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        env["compile_info"] = {k: str(v) for k, v in cuda_backend.compile_info().items()}
    except Exception as exc:
        env["compile_info"] = _reason(exc)
    print(f"device: {env['device']} (sm_{env['compute_capability'].replace('.', '')}), "
          f"torch: {env['torch'] or 'n/a'}, dtype: {args.dtype}, layout: {args.layout}")
    if torch is None:
        print(f"peer columns unavailable: {no_peer_reason}; timing pycudaflash only")
        arr: Any = PycudaArrays(args.dtype, args.layout)
        peers: List[Tuple[str, Any, Optional[str]]] = []
    else:
        arr = TorchArrays(torch, args.dtype, args.layout)
        peers = peer_backends(torch, args.dtype)
        if args.peers:
            keep = {f"torch-{n.strip()}" for n in args.peers.split(",") if n.strip()}
            unknown = keep - {name for name, _, _ in peers}
            if unknown:
                raise SystemExit(f"--peers: {sorted(unknown)} not among {[n for n, _, _ in peers]}")
            peers = [p for p in peers if p[0] in keep]

    modes = {"none": [False], "causal": [True], "both": [False, True]}[args.causal]
    results: List[ConfigResult] = []
    status = 0
    try:
        for D in args.head_dim:
            for N in args.seqlen:
                for causal in modes:
                    B, H = args.tokens // N, args.hd_total // D
                    shape = (B, H, N, D)
                    elems = B * H * N * D
                    set_bytes = arr.itemsize * elems * 8 + 4 * B * H * N  # q k v dout out dq dk dv, lse
                    n = n_sets_needed(set_bytes, args.min_sets, args.min_mb)
                    print(f"\n== {args.dtype} D={D} N={N} causal={'yes' if causal else 'no'} B={B} H={H}: "
                          f"{n} input sets of {set_bytes / 1e6:.0f} MB")
                    sets = make_sets(arr, shape, n)
                    ff = attention_flops(B, H, N, N, D, causal=causal)
                    fb = attention_flops(B, H, N, N, D, causal=causal, backward=True)
                    ours = run_ours(sets, causal, args, stream, ff, fb)
                    for label, m in (("fwd", ours.fwd), ("bwd", ours.bwd)):
                        if m.error:
                            print(f"  pycudaflash {label}: n/a ({m.error})")
                            status = 1
                    cres = ConfigResult(args.dtype, D, N, causal, B, H, n, set_bytes / 1e6, ours)
                    if N <= 4096 and ours.fwd.error is None and ours.bwd.error is None:
                        try:
                            cres.ref_check = reference_check(arr, sets[0], causal)
                            print("  ours vs float64 reference (b=0, h=0): "
                                  + ", ".join(f"{k} {v:.2e}" for k, v in cres.ref_check.items()))
                        except Exception as exc:
                            print(f"  reference check failed: {_reason(exc)}")
                    for name, be, missing in peers:
                        if missing:
                            p = ImplResult(name, error=missing)
                            p.fwd.error = p.bwd.error = missing
                        else:
                            arr.sync()
                            p = run_peer(torch, name, be, sets, causal, args, ff, fb, ours)
                        cres.peers.append(p)
                        if p.error:
                            print(f"  {name}: n/a ({p.error})")
                        if p.check:
                            print(f"  ours vs {name} (set 0): max relative-norm error "
                                  f"{max(p.check.values()):.2e} ("
                                  + ", ".join(f"{k} {v:.2e}" for k, v in p.check.items()) + ")")
                    # Further rounds (--rounds): every implementation again, in the same order.
                    later: Dict[str, List[ImplResult]] = {impl.name: [] for impl in [cres.ours] + cres.peers}
                    for _ in range(args.rounds - 1):
                        later[ours.name].append(run_ours(sets, causal, args, stream, ff, fb))
                        for name, be, missing in peers:
                            if not missing:
                                arr.sync()
                                later[name].append(run_peer(torch, name, be, sets, causal, args, ff, fb, ours,
                                                            check=False))
                    cres.ours = merge_rounds([cres.ours] + later[ours.name], ff, fb)
                    cres.peers = [merge_rounds([p] + later[p.name], ff, fb) for p in cres.peers]
                    print_table([cres])
                    results.append(cres)
                    del sets
                    if torch is not None:
                        torch.cuda.synchronize()
                        torch.cuda.empty_cache()
    finally:
        stream.synchronize()
        cuda_backend.deactivate()

    ratio_peer = _short(results[0].peers[0].name) if results and results[0].peers else None
    print("\n== summary (ms: pycudaflash median time; other columns TFLOP/s"
          + (f"; ours/{ratio_peer} = ratio of TFLOP/s)" if ratio_peer else ")"))
    print_table(results)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"env": env, "args": vars(args), "results": [r.as_dict() for r in results]},
                      fh, indent=2, default=str)
        print(f"wrote {args.json}")
    plot = args.plot or (os.path.splitext(args.json)[0] + ".png" if args.json else None)
    if plot and results:
        try:
            write_plot(plot, results)
            print(f"wrote {plot}")
        except Exception as exc:
            print(f"plot failed: {_reason(exc)}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
