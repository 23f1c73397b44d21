#!/usr/bin/env python3
"""Attention as users call it, against torch SDPA (cuDNN and flash backends), in TFLOP/s.

For each cell (head dim D, sequence length N, causal or not; B = tokens // N, H = width // D,
layout (B, H, N, D), standard-normal inputs) three figures per implementation and pass:

* ``op``: the torch operator as a training script writes it, ``pycudaflash.torch.flash_attention(q,
  k, v, causal=...)`` on torch's current (default) stream with no output buffers, called back to
  back; its backward is ``torch.autograd.grad(out, (q, k, v), dout)`` of one recorded forward,
  exactly as SDPA's is timed;
* ``kernel``: ``pycudaflash.flash_attn_forward / backward`` with every output passed in (the
  launches alone, no allocation);
* SDPA ``cudnn`` and ``flash``: ``scaled_dot_product_attention`` under ``sdpa_kernel``, timed as
  ``op`` is.

Timing: CUDA events around ``--reps`` calls after ``--warmup``; every implementation of a cell
is timed once per round, ``--rounds`` rounds in turn with ``--settle`` seconds of idle device
before each measurement (the clock lags the power draw), and the median of the rounds is
reported.  The inputs of a cell total at least three times the L2 cache at N >= 4096 (B * N
tokens of width D * H), so that they are read from memory.  FLOPs as FlashAttention counts
them: 4 B H N^2 D forward, halved when causal, times 2.5 for the backward.

    python scripts/op_speed.py [--dtype bfloat16] [--head-dim 64 128 256] [--seqlen 1024 4096 16384]
                               [--passes fwd bwd] [--json results.json]

(``--passes bwd`` times the backward alone, for work on the backward; a pass left out prints as
``-``.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable, Dict, List

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import pycudaflash
from pycudaflash.torch import flash_attention

SDPA = torch.nn.functional.scaled_dot_product_attention
PEERS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def events_ms(fn: Callable[[], Any], warmup: int, reps: int, settle: float) -> float:
    """Mean ms of one ``fn()`` over ``reps`` back-to-back calls (CUDA events on the current stream)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    time.sleep(settle)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def cell(D: int, N: int, causal: bool, a: argparse.Namespace) -> Dict[str, Any]:
    B, H = max(1, a.tokens // N), a.width // D
    dt = getattr(torch, a.dtype)
    g = torch.Generator(device="cuda").manual_seed(D * N + causal)
    q, k, v, dout = (torch.randn(B, H, N, D, device="cuda", dtype=dt, generator=g) for _ in range(4))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def grads(out: torch.Tensor) -> Callable[[], Any]:
        return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)

    out, lse = pycudaflash.flash_attn_forward(q, k, v, causal=causal)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    impls: Dict[str, Dict[str, Callable[[], Any]]] = {
        "op": {"fwd": lambda: flash_attention(q, k, v, causal=causal),
               "bwd": grads(flash_attention(*leaves, causal=causal))},
        "kernel": {"fwd": lambda: pycudaflash.flash_attn_forward(q, k, v, causal=causal, out=out, lse=lse),
                   "bwd": lambda: pycudaflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal,
                                                                  dq=dq, dk=dk, dv=dv)},
    }
    for name, backend in PEERS.items():
        def peer(backend=backend) -> Dict[str, Callable[[], Any]]:
            with sdpa_kernel(backend):
                rec = SDPA(*leaves, is_causal=causal)
            def fwd() -> Any:
                with sdpa_kernel(backend):
                    return SDPA(q, k, v, is_causal=causal)
            return {"fwd": fwd, "bwd": grads(rec)}
        try:
            impls[name] = peer()
        except RuntimeError as exc:  # (a head dim the backend does not take)
            print(f"# {name} n/a at D {D} N {N}: {str(exc).splitlines()[0][:100]}")
    times: Dict[str, Dict[str, List[float]]] = {n: {p: [] for p in a.passes} for n in impls}
    for _ in range(a.rounds):
        for name, passes in impls.items():
            for p in a.passes:
                times[name][p].append(events_ms(passes[p], a.warmup, a.reps, a.settle))
    flops = 4 * B * H * N * N * D / (2 if causal else 1)
    row: Dict[str, Any] = dict(D=D, N=N, causal=causal, B=B, H=H)
    for name in impls:
        for p in a.passes:
            ms = statistics.median(times[name][p])
            row[f"{name}_{p}_ms"] = round(ms, 4)
            row[f"{name}_{p}_tflops"] = round(flops * (2.5 if p == "bwd" else 1) / ms / 1e9, 1)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16"))
    p.add_argument("--head-dim", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--causal", choices=("none", "causal", "both"), default="both")
    p.add_argument("--passes", nargs="+", choices=("fwd", "bwd"), default=["fwd", "bwd"])
    p.add_argument("--tokens", type=int, default=65536, help="B = tokens // N")
    p.add_argument("--width", type=int, default=2048, help="H = width // D")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--settle", type=float, default=0.2)
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args()
    modes = {"none": [False], "causal": [True], "both": [False, True]}[a.causal]
    rows = []
    print("| D | N | causal | op fwd / bwd | kernel fwd / bwd | cuDNN fwd / bwd | flash fwd / bwd "
          "| op / cuDNN fwd / bwd |")
    print("|---|---|---|---|---|---|---|---|")
    for D in a.head_dim:
        for N in a.seqlen:
            for causal in modes:
                r = cell(D, N, causal, a)
                rows.append(r)
                def tf(n: str) -> str:
                    if n + f"_{a.passes[0]}_tflops" not in r:
                        return "n/a"
                    return " / ".join(str(r.get(f"{n}_{p}_tflops", "-")) for p in ("fwd", "bwd"))

                def over(p: str) -> str:
                    return f"{r['op_' + p + '_tflops'] / r['cudnn_' + p + '_tflops']:.2f}" if p in a.passes else "-"
                ratio = f"{over('fwd')} / {over('bwd')}" if f"cudnn_{a.passes[0]}_tflops" in r else "n/a"
                print(f"| {D} | {N} | {causal} | {tf('op')} | {tf('kernel')} | {tf('cudnn')} | {tf('flash')} "
                      f"| {ratio} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(dtype=a.dtype, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
