"""Tile and kernel-family sweep of the float16 kernels against torch SDPA's flash backend (development tool).

    python3 scripts/f16_tune.py sweep        # every config of CONFIG_SETS[$F16_TUNE_SET], TF/s table
    python3 scripts/f16_tune.py profile      # one fwd + bwd call each, for ncu

A config is (head dim, $PYCUDAFLASH_TILES spec, $PYCUDAFLASH_WGMMA value):
the tile sizes and, on Hopper, the kernel family ('1': wgmma, '0': mma.sync).
Each measurement runs `REPS` calls back to back between two CUDA events
(median of `ROUNDS`), on 4 rotated input sets with preallocated outputs: an
output freed every call would synchronise the device and time the host.
scripts/bench.py is the reference benchmark; this is the quick comparison
while a kernel or a tile choice changes.
"""

import os
import sys
import time

import numpy as np
import torch

import pycudaflash
from pycudaflash import compiler, cuda_backend, flash_attn_backward, flash_attn_forward

cuda_backend.activate()

# (head dim, spec for PYCUDAFLASH_TILES, PYCUDAFLASH_WGMMA)
CONFIG_SETS = {
    "family": [(hd, "", fam) for hd in (64, 128, 256) for fam in ("1", "0")],
    "fwd": [
        (64, "", "1"),
        (64, "h64:fwd90_bc=192", "1"),
        (64, "", "0"),
        (64, "h64:fwd_mt=1,fwd_bc=128", "0"),
        (128, "", "0"),
        (128, "h128:fwd_mt=1,fwd_bc=64", "0"),
        (256, "", "0"),
        (256, "h256:fwd_warps=8", "0"),
    ],
    "bwd": [
        (64, "", "1"),
        (64, "h64:bwd90_br=128", "1"),
        (64, "", "0"),
        (64, "h64:bwd_br=64", "0"),
        (128, "", "0"),
        (128, "h128:bwd_br=32", "0"),
        (128, "h128:bwd_bc=64", "0"),
        (256, "", "0"),
        (256, "h256:bwd_br=64", "0"),
    ],
}
# Hopper block shapes: warpgroups per block (fwd90_wgs, bwd90_wgs), keys a
# forward step (fwd90_bc) and blocks per SM the forward's registers allow
# (fwd90_minb; 2 means at most 128 registers).  The defaults are the first
# entry of each head dim.
CONFIG_SETS["blocks"] = [
    (64, "", "1"),
    (64, "h64:fwd90_bc=128,fwd90_minb=1,bwd90_wgs=2", "1"),
    (64, "h64:fwd90_wgs=3,fwd90_bc=128,fwd90_minb=1", "1"),
    (96, "", "1"),
    (96, "h96:fwd90_bc=32,fwd90_minb=2", "1"),
    (128, "", "1"),
    (128, "h128:fwd90_bc=32,fwd90_minb=2", "1"),
    (128, "h128:fwd90_wgs=3,fwd90_bc=64", "1"),
]
# Hopper forward grid (fwd90_persist): one block per query tile (0) or
# persistent blocks taking jobs from a job counter (1); their job order
# (fwd90_group: heads per group, 0 chosen per call, 1 one head at a time).
CONFIG_SETS["persist"] = [
    (64, "", "1"),
    (96, "", "1"),
    (96, "h96:fwd90_persist=0", "1"),
    (128, "", "1"),
    (128, "h128:fwd90_persist=0", "1"),
    (128, "h128:fwd90_group=1", "1"),
]
CONFIGS = CONFIG_SETS[os.environ.get("F16_TUNE_SET", "family")]
# (sequence length, causal) pairs, e.g. F16_TUNE_SHAPES="1024:0,4096:1"
SHAPES = [(int(n), c == "1") for n, c in (x.split(":") for x in
                                          os.environ.get("F16_TUNE_SHAPES", "4096:0,16384:1").split(","))]
SETS = 4
REPS, ROUNDS = 10, 3


