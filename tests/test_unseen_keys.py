"""A key that no query may see is never read: NaN or Inf stored in it changes nothing (the
float64 reference, the NumPy backend, and on every backend and dtype for the keys outside the
band and the key lengths)."""

from __future__ import annotations

import numpy as np
import pytest

from pycudaflash import flash_attn_backward, flash_attn_forward
from pycudaflash.reference import reference_backward, reference_forward

B, H, NQ, NK, D = 2, 2, 37, 53, 16
RNG = np.random.default_rng(21)
Q, K, V, DOUT = (RNG.standard_normal((B, H, n, D)).astype(np.float32) for n in (NQ, NK, NK, NQ))
COLUMN_MASK = np.ones((B, 1, NQ, NK), bool)
COLUMN_MASK[:, :, :, 7] = False  # key 7: no query of any head may see it
COLUMN_MASK[1, :, :, 20:25] = False

# (options, the keys no query may see: bool (B, H or 1, NK))
CASES = {
    "key_lengths": (dict(key_lengths=np.array([30, 53])), np.arange(NK)[None, None, :] >= np.array([30, 53])[:, None, None]),
    "causal_top_left": (dict(causal=True), np.broadcast_to(np.arange(NK) >= NQ, (1, 1, NK))),
    "window": (dict(window=(3, 2)), np.broadcast_to(np.arange(NK) > NQ - 1 + 2, (1, 1, NK))),
    "bool_mask_column": (dict(mask=COLUMN_MASK), ~COLUMN_MASK.any(axis=2)),
}


def _poisoned(x: np.ndarray, unseen: np.ndarray, value: float) -> np.ndarray:
    y = x.copy()
    y[np.broadcast_to(unseen, x.shape[:3])] = value
    return y


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_unseen_keys_change_nothing(name: str, poison: float) -> None:
    opts, unseen = CASES[name]
    assert unseen.any(), "the case must have keys that no query sees"
    Kp, Vp = _poisoned(K, unseen, poison), _poisoned(V, unseen, poison)
    for fwd, bwd, kw in ((flash_attn_forward, flash_attn_backward, dict(backend="numpy")),
                         (reference_forward, reference_backward, {})):
        clean = fwd(Q, K, V, **opts, **kw)
        dirty = fwd(Q, Kp, Vp, **opts, **kw)
        for a, b in zip(clean, dirty):
            np.testing.assert_array_equal(a, b)
        if bwd is flash_attn_backward:
            g_clean = bwd(DOUT, Q, K, V, *clean, **opts, **kw)
            g_dirty = bwd(DOUT, Q, Kp, Vp, *dirty, **opts, **kw)
        else:
            g_clean, g_dirty = bwd(DOUT, Q, K, V, **opts), bwd(DOUT, Q, Kp, Vp, **opts)
        for a, b in zip(g_clean, g_dirty):
            np.testing.assert_array_equal(a, b)
        dk, dv = g_dirty[1], g_dirty[2]
        assert not np.broadcast_to(unseen[..., None], dk.shape)[dk != 0].any(), "an unseen key got a dk"
        assert not np.broadcast_to(unseen[..., None], dv.shape)[dv != 0].any(), "an unseen key got a dv"


def test_a_seen_key_still_carries_its_nan() -> None:
    """Only keys no query may see are left out: a NaN in a key some query sees reaches that query."""
    Vp = V.copy()
    Vp[0, 0, 3] = np.nan  # seen by every query without a mask
    out, _ = flash_attn_forward(Q, K, Vp, backend="numpy")
    assert np.isnan(out[0, 0]).all()
    ref, _ = reference_forward(Q, K, Vp)
    assert np.isnan(ref[0, 0]).all()


@pytest.mark.parametrize("causal, left, right", [("none", -1, -1), ("top_left", -1, -1), ("bottom_right", 5, -1),
                                                 ("none", 3, 2), ("top_left", 40, -1)])
