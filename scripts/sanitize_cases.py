"""Small forward+backward runs for every mask mode, for compute-sanitizer.

Usage: compute-sanitizer --tool memcheck python3 scripts/sanitize_cases.py [DTYPE ...]
(DTYPE among float32, float16, bfloat16; all three by default).  Each case
runs the forward, the atomic backward and the deterministic backward
on device arrays and checks the results against the float64 reference, so a
sanitizer run also proves the kernels computed the right thing.
"""

import sys

import ml_dtypes
import numpy as np

import pycuda.gpuarray as gpuarray

import pycudaflash as pf
from pycudaflash import cuda_backend
from pycudaflash.reference import reference_backward, reference_forward
from pycudaflash.testing import relative_error

# Sanity bounds per dtype; the tight bounds live in the test suite.
BOUNDS = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.5e-2}
NP_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
             "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def main(argv=None) -> int:
    dtypes = (argv if argv is not None else sys.argv[1:]) or list(BOUNDS)
    cuda_backend.activate()
    rng = np.random.default_rng(7)
    B, H, Nq, Nk = 2, 2, 70, 131
    cases = {
        "none": {},
        "causal_top_left": {"causal": True},
        "causal_bottom_right": {"causal": "bottom_right"},
        "window": {"window": (20, 7)},
        "key_lengths": {"key_lengths": np.array([0, 90], np.int32)},
        "bool_mask": {"mask": rng.random((B, 1, Nq, Nk)) > 0.4},
        "float_mask": {"mask": np.where(rng.random((Nq, Nk)) < 0.2, -np.inf,
                                        rng.standard_normal((Nq, Nk))).astype(np.float32)},
    }
    # Tiles of every kind in the kernels' block maps: full (keys 0..63 of the
    # first batch element), empty (its keys 64..127; the second one's rows from
    # 32 on) and partial (the rest), and a row that sees no key.
    bm = cases["bool_mask"]["mask"]
    bm[0, :, :, :64], bm[0, :, :, 64:128], bm[1, :, 32:, :] = True, False, False
    bm[:, :, 5, :] = False
    # Score and mask modifiers (their tensors on the host: copied into the workspace per call).
    doc = np.sort(rng.integers(0, 3, (B, max(Nq, Nk))), axis=1).astype(np.int32)
    cases["alibi_document"] = {"score_mod": "score - slope[h] * abs(i - j)", "mask_mod": "doc[b, i] == doc[b, j]",
                               "mod_tensors": {"slope": np.array([0.5, 0.25, 0.125, 0.0625], np.float32),
                                               "doc": doc}, "causal": "bottom_right"}
    cases["softcap"] = {"score_mod": "30 * tanh(score / 30)", "key_lengths": np.array([0, 90], np.int32)}
    # A bool mask and a mask modifier through a BlockMap (device arrays: its maps built once, then read).
    cases["block_map"] = {"mask": cases["bool_mask"]["mask"], "mask_mod": "doc[b, i] == doc[b, j]",
                          "mod_tensors": {"doc": doc}}
    failures = 0
    # Runs (dtype, D, sizes, the cases to run; None: all): head dims 64 and 37
    # (bucket 64) with every case; for 16-bit inputs also the other tile
    # layouts (buckets 128, 192, 256) with a few cases, and head dim 128 with
    # more query tiles than the device holds blocks at once (persistent
    # forward blocks run several of them); and k, v with fewer heads than q
    # (Hkv, last: groups of 2 and of 4).
    small = (B, H, Nq, Nk)
    runs = []
    for dt in dtypes:
        runs += [(dt, D, small, None, H) for D in (64, 37)]
        if dt != "float32":
            runs += [(dt, D, small, {"none", "causal_bottom_right", "bool_mask", "alibi_document", "block_map"}, H)
                     for D in (128, 150, 256)]
            runs.append((dt, 128, (4, 12, 300, 257), {"none", "causal_bottom_right"}, 12))
        runs += [(dt, 64, (2, 4, Nq, Nk), {"none", "causal_bottom_right", "bool_mask", "key_lengths", "alibi_document"},
                  hkv)
                 for hkv in (2, 1)]
    for dtype, D, (B, H, Nq, Nk), names, Hkv in runs:
        np_dtype = NP_DTYPES[dtype]
        q, k, v, do = (rng.standard_normal(s, dtype=np.float32).astype(np_dtype)
                       for s in ((B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D), (B, H, Nq, D)))
        gq, gk, gv, gdo = (gpuarray.to_gpu(x) for x in (q, k, v, do))
        all_cases = dict(cases)
        if dtype != "float32":  # a float mask in the input's own type (converted on the device)
            all_cases["float_mask_" + dtype] = {"mask": cases["float_mask"]["mask"].astype(np_dtype)}
        for name, kw in all_cases.items():
            if names is not None and name not in names:
                continue
            dkw = {key: (gpuarray.to_gpu(val) if key == "mask" else val) for key, val in kw.items()}
            if name == "block_map":
                dkw = {"block_map": pf.BlockMap(mask=dkw["mask"], mask_mod=kw["mask_mod"],
                                                mod_tensors={"doc": gpuarray.to_gpu(doc)})}
            dkw["dtype"] = dtype  # a bfloat16 GPUArray exports the opaque '<V2'
            out, lse = pf.flash_attn_forward(gq, gk, gv, **dkw)
            ro, rl = reference_forward(q, k, v, **kw)
            rdq, rdk, rdv = reference_backward(do, q, k, v, **kw)
            errs = [relative_error(out.get().astype(np.float64), ro)]
            for det in (False, True):
                dq, dk, dv = pf.flash_attn_backward(gdo, gq, gk, gv, out, lse, deterministic=det, **dkw)
                errs += [relative_error(x.get().astype(np.float64), r) for x, r in ((dq, rdq), (dk, rdk), (dv, rdv))]
            lse_h = lse.get()
            same_inf = np.array_equal(np.isneginf(lse_h), np.isneginf(rl))
            ok = same_inf and all(e <= BOUNDS[dtype] for e in errs)
            failures += not ok
            print(f"{dtype:8s} D={D:3d} B,H,Hkv,Nq,Nk={B},{H},{Hkv},{Nq},{Nk} {name:20s} max err {max(errs):.2e} lse -inf pattern {'ok' if same_inf else 'WRONG'}"
                  f" {'ok' if ok else 'FAIL'}", flush=True)
    failures += _torch_cases(rng)
    print("sanitize cases:", "all ok" if not failures else f"{failures} failed")
    cuda_backend.deactivate()
    return 1 if failures else 0


