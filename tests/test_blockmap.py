"""BlockMap: a bool mask and/or mask modifier whose block maps a caller keeps and every call reuses.

On the CPU: the arguments it refuses, how a call merges its mask, modifier and tensors, and that
the NumPy backend and torch CPU tensors give what the same call without it gives.  On the GPU:
the maps are built on the first call of each tile shape (into uninitialised memory, so a build
that did not run shows as wrong results), never again, and the results equal those of the call
that builds its maps itself, bit for bit, forward and deterministic backward.
"""

from __future__ import annotations

import numpy as np
import pytest

from pycudaflash import BlockMap, flash_attn_backward, flash_attn_forward
from pycudaflash.mods import score_mod

DOC = "doc[b, i] == doc[b, j]"


def _problem(B: int = 2, H: int = 3, Nq: int = 45, Nk: int = 61, D: int = 16, seed: int = 0):
    g = np.random.default_rng(seed)
    q, dout = (g.standard_normal((B, H, Nq, D)).astype(np.float32) for _ in range(2))
    k, v = (g.standard_normal((B, H, Nk, D)).astype(np.float32) for _ in range(2))
    doc = np.sort(g.integers(0, 4, (B, max(Nq, Nk))), axis=1).astype(np.int32)
    return q, k, v, dout, doc


def test_block_map_refuses_what_has_no_block_map() -> None:
    doc = np.zeros((1, 8), np.int32)
    with pytest.raises(ValueError, match="needs a bool mask, a mask_mod or both"):
        BlockMap()
    with pytest.raises(TypeError, match="must be a bool array"):
        BlockMap(mask=np.zeros((8, 8), np.float32))
    with pytest.raises(ValueError, match="mod_tensors given without a mask_mod"):
        BlockMap(mask=np.ones((8, 8), bool), mod_tensors=dict(doc=doc))
    with pytest.raises(TypeError, match="mod_tensors must be a mapping"):
        BlockMap(mask_mod=DOC, mod_tensors=[doc])
    with pytest.raises(ValueError, match="a score_mod was given as mask_mod"):
        BlockMap(mask_mod=score_mod("score * 2"))
    with pytest.raises(ValueError):
        BlockMap(mask_mod="doc[b, i] ==", mod_tensors=dict(doc=doc))  # (not an expression)


def test_a_call_takes_its_mask_from_the_block_map_only() -> None:
    q, k, v, _, doc = _problem()
    other = doc.copy()
    bm = BlockMap(mask_mod=DOC, mod_tensors=dict(doc=doc))
    with pytest.raises(ValueError, match="takes its mask and mask_mod from the BlockMap"):
        flash_attn_forward(q, k, v, block_map=bm, mask=np.ones((45, 61), bool), backend="numpy")
    with pytest.raises(ValueError, match="takes its mask and mask_mod from the BlockMap"):
        flash_attn_forward(q, k, v, block_map=bm, mask_mod="j <= i", backend="numpy")
    with pytest.raises(ValueError, match=r"mod_tensors\['doc'\] of the call is not the BlockMap's"):
        flash_attn_forward(q, k, v, block_map=bm, score_mod="score + doc[b, j]", mod_tensors=dict(doc=other),
                           backend="numpy")
    with pytest.raises(TypeError, match="block_map must be a pycudaflash.BlockMap"):
        flash_attn_forward(q, k, v, block_map=DOC, backend="numpy")
    # the BlockMap's own objects given again are the same call
    a = flash_attn_forward(q, k, v, block_map=bm, mask_mod=bm.mask_mod, mod_tensors=dict(doc=doc), backend="numpy")
    b = flash_attn_forward(q, k, v, block_map=bm, backend="numpy")
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("with_mask", [False, True])
def test_numpy_backend_with_a_block_map_is_the_call_without(with_mask: bool) -> None:
    """Mask, modifier and tensors come from the BlockMap, a score_mod and its own tensor from the
    call: the same results as the call that passes them all itself, forward and backward."""
    q, k, v, dout, doc = _problem()
    g = np.random.default_rng(1)
    mask = g.random((2, 1, 45, 61)) < 0.8 if with_mask else None
    bias = g.standard_normal(61).astype(np.float32)
    bm = BlockMap(mask=mask, mask_mod=DOC, mod_tensors=dict(doc=doc))
    own = dict(score_mod="score + bias[j] + doc[b, j]", mod_tensors=dict(bias=bias))
    full = dict(mask=mask, mask_mod=DOC, score_mod=own["score_mod"], mod_tensors=dict(bias=bias, doc=doc))
    got = flash_attn_forward(q, k, v, block_map=bm, causal=True, backend="numpy", **own)
    want = flash_attn_forward(q, k, v, causal=True, backend="numpy", **full)
    assert np.isfinite(want[0]).all() and np.abs(want[0]).max() > 0
    for x, y in zip(got, want):
        assert np.array_equal(x, y)
    g_got = flash_attn_backward(dout, q, k, v, *got, block_map=bm, causal=True, backend="numpy", **own)
    g_want = flash_attn_backward(dout, q, k, v, *want, causal=True, backend="numpy", **full)
    for x, y in zip(g_got, g_want):
        assert np.array_equal(x, y)