def test_keys_seen_by_the_band_alone_match_the_tile_walk(causal: str, left: int, right: int) -> None:
    """The NumPy backend derives the seen keys of a band and key lengths directly; the walk over
    tile pairs (taken with a dense mask, here one that excludes nothing) must agree."""
    from pycudaflash import cpu
    from pycudaflash.semantics import band

    kl = np.array([30, 53])
    for nq, nk in ((NQ, NK), (NK, NQ)):
        bnd = band(nq, nk, causal, left, right)
        direct = cpu._keys_seen(B, H, nq, nk, bnd, kl, int(kl.min()), None, 16, 16)
        walked = cpu._keys_seen(B, H, nq, nk, bnd, kl, int(kl.min()), np.ones((B, H, nq, nk), bool), 16, 16)
        assert np.array_equal(direct, walked)
        assert not direct.all()


# On every backend and dtype: the band and the key lengths (the kernels zero-fill the keys and
# values past the keys some row of the problem may see when they load a tile).
_BAND_CASES = {
    "key_lengths": dict(key_lengths=np.array([130, 300])),
    "causal_top_left": dict(causal=True),
    "window": dict(window=(20, 7)),
    "window_and_key_lengths": dict(causal="bottom_right", window=(40, None), key_lengths=np.array([250, 161])),
}
_BQ, _BK = 97, 300  # (several key tiles, none full)


def _band_unseen(opts: dict, nq: int, nk: int) -> np.ndarray:
    """bool (B, 1, nk): the keys no row may see (from the float64 reference's own rule)."""
    from pycudaflash.semantics import band, normalize_causal, normalize_window

    lo, hi = band(nq, nk, normalize_causal(opts.get("causal", False)),
                  *normalize_window(opts.get("window"))).key_range(0, nq, nk)
    j = np.arange(nk)
    seen = (j >= lo) & (j < hi)
    kl = opts.get("key_lengths")
    lengths = np.full(B, nk) if kl is None else np.asarray(kl)
    return ~(seen[None, :] & (j[None, :] < lengths[:, None]))[:, None, :]


def _poisoned_runs(q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray, unseen: np.ndarray, backend: str,
                   deterministic: bool, opts: dict) -> list:
    """(out, lse, dq, dk, dv) of the forward and backward with k and v as given, then with NaN,
    then with Inf stored in the keys and values ``unseen`` marks."""
    results = []
    for poison in (None, np.nan, np.inf):
        kp, vp = (k, v) if poison is None else (_poisoned(k, unseen, poison), _poisoned(v, unseen, poison))
        out, lse = flash_attn_forward(q, kp, vp, backend=backend, **opts)
        grads = flash_attn_backward(do, q, kp, vp, out, lse, backend=backend, deterministic=deterministic, **opts)
        results.append((out, lse, *grads))
    return results


@pytest.mark.parametrize("name", sorted(_BAND_CASES))
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_unseen_keys_change_nothing_on_every_backend(backend: str, name: str, dtype: str) -> None:
    import ml_dtypes

    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    opts = _BAND_CASES[name]
    rng = np.random.default_rng(5)
    q, k, v, do = (rng.standard_normal((B, H, n, 64)).astype(np_dtype) for n in (_BQ, _BK, _BK, _BQ))
    unseen = _band_unseen(opts, _BQ, _BK)
    assert unseen.any() and not unseen.all(), "the case must have seen and unseen keys"
    results = _poisoned_runs(q, k, v, do, unseen, backend, True, opts)
    for dirty in results[1:]:
        for a, b, what in zip(results[0], dirty, ("out", "lse", "dq", "dk", "dv")):
            assert np.array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64), equal_nan=True), \
                f"{what} changed when the unseen keys hold NaN or Inf"
    dk, dv = results[1][3], results[1][4]
    mask = np.broadcast_to(unseen[..., None], dk.shape)
    assert not np.asarray(dk, np.float64)[mask].any() and not np.asarray(dv, np.float64)[mask].any(), \
        "an unseen key got a gradient"
    assert np.isfinite(np.asarray(results[0][0], np.float64)).all()


# On every backend and dtype: keys that a dense bool mask or a mask modifier hides from every row
# (the kernels read the seen-key bits that the block map's build writes beside the map).
_MQ, _MK = 97, 300
_MRNG = np.random.default_rng(11)


