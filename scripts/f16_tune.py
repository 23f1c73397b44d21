"""Tile sweep of the float16 kernels against torch SDPA's flash backend (development tool).

    python3 scripts/f16_tune.py sweep        # every config of CONFIG_SETS[$F16_TUNE_SET], TF/s table
    python3 scripts/f16_tune.py profile      # one fwd + bwd call each, for ncu
"""

import os
import sys
import time

import numpy as np
import torch

from pycudaflash import compiler, cuda_backend, flash_attn_backward, flash_attn_forward

cuda_backend.activate()

# (head dim, spec for PYCUDAFLASH_TILES, which passes it changes)
CONFIG_SETS = {
    "fwd": [
        (64, "", "both"),
        (64, "h64:fwd_mt=1,fwd_bc=128", "fwd"),
        (128, "", "both"),
        (128, "h128:fwd_mt=1,fwd_bc=64", "fwd"),
        (256, "", "both"),
        (256, "h256:fwd_warps=8", "fwd"),
    ],
    "bwd": [
        (64, "", "bwd"),
        (64, "h64:bwd_br=64", "bwd"),
        (64, "h64:bwd_bc=64", "bwd"),
        (128, "", "bwd"),
        (128, "h128:bwd_br=32", "bwd"),
        (128, "h128:bwd_bc=64", "bwd"),
        (128, "h128:bwd_br=128,bwd_bc=64", "bwd"),
        (256, "", "bwd"),
        (256, "h256:bwd_br=64", "bwd"),
    ],
}
CONFIGS = CONFIG_SETS[os.environ.get("F16_TUNE_SET", "fwd")]
SHAPES = [(4096, False), (16384, True)]


def timed(fn, reps=15):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return float(np.median(ts))


def inputs(D, N):
    B, H = 16384 // N, 2048 // D
    return [torch.randn(B, H, N, D, device="cuda", dtype=torch.float16) for _ in range(4)]


def flops(q, causal):
    B, H, N, D = q.shape
    return 4 * B * H * N * N * D * (0.5 if causal else 1.0)


def warm():
    variants = set()
    for hd, spec, _ in CONFIGS:
        os.environ["PYCUDAFLASH_TILES"] = spec
        for kind in ("fwd", "bwd"):
            arch = compiler.arch_of_current_device()
            p = compiler.pass_name(kind, "float16", arch, hd)
            variants.add((p, tuple(sorted(compiler.defines(p, hd, "none", "float16", arch).items()))))
    os.environ["PYCUDAFLASH_TILES"] = ""
    t = time.perf_counter()
    try:
        compiler.warm_cache(jobs=16, variants=[(p, dict(d)) for p, d in variants])
    except Exception as exc:
        print("warm failed:", str(exc)[:2000], flush=True)
    print(f"warm {len(variants)} variants {time.perf_counter() - t:.0f} s", flush=True)


def sweep():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    warm()
    peer = {}
    for hd, spec, which in CONFIGS:
        os.environ["PYCUDAFLASH_TILES"] = spec
        for N, causal in SHAPES:
          try:
            q, k, v, do = inputs(hd, N)
            key = (hd, N, causal)
            if key not in peer:
                tq, tk, tv = (x.detach().requires_grad_() for x in (q, k, v))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    f = timed(lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal))
                    o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                    b = timed(lambda: torch.autograd.grad(o, (tq, tk, tv), do, retain_graph=True))
                peer[key] = (f, b)
            out, lse = flash_attn_forward(q, k, v, causal=causal)
            f = timed(lambda: flash_attn_forward(q, k, v, causal=causal, out=out)) if which != "bwd" else float("nan")
            b = (timed(lambda: flash_attn_backward(do, q, k, v, out, lse, causal=causal))
                 if which != "fwd" else float("nan"))
            fl = flops(q, causal)
            pf, pb = peer[key]
            print(f"D{hd:3d} N{N:5d} c{int(causal)} {spec or 'default':34s} fwd {fl / f / 1e9:5.0f} TF/s "
                  f"({pf / f:4.2f}x)  bwd {2.5 * fl / b / 1e9:5.0f} TF/s ({pb / b:4.2f}x)   "
                  f"flash {fl / pf / 1e9:4.0f}/{2.5 * fl / pb / 1e9:4.0f}", flush=True)
          except Exception as exc:
            print(f"D{hd} {spec}: failed: {str(exc)[-300:]}", flush=True)
    os.environ["PYCUDAFLASH_TILES"] = ""


def profile():
    q, k, v, do = inputs(int(os.environ.get("F16_TUNE_D", "128")), 4096)
    out, lse = flash_attn_forward(q, k, v)
    for _ in range(2):
        flash_attn_forward(q, k, v, out=out)
        flash_attn_backward(do, q, k, v, out, lse)
    torch.cuda.synchronize()


if __name__ == "__main__":
    {"sweep": sweep, "profile": profile}[sys.argv[1]]()