def _torch_cases(rng) -> int:
    """The torch operator's path (torch allocations, torch's current stream, device key
    lengths read in place, (B, N, H, D) views) and the plain API on a side stream."""
    try:
        import torch
    except ImportError:
        print("torch cases: skipped (torch is not installed)")
        return 0
    from pycudaflash.torch import flash_attention

    failures = 0
    B, H, Nq, Nk, D = 2, 3, 97, 130, 64
    side = torch.cuda.Stream()
    for tdt, ndt in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16"), (torch.float32, "float32")):
        qkv = torch.randn(B, Nk, 3, H, D, device="cuda").to(tdt)
        q, k, v = (qkv[:, -Nq:, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2))
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        kl = torch.tensor([Nk, 77], device="cuda", dtype=torch.int32)
        mask = torch.from_numpy(rng.random((1, H, Nq, Nk)) > 0.3).cuda()
        dout = torch.randn(B, H, Nq, D, device="cuda").to(tdt)
        kw = dict(causal="bottom_right", mask=mask)
        with torch.cuda.stream(side):
            out = flash_attention(q, k, v, key_lengths=kl, **kw)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
        host = [t.detach().float().cpu().numpy() for t in (q, k, v, dout)]
        hkw = dict(kw, mask=mask.cpu().numpy(), key_lengths=np.array([Nk, 77]))
        ro, _ = reference_forward(*host[:3], **hkw)
        rg = reference_backward(host[3], *host[:3], **hkw)
        errs = [relative_error(out.detach().float().cpu().numpy().astype(np.float64), ro)]
        errs += [relative_error(g.float().cpu().numpy().astype(np.float64), r) for g, r in zip((dq, dk, dv), rg)]
        ok = all(e <= BOUNDS[ndt] for e in errs)
        failures += not ok
        print(f"torch op {ndt:8s} side stream, device key lengths, bnhd views: max err {max(errs):.2e} "
              f"{'ok' if ok else 'FAIL'}", flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main())