def _mask_cases() -> dict:
    cases = {}
    # A bool mask per batch element: random elsewhere, some columns hidden from every row.
    keep = _MRNG.random((B, 1, _MQ, _MK)) < 0.6
    keep[0, :, :, 40:50] = keep[1, :, :, 200:300] = False
    keep[:, :, :, 3] = False
    cases["bool_mask"] = dict(mask=keep)
    # Documents: no query belongs to document 3, which some keys hold (a padded cache).
    docq = np.sort(_MRNG.integers(0, 3, (B, _MQ)), axis=1).astype(np.int32)
    dock = np.sort(_MRNG.integers(0, 4, (B, _MK)), axis=1).astype(np.int32)
    dock[0, 130:150] = 3
    cases["mask_mod_documents"] = dict(mask_mod="docq[b, i] == dock[b, j]", mod_tensors=dict(docq=docq, dock=dock))
    # A mask that shows keys 10..59 only to the rows before them, under a causal band that shows
    # them only to the rows after them: neither hides them alone.
    lower = np.ones((_MQ, _MK), bool)
    lower[:, 10:60] = np.arange(_MQ)[:, None] < np.arange(10, 60)[None, :]
    cases["mask_and_band"] = dict(mask=lower, causal=True)
    # A mask modifier with key lengths: every seventh key hidden, and the padding.
    cases["mask_mod_and_key_lengths"] = dict(mask_mod="(j % 7) != 3", key_lengths=np.array([250, 161]))
    # One K/V head for two query heads, a mask per head: keys hidden from both heads, and keys
    # hidden from head 0 only (seen by head 1: they carry no poison).
    per_head = _MRNG.random((B, H, _MQ, _MK)) < 0.7
    per_head[:, :, :, 100:140] = False
    per_head[:, 0, :, 150:170] = False
    cases["grouped_heads"] = dict(mask=per_head, hkv=1)
    return cases


_MASK_CASES = _mask_cases()


