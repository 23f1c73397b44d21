"""Score and mask modifiers on every backend and dtype against the float64 reference: ALiBi with a
slope tensor, soft-capping, a bias table indexed by i - j, document masks and prefix-LM masks,
forward and backward, off the tile grid, with Nq != Nk, causal bands, key lengths and grouped K/V
heads.  The CUDA runs skip, with the reason, without PyCUDA or a GPU.

Bounds: float32 as the property suite's (tests/test_properties.py BOUNDS, per backend).  float16
and bfloat16 by the property suite's rule: twice the error of the same attention computed naively
in the dtype (pycudaflash.testing.lowp_reference_forward/backward, which apply the modifiers), plus
the suite's floor (LOWP_FLOOR), with atol the same fraction of the noise floors.
"""

from __future__ import annotations

import numpy as np
import pytest

from pycudaflash import flash_attn_backward, flash_attn_forward
from pycudaflash.reference import reference_backward, reference_forward
from pycudaflash.testing import (check, lowp_reference_backward, lowp_reference_forward, noise_floors,
                                 relative_error, to_host)
from test_properties import BOUNDS, LOWP_FLOOR

F32_BOUNDS = {backend: BOUNDS[(backend, "float32")] for backend in ("numpy", "cuda")}
DTYPES = ("float32", "float16", "bfloat16")

# (score_mod, mask_mod) pairs: each score and mask modifier of the issue, paired so that few
# kernel variants cover them.
MODS = {
    "alibi+document": ("score - slope[h] * abs(i - j)", "doc[b, i] == doc[b, j]"),
    "softcap+prefix_lm": ("30 * tanh(score / 30)", "(j <= i) | (j < prefix[b])"),
    "bias_table": ("score + table[h, min(max(i - j, -16), 16) + 16]", None),
}
# (B, H, Hkv, Nq, Nk, D, options): sizes off the tile grid, Nq != Nk, bands, key lengths, groups.
SHAPES = {
    "square": (2, 4, 4, 100, 100, 64, {}),
    "causal_longer_keys": (2, 4, 4, 77, 150, 64, dict(causal="bottom_right")),
    "key_lengths_gqa": (2, 4, 2, 130, 61, 64, dict(key_lengths=np.array([61, 40]), causal=True)),
    "head_dim_256": (1, 2, 2, 70, 90, 256, dict(causal=True)),
    # (long enough that the mask modifiers leave whole tiles empty and full: block maps)
    "long_documents": (1, 2, 2, 520, 390, 128, {}),
}


def _np_dtype(dtype: str):
    import ml_dtypes

    return {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]


def _tensors(B: int, H: int, n: int, seed: int) -> dict:
    g = np.random.default_rng(seed)
    doc = np.sort(g.integers(0, 4, (B, n)), axis=1).astype(np.int32)
    return dict(slope=(2.0 ** -np.arange(1, H + 1)).astype(np.float32), doc=doc,
                prefix=g.integers(0, n, B).astype(np.int32), table=g.standard_normal((H, 33)).astype(np.float32))


def _problem(shape: str, mods: str, dtype: str, seed: int = 3):
    B, H, Hkv, Nq, Nk, D, opts = SHAPES[shape]
    smod, mmod = MODS[mods]
    g = np.random.default_rng(seed)
    dt = _np_dtype(dtype)
    q, dout = (g.standard_normal((B, H, Nq, D)).astype(dt) for _ in range(2))
    k, v = (g.standard_normal((B, Hkv, Nk, D)).astype(dt) for _ in range(2))
    tensors = {n: t for n, t in _tensors(B, H, max(Nq, Nk), seed).items()
               if any(m and n + "[" in m for m in (smod, mmod))}
    return q, k, v, dout, dict(opts, score_mod=smod, mask_mod=mmod, mod_tensors=tensors)


def _bounds(backend: str, dtype: str, q, k, v, dout, kw: dict, ref: dict, floors: dict) -> dict:
    """rtol_norm per quantity: float32 fixed; 16-bit twice the naive baseline's error plus the floor."""
    if dtype == "float32":
        return F32_BOUNDS[backend]
    base = dict(zip(("out", "lse"), lowp_reference_forward(q, k, v, **kw)))
    if "dq" in ref:
        base.update(zip(("dq", "dk", "dv"), lowp_reference_backward(dout, q, k, v, **kw)))
    block = dict(zip(("out", "lse"), lowp_reference_forward(q, k, v, order="blockwise", **kw)))
    if "dq" in ref:
        block.update(zip(("dq", "dk", "dv"), lowp_reference_backward(dout, q, k, v, order="blockwise", **kw)))
    # the larger of the two orders' errors (see test_properties, LOWP_FLOOR)
    err = {n: max(relative_error(base[n], ref[n], floors[n]), relative_error(block[n], ref[n], floors[n]))
           for n in ref}
    return {n: 2.0 * err[n] + LOWP_FLOOR[dtype][n] for n in ref}


