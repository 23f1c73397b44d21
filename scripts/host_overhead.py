#!/usr/bin/env python3
"""Host time per call of pycudaflash's entry points beside torch SDPA, on a tiny problem.

Method
------
* Problem: q, k, v of shape (B, H, N, D) = (1, 1, 128, 64) by default,
  standard normal torch tensors, bfloat16 on CUDA and float32 on the CPU,
  non-causal, default scale ``D ** -0.5``.  The kernels of such a problem
  take a few microseconds, so the time a call costs is the Python / dispatch
  / launch work on the host.
* Every measured callable first runs ``--warmup`` calls (200); then
  ``--repeats`` (9) rounds, in each of which every callable in turn runs
  ``--calls`` (1000) calls back to back, timed with ``time.perf_counter()``,
  then ``torch.cuda.synchronize()`` (CUDA only) and the clock read again.
  Interleaving the callables makes a change of the host's speed (the GPU
  machine's CPU is shared and drifts) fall on all of them alike.
  host us/call = loop time before the sync / calls; wall us/call = the time
  including the final sync / calls (when the device keeps up, the two are
  about equal; a wall time well above the host time means the device, not
  the host, is the bottleneck).  The median over the rounds of each is
  reported.
* Measured callables (each that raises is reported as n/a with the reason):

  - ``ours torch-op fwd``: ``flash_attention(q, k, v)``, inputs not requiring grad;
  - ``ours torch-op fwd (requires_grad)``: the same on inputs that require
    grad (an autograd node is built and dropped each call);
  - ``ours torch-op bwd op``: ``torch.ops.pycudaflash.flash_bwd(...)`` called
    directly on ``out, lse`` from ``flash_attention(..., return_lse=True)``;
  - ``ours autograd bwd``: ``torch.autograd.grad(out, (q, k, v), dout,
    retain_graph=True)`` on one graph built once;
  - ``ours plain fwd (buffers)`` / ``(no buffers)``: ``flash_attn_forward``
    with preallocated ``out``/``lse`` tensors, or allocating them;
  - ``ours plain bwd (buffers)``: ``flash_attn_backward`` into preallocated
    ``dq, dk, dv``;
  - ``sdpa fwd``: ``F.scaled_dot_product_attention(q, k, v)`` with torch's
    default backend selection and, on CUDA, under ``sdpa_kernel`` with the
    flash and cuDNN backends (the context is entered once around the whole
    measurement, not per call);
  - ``sdpa autograd bwd``: as ``ours autograd bwd`` on a graph built by SDPA
    (default selection; on CUDA also flash and cuDNN);
  - ``torch.empty``: one allocation of the output's size, as a floor.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

Entry = Tuple[str, Callable[[], Any], Callable[[], Any]]  # (name, build -> callable, context factory)


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="default bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--calls", type=int, default=1000, help="calls per timed loop")
    p.add_argument("--warmup", type=int, default=200, help="untimed calls before the timed loops")
    p.add_argument("--repeats", type=int, default=9,
                   help="rounds of one timed loop per callable, interleaved (median reported)")
    p.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no GPU")
    if a.dtype is None:
        a.dtype = "bfloat16" if a.device == "cuda" else "float32"
    if min(a.batch, a.heads, a.seqlen, a.head_dim, a.calls, a.repeats) < 1 or a.warmup < 0:
        p.error("sizes, --calls and --repeats must be >= 1, --warmup >= 0")
    return a


def entries(a: argparse.Namespace) -> List[Entry]:
    """The measured callables, each built lazily so that a failing setup is reported, not fatal."""
    from pycudaflash import flash_attn_backward, flash_attn_forward
    from pycudaflash.torch import flash_attention

    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    shape = (a.batch, a.heads, a.seqlen, a.head_dim)
    scale = a.head_dim ** -0.5
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v, dout = (torch.randn(shape, generator=gen, device=dev, dtype=dtype) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    none = contextlib.nullcontext

    def ours_bwd_op() -> Callable[[], Any]:
        out, lse = flash_attention(q, k, v, return_lse=True)
        return lambda: torch.ops.pycudaflash.flash_bwd(dout, q, k, v, out, lse, None, None, "none", -1, -1,
                                                       scale, False)

    def autograd_bwd(attn: Callable[..., torch.Tensor]) -> Callable[[], Callable[[], Any]]:
        def build() -> Callable[[], Any]:
            out = attn(qg, kg, vg)
            return lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)
        return build

    def plain_fwd_buffers() -> Callable[[], Any]:
        out, lse = torch.empty_like(q), torch.empty(shape[:3], device=dev, dtype=torch.float32)
        return lambda: flash_attn_forward(q, k, v, out=out, lse=lse)

    def plain_bwd_buffers() -> Callable[[], Any]:
        out, lse = flash_attn_forward(q, k, v)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        return lambda: flash_attn_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv)

    sdpa = F.scaled_dot_product_attention
    backends = [("", none)]
    if dev.type == "cuda":
        backends += [(" (flash)", lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)),
                     (" (cudnn)", lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION))]
    return [
        ("ours torch-op fwd", lambda: lambda: flash_attention(q, k, v), none),
        ("ours torch-op fwd (requires_grad)", lambda: lambda: flash_attention(qg, kg, vg), none),
        ("ours torch-op bwd op", ours_bwd_op, none),
        ("ours autograd bwd", autograd_bwd(flash_attention), none),
        ("ours plain fwd (buffers)", plain_fwd_buffers, none),
        ("ours plain fwd (no buffers)", lambda: lambda: flash_attn_forward(q, k, v), none),
        ("ours plain bwd (buffers)", plain_bwd_buffers, none),
        *[("sdpa fwd" + tag, lambda: lambda: sdpa(q, k, v), ctx) for tag, ctx in backends],
        *[("sdpa autograd bwd" + tag, autograd_bwd(sdpa), ctx) for tag, ctx in backends],
        ("torch.empty", lambda: lambda: torch.empty(shape, device=dev, dtype=dtype), none),
    ]


def timed_loop(fn: Callable[[], Any], a: argparse.Namespace, sync: Callable[[], None]) -> Tuple[float, float]:
    """Host and wall microseconds per call of one loop of ``a.calls`` calls of ``fn``."""
    t0 = time.perf_counter()
    for _ in range(a.calls):
        fn()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    return (t1 - t0) / a.calls * 1e6, (t2 - t0) / a.calls * 1e6


def measure_all(built: List[Tuple[str, Callable[[], Any], Callable[[], Any]]], a: argparse.Namespace,
                sync: Callable[[], None]) -> Dict[str, Dict[str, Any]]:
    """``a.repeats`` rounds in which every callable runs one timed loop in turn, so that a change
    of the host's speed (a shared machine) falls on all of them alike; medians over the rounds."""
    times: Dict[str, List[Tuple[float, float]]] = {name: [] for name, _, _ in built}
    for name, fn, ctx in built:
        with ctx():
            for _ in range(a.warmup):
                fn()
        sync()
    for _ in range(a.repeats):
        for name, fn, ctx in built:
            with ctx():
                times[name].append(timed_loop(fn, a, sync))
    out = {}
    for name, ts in times.items():
        host, wall = [t[0] for t in ts], [t[1] for t in ts]
        out[name] = {"host_us": statistics.median(host), "wall_us": statistics.median(wall),
                     "host_us_all": host, "wall_us_all": wall}
    return out