def _mask_unseen(q: np.ndarray, k: np.ndarray, opts: dict, hkv: int) -> np.ndarray:
    """bool (B, Hkv, Nk): the keys that no row of any query head reading them may see (from the
    float64 reference's masked scores)."""
    from pycudaflash.reference import masked_scores

    kw = {n: opts.get(n) for n in ("causal", "window", "mask", "key_lengths", "mask_mod", "mod_tensors")}
    kw["causal"] = kw["causal"] or False
    S, _ = masked_scores(q, np.repeat(k, q.shape[1] // hkv, axis=1), scale=None, **kw)
    seen = np.isfinite(S).any(axis=2)  # (B, H, Nk)
    return ~seen.reshape(B, hkv, -1, seen.shape[-1]).any(axis=2)


def _atomic_dq_spread(q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray, opts: dict, hkv: int,
                      dq: np.ndarray) -> np.ndarray:
    """How far two atomic backwards' dq may lie apart on these inputs: their float32 atomics add
    the key tiles' shares scale * dSij Kj in any order, and two orders of k partial sums differ by
    at most 2 (k - 1) u sum_j |scale dS_ij K_j| (u = 2^-24, k key tiles of at least 32 keys);
    a 16-bit dq then rounds to the same or the adjacent value (one unit in its last place)."""
    import ml_dtypes

    from pycudaflash.reference import masked_scores, softmax_parts

    kw = {n: opts.get(n) for n in ("causal", "window", "mask", "key_lengths", "mask_mod", "mod_tensors")}
    kw["causal"] = kw["causal"] or False
    q64, do64 = (np.asarray(x, np.float64) for x in (q, do))
    k64, v64 = (np.repeat(np.asarray(x, np.float64), q.shape[1] // hkv, axis=1) for x in (k, v))
    S, scale = masked_scores(q64, k64, scale=None, **kw)
    P, _ = softmax_parts(S)
    O = P @ v64
    dS = P * (do64 @ np.swapaxes(v64, -1, -2) - (do64 * O).sum(-1, keepdims=True))
    k_tiles = -(-k.shape[2] // 32)
    spread = 2 * (k_tiles - 1) * 2.0 ** -24 * (np.abs(scale * dS) @ np.abs(k64))
    if dq.dtype != np.float32:
        mag = np.maximum(np.abs(np.asarray(dq, np.float64)), np.finfo(np.float32).tiny)
        spread += float(ml_dtypes.finfo(dq.dtype).eps) * 2.0 ** np.floor(np.log2(mag))
    return spread


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("name", sorted(_MASK_CASES))
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_keys_a_mask_hides_from_every_row_change_nothing_on_every_backend(backend: str, name: str, dtype: str,
                                                                          deterministic: bool) -> None:
    import ml_dtypes

    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    opts = dict(_MASK_CASES[name])
    hkv = opts.pop("hkv", H)
    rng = np.random.default_rng(6)
    q, do = (rng.standard_normal((B, H, _MQ, 64)).astype(np_dtype) for _ in range(2))
    k, v = (rng.standard_normal((B, hkv, _MK, 64)).astype(np_dtype) for _ in range(2))
    unseen = _mask_unseen(q, k, opts, hkv)
    assert unseen.any() and not unseen.all(), "the case must have seen and unseen keys"
    if name == "mask_and_band":  # (neither the mask alone nor the band alone hides keys 10..59)
        assert unseen[:, :, 10:60].all() and opts["mask"][:, 10:60].any(axis=0).all()
    results = _poisoned_runs(q, k, v, do, unseen, backend, deterministic, opts)
    # Bit for bit, but the atomic backward's dq, whose float32 atomics add in any order: within
    # that order's spread, and finite.
    spread = None if deterministic else _atomic_dq_spread(q, k, v, do, opts, hkv, results[0][2])
    for dirty in results[1:]:
        for a, b, what in zip(results[0], dirty, ("out", "lse", "dq", "dk", "dv")):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            if what == "dq" and spread is not None:
                assert np.isfinite(b).all() and (np.abs(a - b) <= spread).all(), \
                    f"dq changed beyond the atomics' spread when the unseen keys hold NaN or Inf: " \
                    f"{np.abs(a - b).max():.3g} (allowed {spread.ravel()[np.argmax(np.abs(a - b))]:.3g})"
            else:
                assert np.array_equal(a, b, equal_nan=True), f"{what} changed when the unseen keys hold NaN or Inf"
    dk, dv = results[1][3], results[1][4]
    hidden = np.broadcast_to(unseen[..., None], dk.shape)
    assert not np.asarray(dk, np.float64)[hidden].any() and not np.asarray(dv, np.float64)[hidden].any(), \
        "an unseen key got a gradient"
    for x in results[0][:1] + results[0][2:]:
        assert np.isfinite(np.asarray(x, np.float64)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_block_map_hides_its_unseen_keys_under_each_band(cuda: None, dtype: str) -> None:
    """A BlockMap's maps, built once per band into the BlockMap's memory: keys that no row may
    see under the mask modifier and that call's band hold NaN, and every call gives what the same
    call with finite keys gives (the maps of one band are not those of another)."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from pycudaflash import BlockMap

    g = np.random.default_rng(8)
    Nq, Nk = 300, 333
    tq, tdo = (torch.from_numpy(g.standard_normal((B, H, Nq, 64), np.float32)).to("cuda", getattr(torch, dtype))
               for _ in range(2))
    tk, tv = (torch.from_numpy(g.standard_normal((B, H, Nk, 64), np.float32)).to("cuda", getattr(torch, dtype))
              for _ in range(2))
    # Keys 200..259 are seen only by the rows before 200 (hidden under a causal band).
    bm = BlockMap(mask_mod="(j < 200) | (j >= 260) | (i < 200 - 100)")
    for causal in (False, True, False):
        opts = dict(mask_mod=bm.mask_mod, causal=causal)
        host = [x.float().cpu().numpy() for x in (tq, tk)]
        unseen = _mask_unseen(host[0], host[1], opts, H)
        assert unseen[:, :, 200:260].all() == causal and unseen.any()
        kp, vp = tk.clone(), tv.clone()
        hidden = torch.from_numpy(np.ascontiguousarray(unseen)).cuda()
        kp[hidden], vp[hidden] = float("nan"), float("nan")
        want = flash_attn_forward(tq, tk, tv, causal=causal, block_map=bm)
        got = flash_attn_forward(tq, kp, vp, causal=causal, block_map=bm)
        # (bit for bit: the deterministic backward; the atomic one's dq adds in any order)
        want_g = flash_attn_backward(tdo, tq, tk, tv, *want, causal=causal, block_map=bm, deterministic=True)
        got_g = flash_attn_backward(tdo, tq, kp, vp, *got, causal=causal, block_map=bm, deterministic=True)
        for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), want + want_g, got + got_g):
            assert torch.equal(a, b), f"{what} changed when the unseen keys hold NaN (causal={causal})"
        assert torch.isfinite(got[0]).all() and not got_g[1][hidden].any()