def _assert_matches(got: dict, q, k, v, dout, kw: dict, backend: str, dtype: str) -> None:
    ref_out, ref_lse = reference_forward(q, k, v, **kw)
    ref = dict(out=ref_out, lse=ref_lse)
    if "dq" in got:
        ref.update(zip(("dq", "dk", "dv"), reference_backward(dout, q, k, v, **kw)))
    floors = noise_floors(q, k, v, dout, **kw)
    b = _bounds(backend, dtype, q, k, v, dout, kw, ref, floors)
    sees_nothing = ~np.isfinite(ref_lse)
    bad = []
    for name, want in ref.items():
        exact = sees_nothing[..., None] if name in ("out", "dq") else None
        res = check(name, to_host(got[name]), want, rtol_norm=b[name], atol=b[name] * floors[name], exact=exact)
        if not res.ok:
            bad.append(str(res))
    assert not bad, "\n".join(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("mods", sorted(MODS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_modifiers_forward_and_backward(backend: str, dtype: str, mods: str, shape: str) -> None:
    q, k, v, dout, kw = _problem(shape, mods, dtype)
    out, lse = flash_attn_forward(q, k, v, **kw, backend=backend)
    grads = flash_attn_backward(dout, q, k, v, out, lse, **kw, backend=backend, deterministic=True)
    _assert_matches(dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2]), q, k, v, dout, kw, backend, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_soft_capping_where_the_scores_reach_the_cap(backend: str, dtype: str) -> None:
    """Soft-capping at 30 with scores of about +-32 (q times 4, scale 1): most scores sit where
    tanh saturates (and where its derivative is small), the 16-bit kernels' tanh included."""
    q, k, v, dout, kw = _problem("square", "softcap+prefix_lm", dtype)
    q = (q.astype(np.float32) * 4).astype(q.dtype)
    kw = dict(kw, scale=1.0)
    out, lse = flash_attn_forward(q, k, v, **kw, backend=backend)
    grads = flash_attn_backward(dout, q, k, v, out, lse, **kw, backend=backend, deterministic=True)
    _assert_matches(dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2]), q, k, v, dout, kw, backend, dtype)


@pytest.mark.gpu
def test_device_mod_tensors_are_read_in_place(cuda: None) -> None:
    """Mod tensors as torch CUDA tensors (read in place, no copy) through the torch operator,
    eagerly, with gradients; a repeated call reuses the plan with the new tensors' values."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from pycudaflash.torch import flash_attention

    q, k, v, dout, kw = _problem("square", "alibi+document", "float32")
    dev = {n: torch.from_numpy(np.ascontiguousarray(t)).cuda() for n, t in kw["mod_tensors"].items()}
    tq, tk, tv = (torch.from_numpy(x).cuda().requires_grad_() for x in (q, k, v))
    for scale_slope in (1.0, 3.0):  # (same signature: one plan, other values)
        dev["slope"].copy_(torch.from_numpy(kw["mod_tensors"]["slope"] * scale_slope))
        for t in (tq, tk, tv):
            t.grad = None
        out = flash_attention(tq, tk, tv, score_mod=kw["score_mod"], mask_mod=kw["mask_mod"], mod_tensors=dev)
        out.backward(torch.from_numpy(dout).cuda())
        host_kw = dict(kw, mod_tensors=dict(kw["mod_tensors"], slope=kw["mod_tensors"]["slope"] * scale_slope))
        got = dict(out=out.detach(), dq=tq.grad, dk=tk.grad, dv=tv.grad)
        _, lse = reference_forward(q, k, v, **host_kw)
        got["lse"] = lse  # (the operator returns no lse here)
        _assert_matches({n: (x.cpu().numpy() if hasattr(x, "cpu") else x) for n, x in got.items()},
                        q, k, v, dout, host_kw, "cuda", "float32")


@pytest.mark.parametrize("dtype", DTYPES)
def test_keys_a_mask_mod_excludes_hold_nan(backend: str, dtype: str) -> None:
    """A key that mask_mod hides from every query (document -1, which no query row has) is never
    read, on every backend: NaN stored in its k and v changes no result, forward or backward."""
    B, H, Nq, Nk, D = 2, 2, 70, 90, 64
    g = np.random.default_rng(9)
    dt = _np_dtype(dtype)
    q, dout = (g.standard_normal((B, H, Nq, D)).astype(dt) for _ in range(2))
    k, v = (g.standard_normal((B, H, Nk, D)).astype(dt) for _ in range(2))
    doc = np.sort(g.integers(0, 3, (B, Nk)), axis=1).astype(np.int32)
    hidden = np.zeros((B, Nk), bool)
    hidden[:, 80:] = True  # keys past every query row (Nq = 70) in a document of their own
    hidden[1, 75] = True
    doc[hidden] = -1
    assert (doc[:, :Nq] != -1).all()
    kw = dict(mask_mod="doc[b, i] == doc[b, j]", mod_tensors=dict(doc=doc))
    kp, vp = k.copy(), v.copy()
    kp[np.broadcast_to(hidden[:, None, :], kp.shape[:3])] = np.nan
    vp[np.broadcast_to(hidden[:, None, :], vp.shape[:3])] = np.nan
    clean = flash_attn_forward(q, k, v, **kw, backend=backend)
    dirty = flash_attn_forward(q, kp, vp, **kw, backend=backend)
    for a, b in zip(clean, dirty):
        assert np.array_equal(to_host(a).astype(np.float64), to_host(b).astype(np.float64)), "a hidden key's NaN leaked"
    g_clean = flash_attn_backward(dout, q, k, v, *clean, **kw, backend=backend)
    g_dirty = flash_attn_backward(dout, q, kp, vp, *dirty, **kw, backend=backend)
    for a, b in zip(g_clean, g_dirty):
        assert np.array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))