def test_torch_cpu_tensors_with_a_block_map() -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from pycudaflash.torch import flash_attention

    q, k, v, dout, doc = _problem()
    bm = BlockMap(mask_mod=DOC, mod_tensors=dict(doc=torch.from_numpy(doc)))
    grads = []
    for kw in (dict(block_map=bm), dict(mask_mod=DOC, mod_tensors=dict(doc=torch.from_numpy(doc)))):
        tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
        out = flash_attention(tq, tk, tv, **kw)
        out.backward(torch.from_numpy(dout))
        grads.append([out.detach(), tq.grad, tk.grad, tv.grad])
    for x, y in zip(*grads):
        assert torch.equal(x, y)


# ------------------------------------------------------------------ GPU


def _cuda_problem(torch, dtype):
    """Long enough that the documents leave whole tiles empty and full; off the tile grid."""
    B, H, Nq, Nk, D = 2, 4, 520, 390, 64
    g = np.random.default_rng(5)
    q, dout = (torch.from_numpy(g.standard_normal((B, H, Nq, D), np.float32)).to("cuda", dtype) for _ in range(2))
    k, v = (torch.from_numpy(g.standard_normal((B, H, Nk, D), np.float32)).to("cuda", dtype) for _ in range(2))
    doc = torch.from_numpy(np.sort(g.integers(0, 5, (B, Nq)), axis=1).astype(np.int32)).cuda()
    return q, k, v, dout, doc


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["mask_mod", "bool mask", "both"])
def test_block_map_is_built_once_and_matches_the_call_without(cuda: None, dtype: str, kind: str) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    q, k, v, dout, doc = _cuda_problem(torch, getattr(torch, dtype))
    mask = (doc[:, None, :, None] == doc[:, None, None, :390]) if kind != "mask_mod" else None
    mask_mod = DOC if kind != "bool mask" else None
    tensors = dict(doc=doc) if mask_mod else None
    if kind == "both":  # (the modifier then also hides the first key of every document pair's diagonal)
        mask_mod = "(doc[b, i] == doc[b, j]) & (i != j)"
    bm = BlockMap(mask=mask, mask_mod=mask_mod, mod_tensors=tensors)
    plain = dict(mask=mask, mask_mod=mask_mod, mod_tensors=tensors)
    want = flash_attn_forward(q, k, v, **plain)
    want_g = flash_attn_backward(dout, q, k, v, *want, deterministic=True, **plain)
    built = []
    for _ in range(2):
        got = flash_attn_forward(q, k, v, block_map=bm)
        built.append(len(bm._maps))
        got_g = flash_attn_backward(dout, q, k, v, *got, deterministic=True, block_map=bm)
        built.append(len(bm._maps))
        for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), got + got_g, want + want_g):
            assert torch.equal(x, y), f"{name} differs from the call that builds its own maps"
    # (the backward's tile shapes may be the forward's: then it builds no map of its own)
    assert built[0] == 1 and 1 <= built[1] <= 3 and built[2:] == built[1:2] * 2, built
    assert torch.isfinite(want[0]).all() and want[0].abs().max() > 0


