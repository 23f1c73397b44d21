#!/usr/bin/env python3
"""Host time of the same work on the main thread, on a new Python thread and inside a backward
that torch's autograd engine runs (on its own thread for CUDA tensors).

Work, each timed over 300 calls, medians of 5 rounds, microseconds a call:

* a pure-Python loop (the interpreter's own speed on that thread);
* ``pycudaflash.torch._backward_impl`` on a tiny bfloat16 problem (1, 1, 128, 64): the eager
  backward's allocations, plan lookup and launches;
* ``torch.empty_like`` of q.

Run on a CUDA machine: ``python3 scripts/host_threads.py`` (docs/performance.md h17).
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Callable, Dict, List, Tuple

import torch

from pycudaflash import torch as pt
from pycudaflash.torch import flash_attention


def time_it(fn: Callable[[], object], n: int = 300) -> float:
    """Microseconds a call of ``fn`` over ``n`` calls."""
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    dev = torch.device("cuda")
    shape = (1, 1, 128, 64)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, dout = (torch.randn(shape, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(4))
    out, lse = flash_attention(q, k, v, return_lse=True)
    opts = ("none", -1, -1, 64 ** -0.5)

    def pure() -> int:
        s = 0
        for i in range(100):
            s += i
        return s

    work: Dict[str, Callable[[], object]] = {
        "pure": pure,
        "impl": lambda: pt._backward_impl(dout, q, k, v, out, lse, None, None, opts, False),
        "alloc": lambda: torch.empty_like(q),
    }
    res: Dict[Tuple[str, str], List[float]] = {}

    def run_all(where: str) -> None:
        for name, fn in work.items():
            res.setdefault((where, name), []).append(time_it(fn))

    class Probe(torch.autograd.Function):
        """Identity whose backward times the work on the thread autograd runs it on."""

        @staticmethod
        def forward(ctx, a):  # type: ignore[override]
            return a.view_as(a)

        @staticmethod
        def backward(ctx, d):  # type: ignore[override]
            run_all("autograd")
            return d

    a = q.clone().requires_grad_()
    for _ in range(5):
        run_all("main")
        th = threading.Thread(target=run_all, args=("thread",))
        th.start()
        th.join()
        y = Probe.apply(a)
        torch.autograd.grad(y, a, torch.ones_like(y))
        torch.cuda.synchronize()
    print("| where | pure Python loop us | _backward_impl us | torch.empty_like us |")
    print("|---|---:|---:|---:|")
    for where in ("main", "thread", "autograd"):
        print(f"| {where} | " + " | ".join(f"{statistics.median(res[(where, n)]):.2f}" for n in work) + " |")


if __name__ == "__main__":
    main()
