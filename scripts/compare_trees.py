#!/usr/bin/env python3
"""Time two checkouts of pycudaflash against each other, kernel by kernel, in one process.

Usage::

    git worktree add /tmp/before <commit>        # or: git archive <commit> | tar x -C /tmp/before
    python3 scripts/compare_trees.py --before /tmp/before --json after_vs_before.json

Method
------
* The checkout given by ``--before`` (a folder holding ``pycudaflash/`` and
  ``cuda_src/``) is copied to a temporary folder with its package renamed
  ``pycudaflash_before``, so that both versions import side by side in one
  process and share one CUDA context; the current checkout is ``after``.
* Every config (dtype, head dim ``D``, sequence length ``N``, causal or not)
  uses ``B = tokens // N`` and ``H = hd_total // D`` as ``scripts/bench.py``
  does, (B, H, N, D) torch tensors of standard-normal values, and enough
  rotated input sets to defeat the L2 cache.  Both versions get the same
  inputs and write into buffers passed in (``out=``, ``lse=``, ``dq=`` ...),
  on torch's current stream: the figure is the kernels' own time.
* Timing: CUDA events around each call; per config and pass, ``--rounds``
  rounds in which before and after (and torch SDPA's flash and cuDNN
  backends, for float16/bfloat16, with ``--peers``) each run ``--reps``
  timed calls after ``--warmup`` untimed ones and a ``--settle`` pause; the
  median of all timed calls is reported.  Alternating in rounds puts a
  change of the GPU's clock on every implementation alike.
* Before timing, the outputs of both versions are compared with each other
  (they must agree to the float tolerance of the dtype) so that a faster
  wrong kernel cannot pass.
* Table: microseconds per call and ``after/before`` (below 1: faster now).
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def load_before(root: Path) -> Any:
    """Import the checkout at ``root`` as package ``pycudaflash_before``."""
    tmp = Path(tempfile.mkdtemp(prefix="pcf_before_"))
    shutil.copytree(root / "pycudaflash", tmp / "pycudaflash_before")
    shutil.copytree(root / "cuda_src", tmp / "cuda_src")
    sys.path.insert(0, str(tmp))
    return importlib.import_module("pycudaflash_before")


def timed(fn: Callable[[int], Any], n_sets: int, reps: int, warmup: int, settle: float) -> List[float]:
    """Per-call device times (us) of ``fn(set index)`` on torch's current stream."""
    for i in range(warmup):
        fn(i % n_sets)
    torch.cuda.synchronize()
    time.sleep(settle)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for i, (a, b) in enumerate(ev):
        a.record()
        fn(i % n_sets)
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e3 for a, b in ev]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True, help="checkout to compare with (pycudaflash/, cuda_src/)")
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float16", "float32"])
    p.add_argument("--head-dim", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--causal", choices=("none", "causal", "both"), default="both")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hd-total", type=int, default=2048)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--settle", type=float, default=0.1)
    p.add_argument("--min-mb", type=float, default=256.0, help="total size of the rotated input sets")
    p.add_argument("--peers", action="store_true", help="also time torch SDPA flash and cuDNN (16-bit dtypes)")
    p.add_argument("--json", type=Path)
    a = p.parse_args()

    import pycudaflash as after

    before = load_before(a.before)
    impls = {"before": before, "after": after}
    modes = {"none": [False], "causal": [True], "both": [False, True]}[a.causal]
    rows: List[Dict[str, Any]] = []
    print(f"device {torch.cuda.get_device_name()}; rounds {a.rounds} x reps {a.reps}; us per call, buffers passed")
    print("| dtype | D | N | causal | fwd before | fwd after | after/before | bwd before | bwd after | after/before"
          + (" | fwd flash | fwd cuDNN | bwd flash | bwd cuDNN |" if a.peers else " |"))
    print("|---" * (10 + 4 * a.peers) + "|")
    for dtype_name in a.dtype:
        dtype = getattr(torch, dtype_name)
        for D in a.head_dim:
            if dtype == torch.float32 and D > 128:
                continue
            for N in a.seqlen:
                B, H = max(1, a.tokens // N), max(1, a.hd_total // D)
                set_mb = 7 * B * H * N * D * dtype.itemsize / 2**20
                n_sets = max(2, int(a.min_mb // max(set_mb, 1e-9)) + 1)
                n_sets = min(n_sets, 16)
                g = torch.Generator(device="cuda").manual_seed(N * D)
                sets = [[torch.randn(B, H, N, D, device="cuda", dtype=dtype, generator=g) for _ in range(4)]
                        for _ in range(n_sets)]
                for causal in modes:
                    bufs = {name: [dict(out=torch.empty_like(s[0]),
                                        lse=torch.empty(B, H, N, device="cuda", dtype=torch.float32),
                                        dq=torch.empty_like(s[0]), dk=torch.empty_like(s[0]),
                                        dv=torch.empty_like(s[0])) for s in sets] for name in impls}

                    def fwd(mod: Any, name: str) -> Callable[[int], Any]:
                        def run(i: int) -> Any:
                            q, k, v, _ = sets[i]
                            bb = bufs[name][i]
                            return mod.flash_attn_forward(q, k, v, causal=causal, out=bb["out"], lse=bb["lse"])
                        return run

                    def bwd(mod: Any, name: str) -> Callable[[int], Any]:
                        def run(i: int) -> Any:
                            q, k, v, do = sets[i]
                            bb = bufs[name][i]
                            return mod.flash_attn_backward(do, q, k, v, bb["out"], bb["lse"], causal=causal,
                                                           dq=bb["dq"], dk=bb["dk"], dv=bb["dv"])
                        return run

                    for name, mod in impls.items():  # outputs for the backward, and a cross-check
                        for i in range(n_sets):
                            fwd(mod, name)(i)
                    for name, mod in impls.items():
                        bwd(mod, name)(0)
                    torch.cuda.synchronize()
                    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
                    for key in ("out", "dq", "dk", "dv"):
                        x, y = bufs["before"][0][key].float(), bufs["after"][0][key].float()
                        err = ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()
                        if not err <= tol:
                            raise SystemExit(f"{dtype_name} D {D} N {N} causal {causal}: {key} of before and "
                                             f"after differ by {err:.2e} (relative to max), more than {tol}")
                    calls = {("fwd", n): fwd(m, n) for n, m in impls.items()}
                    calls.update({("bwd", n): bwd(m, n) for n, m in impls.items()})
                    if a.peers and dtype != torch.float32:
                        for peer, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                                              ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                            graphs = []
                            try:
                                with sdpa_kernel(backend):
                                    for s in sets:
                                        qg, kg, vg = (t.detach().requires_grad_() for t in s[:3])
                                        graphs.append((qg, kg, vg, F.scaled_dot_product_attention(
                                            qg, kg, vg, is_causal=causal), s[3]))
                            except RuntimeError as e:  # (a backend without this shape)
                                print(f"  {peer} n/a: {str(e).splitlines()[0][:100]}")
                                continue

                            def pf(i: int, backend: Any = backend) -> Any:
                                with sdpa_kernel(backend):
                                    q, k, v, _ = sets[i]
                                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                            def pb(i: int, graphs: Any = graphs) -> Any:
                                qg, kg, vg, o, do = graphs[i]
                                return torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)

                            calls[("fwd", peer)], calls[("bwd", peer)] = pf, pb
                    times: Dict[Any, List[float]] = {c: [] for c in calls}
                    for _ in range(a.rounds):
                        for c, fn in calls.items():
                            times[c] += timed(fn, n_sets, a.reps, a.warmup, a.settle)
                    med = {f"{p_}_{n}": statistics.median(t) for (p_, n), t in times.items()}
                    row = dict(dtype=dtype_name, D=D, N=N, B=B, H=H, causal=causal, **med,
                               fwd_ratio=med["fwd_after"] / med["fwd_before"],
                               bwd_ratio=med["bwd_after"] / med["bwd_before"])
                    rows.append(row)
                    line = (f"| {dtype_name} | {D} | {N} | {'yes' if causal else 'no'} | {med['fwd_before']:.1f} | "
                            f"{med['fwd_after']:.1f} | {row['fwd_ratio']:.3f} | {med['bwd_before']:.1f} | "
                            f"{med['bwd_after']:.1f} | {row['bwd_ratio']:.3f} |")
                    if a.peers:
                        line += "".join(f" {med[c]:.1f} |" if c in med else " n/a |"
                                        for c in ("fwd_flash", "fwd_cudnn", "bwd_flash", "bwd_cudnn"))
                    print(line, flush=True)
    worst = max(max(r["fwd_ratio"], r["bwd_ratio"]) for r in rows)
    print(f"worst after/before: {worst:.3f} over {len(rows)} configs")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