def main() -> None:
    a = parse_args()
    cuda = a.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"device {name}, torch {torch.__version__}; (B, H, N, D) = "
          f"({a.batch}, {a.heads}, {a.seqlen}, {a.head_dim}) {a.dtype}; "
          f"{a.calls} calls x {a.repeats} repeats after {a.warmup} warm-up calls")
    results: List[Dict[str, Any]] = []
    built = []
    for label, build, ctx in entries(a):
        row: Dict[str, Any] = {"name": label}
        try:
            with ctx():
                fn = build()
                fn()
            built.append((label, fn, ctx))
        except Exception as e:  # reported, not fatal
            text = str(e).strip().replace("|", "/")
            row["error"] = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
            if cuda:
                sync()
        results.append(row)
    measured = measure_all(built, a, sync)
    for row in results:
        row.update(measured.get(row["name"], {}))

    print()
    print("| callable | host us/call | wall us/call |")
    print("|---|---:|---:|")
    for r in results:
        if "error" in r:
            print(f"| {r['name']} | n/a | n/a ({r['error']}) |")
        else:
            print(f"| {r['name']} | {r['host_us']:.1f} | {r['wall_us']:.1f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(a).items() if k != "json"}, "torch": torch.__version__,
                       "device_name": name, "results": results}, f, indent=1)
        print(f"\nwrote {a.json}")


if __name__ == "__main__":
    main()
