"""Block masks (pycudaflash.blockmask): the summary per tile pair and the packed bits, against
the element mask of the float64 reference's rules."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pycudaflash.blockmask import EMPTY, FULL, PARTIAL, build_block_mask
from pycudaflash.reference import masked_scores


def _allowed(B, H, Nq, Nk, **kw) -> np.ndarray:
    """The reference's element mask: the finite entries of its masked scores."""
    q, k = np.ones((B, H, Nq, 1)), np.ones((B, H, Nk, 1))
    S, _ = masked_scores(q, k, scale=1.0, causal=kw.get("causal", False), window=kw.get("window"),
                         mask=kw.get("mask"), key_lengths=kw.get("key_lengths"), mask_mod=kw.get("mask_mod"),
                         mod_tensors=kw.get("mod_tensors"))
    return np.isfinite(S)


def _draw_rules(data, B: int, Nq: int, Nk: int) -> dict:
    """Masking rules drawn for a (B, ., Nq, Nk) problem: causal, window, key lengths, a bool mask."""
    kw = {}
    if data.draw(st.booleans()):
        kw["causal"] = data.draw(st.sampled_from([True, "bottom_right"]))
    if data.draw(st.booleans()):
        kw["window"] = (data.draw(st.integers(-1, 40)), data.draw(st.integers(-1, 40)))
    if data.draw(st.booleans()):
        kw["key_lengths"] = np.array([data.draw(st.integers(0, Nk)) for _ in range(B)])
    if data.draw(st.booleans()):
        seed = data.draw(st.integers(0, 2**16))
        kw["mask"] = np.random.default_rng(seed).random((B, 1, Nq, Nk)) < data.draw(st.sampled_from([0.02, 0.5, 1.0]))
    return kw


@given(data=st.data())
def test_summary_and_bits_agree_with_the_element_mask(data) -> None:
    B, H = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
    Nq, Nk = data.draw(st.integers(1, 150)), data.draw(st.integers(1, 150))
    bq, bk = data.draw(st.sampled_from([16, 32, 64])), data.draw(st.sampled_from([16, 32, 64]))
    kw = _draw_rules(data, B, Nq, Nk)
    if data.draw(st.booleans()):
        seed = data.draw(st.integers(0, 2**16))
        doc = np.sort(np.random.default_rng(seed).integers(0, 4, (B, max(Nq, Nk))), axis=1)
        kw.update(mask_mod="doc[b, i] == doc[b, j]", mod_tensors={"doc": doc})
    want = _allowed(B, H, Nq, Nk, **kw)
    bm = build_block_mask(B, H, Nq, Nk, block_q=bq, block_k=bk, **kw)
    assert np.array_equal(bm.allowed(), want)
    for r in range(bm.kinds.shape[2]):
        for c in range(bm.kinds.shape[3]):
            tile = want[:, :, r * bq:(r + 1) * bq, c * bk:(c + 1) * bk]
            expect = np.where(~tile.any(axis=(2, 3)), EMPTY, np.where(tile.all(axis=(2, 3)), FULL, PARTIAL))
            assert np.array_equal(bm.kinds[:, :, r, c], expect), (r, c)


@given(data=st.data())
def test_retiling_equals_summarising_with_the_larger_tiles(data) -> None:
    B, H = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    Nq, Nk = data.draw(st.integers(1, 200)), data.draw(st.integers(1, 200))
    bq, bk = data.draw(st.sampled_from([8, 16, 32])), data.draw(st.sampled_from([8, 16, 32]))
    fq, fk = data.draw(st.sampled_from([1, 2, 4, 8])), data.draw(st.sampled_from([1, 2, 3, 4]))
    kw = _draw_rules(data, B, Nq, Nk)
    fine = build_block_mask(B, H, Nq, Nk, block_q=bq, block_k=bk, **kw)
    coarse = fine.retile(bq * fq, bk * fk)
    want = build_block_mask(B, H, Nq, Nk, block_q=bq * fq, block_k=bk * fk, **kw)
    assert np.array_equal(coarse.kinds, want.kinds)
    assert (coarse.block_q, coarse.block_k, coarse.nq, coarse.nk) == (bq * fq, bk * fk, Nq, Nk)
    assert np.array_equal(coarse.allowed(), want.allowed())


@given(data=st.data())
def test_tile_lists_hold_each_tile_of_its_kind_once_in_order(data) -> None:
    B, H = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    Nq, Nk = data.draw(st.integers(1, 150)), data.draw(st.integers(1, 150))
    bm = build_block_mask(B, H, Nq, Nk, block_q=16, block_k=32, **_draw_rules(data, B, Nq, Nk))
    for lists, kinds in ((bm.key_lists(), bm.kinds), (bm.query_lists(), np.swapaxes(bm.kinds, 2, 3))):
        for kind, count, idx in ((PARTIAL, lists.partial_count, lists.partial), (FULL, lists.full_count, lists.full)):
            assert idx.shape == kinds.shape and idx.dtype == np.int32 and count.dtype == np.int32
            for b, h, t in np.ndindex(*kinds.shape[:3]):
                want = np.flatnonzero(kinds[b, h, t] == kind)
                n = count[b, h, t]
                assert n == len(want)
                assert np.array_equal(idx[b, h, t, :n], want)  # (increasing: flatnonzero's order)
                assert (idx[b, h, t, n:] == -1).all()


def test_retile_refuses_sizes_that_are_not_multiples() -> None:
    bm = build_block_mask(1, 1, 40, 40, block_q=16, block_k=16)
    for bq, bk in ((24, 16), (16, 8), (0, 16), (16.0, 16)):
        with pytest.raises(ValueError, match="must be a multiple of 16"):
            bm.retile(bq, bk)


def test_causal_blocks_of_a_long_sequence() -> None:
    bm = build_block_mask(1, 1, 256, 256, block_q=64, block_k=64, causal=True)
    assert bm.kinds[0, 0].tolist() == [[1, 0, 0, 0], [2, 1, 0, 0], [2, 2, 1, 0], [2, 2, 2, 1]]
    assert bm.sparsity == 6 / 16


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="Nq must be a positive int"):
        build_block_mask(1, 1, 0, 4)
    with pytest.raises(TypeError, match="summarises a bool mask"):
        build_block_mask(1, 1, 4, 4, mask=np.zeros((4, 4), np.float32))
