"""Quick check of the Hopper (wgmma) kernels on a GPU: accuracy, then speed (development tool).

    python3 scripts/sm90_dev.py [acc] [bwd] [speed]

acc / bwd: forward / backward of off-grid shapes and mask kinds against a
float64 reference, beside the same attention computed by torch in the input
dtype; speed: TF/s of the Hopper kernels, the mma.sync kernels
($PYCUDAFLASH_WGMMA=0) and torch SDPA's flash backend, in one process.
The property suite is the real check; this is the quick look while a
kernel changes.
"""

import os
import sys
import time

import numpy as np
import torch

from pycudaflash import cuda_backend, flash_attn_backward, flash_attn_forward

cuda_backend.activate()
TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def ref(q, k, v, causal, mask=None, dtype=torch.float64):
    s = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) / q.shape[-1] ** 0.5
    if causal:
        Nq, Nk = s.shape[-2:]
        s = s.masked_fill(torch.ones(Nq, Nk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s.float() if dtype != torch.float64 else s, -1).to(dtype)
    return (p @ v.to(dtype))


def grads(q, k, v, do, causal, mask, dtype):
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    o = ref(q, k, v, causal, mask, dtype)
    return torch.autograd.grad(o, (q, k, v), do.to(dtype))


def acc_bwd():
    torch.manual_seed(1)
    worst = 0.0
    for dt in ("float16", "bfloat16"):
        for D in (64, 96, 128, 40, 192, 256, 200):
            for (B, H, Nq, Nk, causal, masked) in ((2, 3, 128, 128, False, False), (1, 2, 113, 257, True, False),
                                                   (1, 2, 300, 97, False, True), (2, 1, 1, 17, False, False),
                                                   (1, 1, 513, 700, True, False)):
                q, k, v = (torch.randn(B, H, n, D, device="cuda", dtype=TORCH[dt]) for n in (Nq, Nk, Nk))
                do = torch.randn(B, H, Nq, D, device="cuda", dtype=TORCH[dt])
                mask = (torch.rand(Nq, Nk, device="cuda") > 0.3) if masked else None
                try:
                    out, lse = flash_attn_forward(q, k, v, causal=causal, mask=mask)
                    res = {}
                    for det in (False, True):
                        dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
                        flash_attn_backward(do, q, k, v, out, lse, causal=causal, mask=mask, dq=dq, dk=dk, dv=dv,
                                            deterministic=det)
                        res[det] = (dq, dk, dv)
                    torch.cuda.synchronize()
                except Exception as exc:
                    print(f"{dt} D{D} {Nq}x{Nk}: FAILED {str(exc)[-500:]}", flush=True)
                    continue
                g64 = grads(q, k, v, do, causal, mask, torch.float64)
                glow = grads(q, k, v, do, causal, mask, TORCH[dt])
                line = []
                bad = False
                for det in (False, True):
                    for name, x, r, rl in zip("qkv", res[det], g64, glow):
                        e, eb = rel(x, r), rel(rl, r)
                        ok = bool(torch.isfinite(x).all()) and e <= 2 * eb + 2e-3
                        bad |= not ok
                        worst = max(worst, e / eb)
                        line.append(f"d{name}{'D' if det else ''} {e:.1e}/{eb:.1e}{'' if ok else '!'}")
                print(f"bwd {dt:8s} D{D:3d} {Nq:4d}x{Nk:4d} c{int(causal)} m{int(masked)} " + " ".join(line)
                      + ("   <-- BAD" if bad else ""), flush=True)
    print(f"bwd worst ratio to torch-same-dtype error: {worst:.2f}", flush=True)


def acc():
    torch.manual_seed(0)
    worst = 0.0
    for dt in ("float16", "bfloat16"):
        for D in (64, 96, 128, 192, 256, 40, 200):
            for (B, H, Nq, Nk, causal, masked) in ((2, 3, 128, 128, False, False), (1, 2, 113, 257, True, False),
                                                   (1, 2, 300, 97, False, True), (2, 1, 1, 17, False, False),
                                                   (1, 1, 513, 513, True, False)):
                q = torch.randn(B, H, Nq, D, device="cuda", dtype=TORCH[dt])
                k = torch.randn(B, H, Nk, D, device="cuda", dtype=TORCH[dt])
                v = torch.randn(B, H, Nk, D, device="cuda", dtype=TORCH[dt])
                mask = (torch.rand(Nq, Nk, device="cuda") > 0.3) if masked else None
                out = torch.full_like(q, float("nan"))
                lse = torch.full((B, H, Nq), float("nan"), device="cuda")
                try:
                    flash_attn_forward(q, k, v, causal=causal, mask=mask, out=out, lse=lse)
                    torch.cuda.synchronize()
                except Exception as exc:
                    print(f"{dt} D{D} {Nq}x{Nk}: FAILED {str(exc)[-500:]}", flush=True)
                    continue
                r64 = ref(q, k, v, causal, mask)
                rlow = ref(q, k, v, causal, mask, TORCH[dt])
                fin = bool(torch.isfinite(out).all())
                e, eb = rel(out, r64), rel(rlow, r64)
                worst = max(worst, e / eb)
                flag = "" if fin and e <= 2 * eb + 1e-3 else "   <-- BAD"
                print(f"{dt:8s} D{D:3d} B{B} H{H} {Nq:4d}x{Nk:4d} c{int(causal)} m{int(masked)}  out err {e:.2e}"
                      f" (torch {dt} {eb:.2e}) finite {fin}{flag}", flush=True)
                if flag and D == 64 and Nq == 128:
                    bad = ((out.double() - r64).abs() > 0.05).nonzero()
                    print("   bad (b,h,row,col) sample:", bad[:12].tolist(), "count", len(bad), flush=True)
    print(f"worst ratio to torch-same-dtype error: {worst:.2f}", flush=True)


def timed(fn, reps=10, rounds=3):
    """ms per call: the median over `rounds` of `reps` back-to-back calls
    between two events (the queue stays full, so host overhead hides)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rounds):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / reps)
    return float(np.median(ts))


def speed_config(D, N, causal, dt=torch.float16):
    """Forward and backward TF/s of the Hopper kernels, the mma.sync kernels and torch flash."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H = 16384 // N, 2048 // D
    sets = [[torch.randn(B, H, N, D, device="cuda", dtype=dt) for _ in range(3)] for _ in range(4)]
    do = [torch.randn(B, H, N, D, device="cuda", dtype=dt) for _ in range(4)]
    # Outputs preallocated (as scripts/bench.py): a freed device allocation
    # would synchronise the device every call.
    outs = [(torch.empty_like(st[0]), torch.empty(B, H, N, device="cuda")) for st in sets]
    grads_out = [tuple(torch.empty_like(x) for x in st) for st in sets]
    it = iter(range(10 ** 9))
    fl = 4 * B * H * N * N * D * (0.5 if causal else 1.0)

    def ours_f():
        i = next(it) % 4
        flash_attn_forward(*sets[i], causal=causal, out=outs[i][0], lse=outs[i][1])

    def peer_f():
        i = next(it) % 4
        torch.nn.functional.scaled_dot_product_attention(*sets[i], is_causal=causal)

    def ours_b():
        i = next(it) % 4
        dq, dk, dv = grads_out[i]
        flash_attn_backward(do[i], *sets[i], *outs[i], causal=causal, dq=dq, dk=dk, dv=dv)

    graphs = []
    for st in sets:
        tq, tk, tv = (x.detach().requires_grad_() for x in st)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            graphs.append(((tq, tk, tv), torch.nn.functional.scaled_dot_product_attention(tq, tk, tv,
                                                                                         is_causal=causal)))

    def peer_b():
        i = next(it) % 4
        torch.autograd.grad(graphs[i][1], graphs[i][0], do[i], retain_graph=True)

    for kind, ours, peer, flops in (("fwd", ours_f, peer_f, fl), ("bwd", ours_b, peer_b, 2.5 * fl)):
        res = {}
        for name, env in (("wgmma", "1"), ("mma.sync", "0")):
            os.environ["PYCUDAFLASH_WGMMA"] = env
            if kind == "bwd":  # out and lse of this kernel family's forward
                for st, (o, l) in zip(sets, outs):
                    flash_attn_forward(*st, causal=causal, out=o, lse=l)
            res[name] = timed(ours)
        os.environ["PYCUDAFLASH_WGMMA"] = "1"
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            res["flash"] = timed(peer)
        print(f"{kind} D{D:3d} N{N:5d} c{int(causal)}  " + "  ".join(
            f"{k} {flops / t / 1e9:5.0f}" for k, t in res.items()) +
            f"   ratio wgmma/flash {res['flash'] / res['wgmma']:.2f}", flush=True)


def speed():
    """$SM90_DEV_DIMS (head dims), $SM90_DEV_SHORT (two shapes only) and
    $SM90_DEV_SPECS ('|'-separated $PYCUDAFLASH_TILES values to compare)."""
    dims = [int(x) for x in os.environ.get("SM90_DEV_DIMS", "64 128 256").split()]
    shapes = [(4096, False), (16384, True)] if os.environ.get("SM90_DEV_SHORT") else \
        [(1024, False), (4096, False), (16384, True)]
    for spec in os.environ.get("SM90_DEV_SPECS", "").split("|"):
        os.environ["PYCUDAFLASH_TILES"] = spec
        print(f"tiles: {spec or 'default'}", flush=True)
        for D in dims:
            for N, causal in shapes:
                speed_config(D, N, causal)


def warm():
    from pycudaflash import compiler

    todo = [(p, d) for p, d in compiler.all_variants(("float16", "bfloat16"), "sm_90")
            if p.endswith("_sm90") or (d["MASK_MODE"] == 0 and d["ELEM_BF16"] == 0)
            or (p == "bwd_f16" and d["HEAD_DIM"] > 96)]
    t = time.perf_counter()
    compiler.warm_cache(jobs=16, variants=todo)
    print(f"warm: {len(todo)} variants in {time.perf_counter() - t:.0f} s", flush=True)


if __name__ == "__main__":
    warm()
    for what in sys.argv[1:] or ["acc", "speed"]:
        {"acc": acc, "bwd": acc_bwd, "speed": speed}[what]()