@pytest.mark.gpu
def test_block_map_built_on_one_stream_serves_another(cuda: None) -> None:
    """The torch operator on a side stream builds the maps (and waits for them); calls on the
    default stream then read them; the gradients flow through the autograd function."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from pycudaflash.torch import flash_attention

    q, k, v, dout, doc = _cuda_problem(torch, torch.bfloat16)
    bm = BlockMap(mask_mod=DOC, mod_tensors=dict(doc=doc))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        first = flash_attention(q, k, v, block_map=bm)
    torch.cuda.current_stream().wait_stream(side)
    runs = []
    for kw in (dict(block_map=bm), dict(mask_mod=DOC, mod_tensors=dict(doc=doc))):
        tq, tk, tv = (x.clone().requires_grad_() for x in (q, k, v))
        out = flash_attention(tq, tk, tv, deterministic=True, **kw)
        out.backward(dout)
        runs.append((out.detach(), tq.grad, tk.grad, tv.grad))
    assert torch.equal(first, runs[1][0])
    for x, y in zip(*runs):
        assert torch.equal(x, y)


@pytest.mark.gpu
def test_block_map_cannot_be_built_during_capture(cuda: None) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    q, k, v, _, doc = _cuda_problem(torch, torch.bfloat16)
    bm = BlockMap(mask_mod=DOC, mod_tensors=dict(doc=doc))
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")
    flash_attn_forward(q, k, v, block_map=BlockMap(mask_mod=DOC, mod_tensors=dict(doc=doc)), out=out, lse=lse)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="cannot be built during graph capture"):
        with torch.cuda.graph(graph):
            flash_attn_forward(q, k, v, block_map=bm, out=out, lse=lse)
    assert len(bm._maps) == 0


@pytest.mark.gpu
def test_prepared_call_with_a_block_map_and_modifiers(cuda: None) -> None:
    """A prepared forward and backward read the BlockMap's maps and the modifiers' device tensors:
    the same results as the plain calls, and no map built after the first call."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from pycudaflash import prepare_backward, prepare_forward

    q, k, v, dout, doc = _cuda_problem(torch, torch.float16)
    slope = torch.linspace(0.5, 0.1, q.shape[1], device="cuda")
    bm = BlockMap(mask_mod=DOC, mod_tensors=dict(doc=doc))
    kw = dict(score_mod="score - slope[h] * abs(i - j)", mod_tensors=dict(slope=slope))
    plain = dict(mask_mod=DOC, score_mod=kw["score_mod"], mod_tensors=dict(slope=slope, doc=doc))
    want = flash_attn_forward(q, k, v, **plain)
    want_g = flash_attn_backward(dout, q, k, v, *want, deterministic=True, **plain)
    fwd = prepare_forward(q, k, v, block_map=bm, **kw)
    got = fwd()
    bwd = prepare_backward(dout, q, k, v, *got, deterministic=True, block_map=bm, **kw)
    bwd()
    built = len(bm._maps)
    for _ in range(2):
        got = fwd()
        got_g = bwd()
    assert len(bm._maps) == built
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), tuple(got) + tuple(got_g), want + want_g):
        assert torch.equal(x, y), name


def test_block_mask_summarises_the_block_map_on_the_host() -> None:
    """BlockMap.block_mask is build_block_mask of its mask and modifier: every tile's kind agrees
    with the elements it holds, and the sparsity is the fraction of empty tiles."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    _, _, _, _, doc = _problem(B=2, Nq=300, Nk=300)
    mask = np.random.default_rng(3).random((2, 1, 300, 300)) < 0.9
    bm = BlockMap(mask=torch.from_numpy(mask), mask_mod=DOC, mod_tensors=dict(doc=torch.from_numpy(doc)))
    s = bm.block_mask(2, 3, 300, 300, block_q=64, block_k=32, causal=True)
    i, j = np.arange(300)[:, None], np.arange(300)[None, :]
    want = (doc[:, None, :, None] == doc[:, None, None, :]) & mask & (j <= i)
    assert np.array_equal(s.allowed(), np.broadcast_to(want, (2, 3, 300, 300)))
    tiles = np.pad(want, ((0, 0), (0, 0), (0, 20), (0, 20)), constant_values=False)  # (to whole tiles)
    tiles = tiles.reshape(2, 1, 5, 64, 10, 32)
    # (a tile's padding holds no element: it is full where every element it holds is kept)
    valid = np.pad(np.ones((300, 300), bool), ((0, 20), (0, 20))).reshape(5, 64, 10, 32)
    anyt, allt = tiles.any(axis=(3, 5)), (tiles | ~valid).all(axis=(3, 5))
    kinds = np.where(~anyt, 0, np.where(allt, 2, 1))
    assert np.array_equal(s.kinds, np.broadcast_to(kinds, (2, 3, 5, 10)))
    assert s.sparsity == pytest.approx(float(np.mean(kinds == 0)))
    assert 0 < s.sparsity < 1
