"""The comparison helper must catch every kind of planted error."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pycudaflash.testing import CheckResult, check, relative_error

RTOL = 2e-6


def _ref(shape=(2, 3, 17, 8), seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def test_exact_copy_passes() -> None:
    ref = _ref()
    res = check("out", ref.copy(), ref, rtol_norm=RTOL)
    assert isinstance(res, CheckResult)
    assert res.ok and bool(res)
    assert res.max_abs == 0.0 and res.rel_norm == 0.0
    assert res.first_bad is None and res.n_nonfinite == 0 and res.n_bad == 0
    assert res.raise_if_failed() is res
    res.assert_ok()
    assert "out: ok" in str(res)


def test_float32_rounding_passes() -> None:
    ref = _ref()
    assert check("out", ref.astype(np.float32), ref, rtol_norm=RTOL).ok


def test_planted_error_just_beyond_bound() -> None:
    ref = _ref()
    bound = check("out", ref, ref, rtol_norm=RTOL).elem_bound
    assert bound == pytest.approx(4.0 * RTOL * np.abs(ref).max())
    idx = (1, 2, 5, 3)
    out = ref.copy()
    out[idx] += 1.01 * bound
    res = check("out", out, ref, rtol_norm=RTOL)
    assert not res.ok
    assert res.first_bad == idx
    assert res.n_bad == 1
    # The norm alone would not have seen it.
    assert res.rel_norm < RTOL
    with pytest.raises(AssertionError, match=r"out: FAIL .*first_bad=\(1, 2, 5, 3\)"):
        res.raise_if_failed()

    # The same perturbation just inside the bound passes.
    out2 = ref.copy()
    out2[idx] += 0.99 * bound
    assert check("out", out2, ref, rtol_norm=RTOL).ok
    # A tighter element bound catches it.
    res = check("out", out2, ref, rtol_norm=RTOL, elem_factor=1.0)
    assert not res.ok and res.first_bad == idx


def test_first_bad_is_first_in_c_order() -> None:
    ref = _ref()
    out = ref.copy()
    out[1, 0, 0, 0] += 1.0
    out[0, 2, 16, 7] += 1.0
    assert check("x", out, ref, rtol_norm=RTOL).first_bad == (0, 2, 16, 7)


def test_first_bad_on_strided_views() -> None:
    ref = _ref((2, 17, 3, 8)).transpose(0, 2, 1, 3)  # (B, H, N, D) view of (B, N, H, D)
    out = ref.transpose(0, 2, 1, 3).copy().transpose(0, 2, 1, 3)
    assert not out.flags.c_contiguous
    out[0, 1, 4, 2] = np.nan
    out[1, 0, 3, 2] = np.nan
    res = check("q", out, ref, rtol_norm=RTOL)
    assert res.first_bad == (0, 1, 4, 2)
    assert res.n_nonfinite == 2


def test_planted_nan_fails() -> None:
    ref = _ref()
    out = ref.copy()
    out[0, 1, 2, 3] = np.nan
    res = check("out", out, ref, rtol_norm=1.0, atol=1e9)  # no tolerance excuses a NaN
    assert not res.ok
    assert res.n_nonfinite == 1
    assert res.first_bad == (0, 1, 2, 3)
    assert math.isinf(res.rel_norm)
    assert relative_error(out, ref) == math.inf


def test_infinite_value_fails() -> None:
    ref = _ref()
    out = ref.copy()
    out[1, 1, 1, 1] = -np.inf
    res = check("out", out, ref, rtol_norm=RTOL)
    assert not res.ok and res.n_nonfinite == 1 and res.first_bad == (1, 1, 1, 1)


def test_unwritten_poisoned_element_fails() -> None:
    """An output buffer poisoned with NaN where one element was never written."""
    ref = _ref()
    buf = np.full(ref.shape, np.nan, dtype=np.float32)
    buf[...] = ref
    buf[1, 2, 16, 7] = np.nan  # the last element: nothing wrote it
    res = check("dq", buf, ref, rtol_norm=RTOL)
    assert not res.ok
    assert res.first_bad == (1, 2, 16, 7)
    assert res.n_nonfinite == 1


def test_minus_inf_pattern_must_match() -> None:
    lse_ref = _ref((2, 3, 17))
    lse_ref[0, 1, 4] = -np.inf
    lse_ref[1, 2, :] = -np.inf

    good = lse_ref.astype(np.float32)
    assert check("lse", good, lse_ref, rtol_norm=RTOL).ok

    # A finite value where the reference row sees no key.
    bad = good.copy()
    bad[0, 1, 4] = -1e30
    res = check("lse", bad, lse_ref, rtol_norm=RTOL)
    assert not res.ok and res.first_bad == (0, 1, 4)
    assert res.n_nonfinite == 0

    # NaN instead of -inf.
    bad = good.copy()
    bad[1, 2, 3] = np.nan
    res = check("lse", bad, lse_ref, rtol_norm=RTOL)
    assert not res.ok and res.first_bad == (1, 2, 3)

    # +inf instead of -inf.
    bad = good.copy()
    bad[1, 2, 0] = np.inf
    assert check("lse", bad, lse_ref, rtol_norm=RTOL).first_bad == (1, 2, 0)

    # -inf where the reference is finite.
    bad = good.copy()
    bad[0, 0, 0] = -np.inf
    res = check("lse", bad, lse_ref, rtol_norm=RTOL)
    assert not res.ok and res.n_nonfinite == 1 and res.first_bad == (0, 0, 0)


def test_relative_norm_bound() -> None:
    ref = _ref()
    noisy = ref * (1.0 + 1e-3 * np.random.default_rng(1).standard_normal(ref.shape))
    res = check("out", noisy, ref, rtol_norm=RTOL)
    assert not res.ok
    assert res.rel_norm == pytest.approx(relative_error(noisy, ref))
    assert 1e-4 < res.rel_norm < 1e-2
    assert check("out", noisy, ref, rtol_norm=1e-2).ok


def test_exact_positions() -> None:
    ref = _ref()
    ref[0, 0, 3, :] = 0.0
    out = ref.copy()
    out[0, 0, 3, 5] = 1e-30  # far below any tolerance, yet the row must be exactly 0
    rows = np.zeros(ref.shape[:-1] + (1,), dtype=bool)
    rows[0, 0, 3] = True
    assert check("out", out, ref, rtol_norm=RTOL).ok
    res = check("out", out, ref, rtol_norm=RTOL, exact=rows)
    assert not res.ok and res.first_bad == (0, 0, 3, 5)


def test_atol_floor() -> None:
    ref = np.zeros((4, 5))
    out = np.full((4, 5), 1e-9)
    assert not check("dq", out, ref, rtol_norm=RTOL).ok
    assert check("dq", out, ref, rtol_norm=RTOL, atol=1e-9).ok
    assert not check("dq", out, ref, rtol_norm=RTOL, atol=0.9e-9).ok  # norm criterion
    # One element far off: the element bound is elem_factor * atol.
    out[3, 4] = 4.1e-9
    res = check("dq", out, ref, rtol_norm=RTOL, atol=2e-9, elem_factor=2.0)
    assert not res.ok and res.first_bad == (3, 4)
    assert check("dq", out, ref, rtol_norm=RTOL, atol=2e-9, elem_factor=4.0).ok
    out[3, 4] = 1e-9
    floor = np.full((4, 1), 2e-9)
    floor[2] = 0.0
    res = check("dq", out, ref, rtol_norm=RTOL, atol=floor)
    assert not res.ok and res.first_bad == (2, 0)


def test_zero_reference() -> None:
    ref = np.zeros((3, 4))
    assert check("dv", np.zeros((3, 4), np.float32), ref, rtol_norm=RTOL).ok
    assert relative_error(np.zeros((3, 4)), ref) == 0.0
    out = np.zeros((3, 4))
    out[1, 2] = 0.5
    res = check("dv", out, ref, rtol_norm=RTOL)
    assert not res.ok and res.first_bad == (1, 2)
    assert res.rel_norm == pytest.approx(0.5)


def test_shape_mismatch_fails() -> None:
    res = check("out", np.zeros((2, 3)), np.zeros((3, 2)), rtol_norm=RTOL)
    assert not res.ok and "shape" in str(res)
    with pytest.raises(ValueError):
        relative_error(np.zeros((2, 3)), np.zeros((3, 2)))


def test_relative_error_values() -> None:
    ref = np.array([3.0, 4.0, -np.inf])
    out = np.array([3.0, 4.5, -np.inf])
    assert relative_error(out, ref) == pytest.approx(0.1)
    assert relative_error(np.array([3.0, 4.0, 0.0]), ref) == math.inf


def test_noise_floors_follow_each_key_and_query_entry() -> None:
    """A row that sees one key has dS = 0 exactly: dq_i is the rounding error
    of dS_ij times k_j, so its floor must scale with each entry of k_j (and
    dk_j's with each entry of q_i), not with a typical entry.  The numpy
    backend's float32 result then passes, even where |k_jd| is 3.4 rms."""
    from pycudaflash import flash_attn_backward, flash_attn_forward
    from pycudaflash.reference import reference_backward
    from pycudaflash.testing import AttentionProblem, attention_kwargs, make_inputs, noise_floors

    p = AttentionProblem(B=1, H=3, Nq=257, Nk=257, D=199, dtype="float32", window=(0, 0), seed=126984627)
    x = make_inputs(p)
    kw = attention_kwargs(p, x)
    floors = noise_floors(x["q"], x["k"], x["v"], x["dout"], **kw)
    k, q = x["k"].astype(np.float64), x["q"].astype(np.float64)
    for name, other in (("dq", k), ("dk", q)):
        ratio = floors[name] / np.abs(other)  # the same within each row
        spread = ratio.max(axis=-1) / ratio.min(axis=-1)
        assert np.allclose(spread, 1.0, rtol=1e-9), f"{name} floor is not proportional to the row's entries"
    out, lse = flash_attn_forward(x["q"], x["k"], x["v"], **kw, backend="numpy")
    dq, dk, _ = flash_attn_backward(x["dout"], x["q"], x["k"], x["v"], out, lse, **kw, backend="numpy")
    ref_dq, ref_dk, _ = reference_backward(x["dout"], x["q"], x["k"], x["v"], **kw)
    rtol = 1.1e-6  # the float32 numpy bound of the property suite
    check("dq", dq, ref_dq, rtol_norm=rtol, atol=rtol * floors["dq"]).raise_if_failed()
    check("dk", dk, ref_dk, rtol_norm=rtol, atol=rtol * floors["dk"]).raise_if_failed()


def test_block_masks_are_rectangles_and_unknown_patterns_are_refused() -> None:
    """A 'blocks' bool mask cuts each (Nq, Nk) plane at no more than 4 rows and 4 keys: at most 5
    distinct rows and 5 distinct columns a plane; a pattern outside MASK_PATTERNS raises."""
    from pycudaflash.testing import AttentionProblem, make_inputs

    for seed in range(20):
        p = AttentionProblem(B=2, H=3, Nq=97, Nk=113, D=8, mask_kind="bool", mask_shape="BHNqNk",
                             mask_pattern="blocks", seed=seed)
        m = np.asarray(make_inputs(p)["mask"]).reshape(-1, 97, 113)
        for plane in m:
            assert np.unique(plane, axis=0).shape[0] <= 5 and np.unique(plane, axis=1).shape[1] <= 5
    bad = AttentionProblem(B=1, H=1, Nq=5, Nk=5, D=8, mask_kind="bool", mask_shape="NqNk", mask_pattern="block")
    with pytest.raises(ValueError, match="mask_pattern"):
        make_inputs(bad)


def test_the_two_rounding_orders_of_the_lowp_baseline() -> None:
    """order='blockwise' rounds exp(s - rowmax), sums, and divides by the row sum at the end;
    torch's order rounds the normalized softmax.  On one output element of two opposite-signed terms
    the two orders land on different bfloat16 numbers, each as the rounding order says."""
    import ml_dtypes

    from pycudaflash.testing import lowp_reference_backward, lowp_reference_forward

    bf16 = ml_dtypes.bfloat16
    q = np.array([1.1171875], dtype=bf16).reshape(1, 1, 1, 1)
    k = np.array([-1.390625, -0.42578125], dtype=bf16).reshape(1, 1, 2, 1)
    v = np.array([-0.8046875, 0.6015625], dtype=bf16).reshape(1, 1, 2, 1)

    def rnd(x: np.ndarray) -> np.ndarray:
        return np.asarray(x, np.float32).astype(bf16).astype(np.float32)

    s = q.astype(np.float32)[0, 0, 0, 0] * k.astype(np.float32).ravel() * np.float32(0.5)
    e = np.exp(rnd(s) - rnd(s).max())  # torch: scores rounded to the dtype
    normalized = rnd(np.dot(rnd(e / e.sum(dtype=np.float32)), v.astype(np.float32).ravel()))
    e = np.exp(s - s.max())  # blockwise: scores in float32
    blockwise = rnd(np.dot(rnd(e), v.astype(np.float32).ravel()) / e.sum(dtype=np.float32))
    assert normalized != blockwise
    got_n, _ = lowp_reference_forward(q, k, v, scale=0.5)
    got_b, _ = lowp_reference_forward(q, k, v, scale=0.5, order="blockwise")
    assert float(got_n.ravel()[0]) == float(normalized)
    assert float(got_b.ravel()[0]) == float(blockwise)
    with pytest.raises(ValueError, match="order"):
        lowp_reference_forward(q, k, v, scale=0.5, order="both")
    with pytest.raises(ValueError, match="order"):
        lowp_reference_backward(q, q, k, v, scale=0.5, order="kernel")