def timed(fn):
    """ms per call (see the module docstring)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(ROUNDS):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        for _ in range(REPS):
            fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / REPS)
    return float(np.median(ts))


class Problem:
    """Rotated inputs and preallocated outputs of one (D, N, causal) shape."""

    def __init__(self, D, N, causal):
        B, H = 16384 // N, 2048 // D
        self.causal = causal
        self.flops = 4 * B * H * N * N * D * (0.5 if causal else 1.0)
        new = lambda: torch.randn(B, H, N, D, device="cuda", dtype=torch.float16)  # noqa: E731
        self.qkv = [(new(), new(), new()) for _ in range(SETS)]
        self.dout = [new() for _ in range(SETS)]
        self.out = [(torch.empty_like(q), torch.empty(B, H, N, device="cuda")) for q, _, _ in self.qkv]
        self.grads = [tuple(torch.empty_like(x) for x in qkv) for qkv in self.qkv]
        self.calls = 0

    def _next(self):
        self.calls += 1
        return self.calls % SETS

    def forward(self):
        i = self._next()
        flash_attn_forward(*self.qkv[i], causal=self.causal, out=self.out[i][0], lse=self.out[i][1])

    def backward(self):
        i = self._next()
        dq, dk, dv = self.grads[i]
        flash_attn_backward(self.dout[i], *self.qkv[i], *self.out[i], causal=self.causal, dq=dq, dk=dk, dv=dv)

    def fill_forward(self):
        """out and lse of every set from the current kernels (for the backward)."""
        for _ in range(SETS):
            self.forward()

    def peer(self):
        """torch flash forward and backward, ms per call."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa = torch.nn.functional.scaled_dot_product_attention
        graphs = []
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for q, k, v in self.qkv:
                leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
                graphs.append((leaves, sdpa(*leaves, is_causal=self.causal)))

            def fwd():
                sdpa(*self.qkv[self._next()], is_causal=self.causal)

            def bwd():
                i = self._next()
                torch.autograd.grad(graphs[i][1], graphs[i][0], self.dout[i], retain_graph=True)

            return timed(fwd), timed(bwd)


def warm():
    """Compile every variant the configs need, in parallel."""
    arch = compiler.arch_of_current_device()
    variants = set()
    for hd, spec, family in CONFIGS:
        os.environ.update(PYCUDAFLASH_TILES=spec, PYCUDAFLASH_WGMMA=family)
        for kind in ("fwd", "bwd"):
            p = compiler.pass_name(kind, "float16", arch, hd)
            variants.add((p, tuple(sorted(compiler.defines(p, hd, "none", "float16", arch).items()))))
    os.environ.update(PYCUDAFLASH_TILES="", PYCUDAFLASH_WGMMA="1")
    t = time.perf_counter()
    compiler.warm_cache(jobs=16, variants=[(p, dict(d)) for p, d in variants])
    print(f"warm {len(variants)} variants {time.perf_counter() - t:.0f} s", flush=True)


def sweep():
    warm()
    for N, causal in SHAPES:
        for D in sorted({hd for hd, _, _ in CONFIGS}):
            prob = Problem(D, N, causal)
            pf, pb = prob.peer()
            for hd, spec, family in CONFIGS:
                if hd != D:
                    continue
                os.environ.update(PYCUDAFLASH_TILES=spec, PYCUDAFLASH_WGMMA=family)
                pycudaflash.clear_plans()  # (the tuning variables are read when a signature is planned)
                try:
                    f = timed(prob.forward)
                    prob.fill_forward()
                    b = timed(prob.backward)
                except Exception as exc:
                    print(f"D{D} {spec} wgmma={family}: failed: {str(exc)[-300:]}", flush=True)
                    continue
                label = f"{spec or 'default'} wgmma={family}"
                print(f"D{D:3d} N{N:5d} c{int(causal)} {label:34s} "
                      f"fwd {prob.flops / f / 1e9:5.0f} TF/s ({pf / f:4.2f}x)  "
                      f"bwd {2.5 * prob.flops / b / 1e9:5.0f} TF/s ({pb / b:4.2f}x)   "
                      f"flash {prob.flops / pf / 1e9:4.0f}/{2.5 * prob.flops / pb / 1e9:4.0f}", flush=True)
    os.environ.update(PYCUDAFLASH_TILES="", PYCUDAFLASH_WGMMA="1")


def profile():
    prob = Problem(int(os.environ.get("F16_TUNE_D", "128")), 4096, False)
    prob.fill_forward()
    for _ in range(2):
        prob.forward()
        prob.backward()
    torch.cuda.synchronize()


if __name__ == "__main__":
    {"sweep": sweep, "profile": profile}[sys.argv[1]]()
