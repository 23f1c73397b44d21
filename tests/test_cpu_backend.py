"""The NumPy tiled backend against the float64 reference, and the reference itself.

Errors are relative Frobenius norms ``||x - ref|| / ||ref||``.  The bounds
are a small multiple of the errors measured for these exact problems (fixed
seeds), so they catch any change that loses float32 accuracy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np
import pytest

import ml_dtypes

from pycudaflash import cpu, flash_attn_backward, flash_attn_forward
from pycudaflash._problem import Operand, Problem
from pycudaflash.reference import reference_backward, reference_forward
from pycudaflash.semantics import band, normalize_causal, normalize_scale, normalize_window

# Bounds for float32 arithmetic: about 2x the largest error measured over
# CASES with seeds 0-5 (out 2.9e-7, lse 1.2e-7, dq 4.9e-7, dk 4.8e-7,
# dv 3.5e-7), for scores of unit size (default scale).
TOL_OUT = 6e-7
TOL_LSE = 2.5e-7
TOL_DQ = 1e-6
TOL_DK = 1e-6
TOL_DV = 7e-7

# Float16 storage: errors are dominated by rounding the results (and the saved
# ``out`` feeding ``Di``) to float16; measured out 2.1e-4, lse 4.7e-8,
# dq 3.3e-4, dk 3.2e-4, dv 2.1e-4.
TOL_F16_OUT = 4.5e-4
TOL_F16_GRAD = 6.5e-4

# bfloat16 storage: three mantissa bits fewer than float16, so the rounding
# errors are 8x larger; measured over these cases with seeds 0-5: out 1.7e-3,
# lse 4.1e-8, dq 2.7e-3, dk 2.7e-3, dv 1.7e-3.
TOL_BF16_OUT = 8 * TOL_F16_OUT
TOL_BF16_GRAD = 8 * TOL_F16_GRAD


@dataclass(frozen=True)
class Case:
    """One attention problem: shapes and mask options."""

    name: str
    B: int
    H: int
    Nq: int
    Nk: int
    D: int
    causal: Any = False
    window: Optional[Tuple[Optional[int], Optional[int]]] = None
    mask: str = "none"  # 'none' | 'bool' | 'float' | 'float_rows' | 'bool_rows'
    key_lengths: Optional[Tuple[int, ...]] = None
    scale: Optional[float] = None
    blocks: Tuple[int, int] = (64, 64)
    strided: bool = False
    # Errors grow with the size of the scores; cases with larger scores
    # multiply the bounds by this factor.
    tol_factor: float = 1.0


CASES = [
    Case("tiny_1x1", 1, 1, 1, 1, 1),
    Case("plain_17_d3", 2, 2, 17, 17, 3),
    Case("plain_97x113_d64", 1, 2, 97, 113, 64),
    # scale 0.3 with D = 130: scores about 4x larger than with the default scale
    # (measured out 6.9e-7, lse 1.1e-7, dq 9.7e-7, dk 9.9e-7, dv 7.4e-7).
    Case("plain_113x97_d130", 2, 1, 113, 97, 130, scale=0.3, tol_factor=2.5),
    Case("causal_tl_97x113", 1, 2, 97, 113, 64, causal=True),
    Case("causal_tl_113x97", 1, 2, 113, 97, 64, causal="top_left"),
    Case("causal_br_97x113", 1, 2, 97, 113, 64, causal="bottom_right"),
    Case("causal_br_113x97", 2, 1, 113, 97, 130, causal="bottom_right"),
    Case("causal_br_1x113", 1, 2, 1, 113, 64, causal="bottom_right"),
    Case("causal_tl_17x1", 1, 2, 17, 1, 3, causal=True),
    Case("window_16_8", 1, 2, 130, 97, 64, window=(16, 8)),
    Case("window_narrow_br", 1, 2, 97, 113, 64, causal="bottom_right", window=(1, 0)),
    Case("window_left_open", 1, 2, 113, 113, 64, window=(-1, 5)),
    Case("window_right_open", 1, 2, 113, 97, 64, window=(3, None)),
    Case("window_causal_br", 2, 1, 97, 200, 64, causal="bottom_right", window=(20, None)),
    Case("window_far_br", 1, 1, 113, 17, 64, causal="bottom_right", window=(4, 2)),
    Case("key_lengths", 3, 2, 97, 113, 64, key_lengths=(0, 50, 113)),
    Case("key_lengths_causal", 2, 2, 113, 97, 3, causal=True, key_lengths=(1, 64)),
    Case("bool_mask", 2, 2, 97, 113, 64, mask="bool"),
    Case("bool_mask_rows", 2, 2, 113, 97, 64, mask="bool_rows"),
    Case("float_mask", 2, 2, 97, 113, 64, mask="float"),
    Case("float_mask_rows", 2, 2, 113, 97, 130, mask="float_rows"),
    Case(
        "everything", 2, 2, 97, 200, 64, causal="bottom_right", window=(40, 3),
        mask="float_rows", key_lengths=(150, 200),
    ),
    Case("blocks_16x32", 2, 2, 97, 113, 64, causal=True, window=(30, None),
         blocks=(16, 32)),
    Case("blocks_128x16", 1, 2, 113, 97, 64, causal="bottom_right", mask="bool",
         key_lengths=(90,), blocks=(128, 16)),
    Case("strided", 2, 3, 97, 113, 64, causal=True, strided=True),
    Case("long_causal", 1, 2, 300, 300, 64, causal=True),
]


def _make_mask(case: Case, rng: np.random.Generator) -> Optional[np.ndarray]:
    """The dense mask of a case, in a broadcastable (not full) shape."""
    B, H, Nq, Nk = case.B, case.H, case.Nq, case.Nk
    if case.mask == "none":
        return None
    if case.mask == "bool":
        return rng.random((B, 1, Nq, Nk)) < 0.6
    if case.mask == "bool_rows":
        m = rng.random((1, H, Nq, Nk)) < 0.3
        m[:, :, ::7, :] = False  # every 7th row sees nothing
        return m
    if case.mask == "float":
        m = rng.standard_normal((Nq, Nk)).astype(np.float32)
        m[rng.random((Nq, Nk)) < 0.3] = -np.inf
        return m
    if case.mask == "float_rows":
        m = 2.0 * rng.standard_normal((B, 1, Nq, Nk)).astype(np.float32)
        m[rng.random((B, 1, Nq, Nk)) < 0.5] = -np.inf
        m[:, :, 3::11, :] = -np.inf  # every 11th row from 3 sees nothing
        return m
    raise ValueError(case.mask)


def _make_inputs(case: Case, seed: int = 0) -> dict:
    """Random float32 inputs of a case."""
    rng = np.random.default_rng(seed)
    B, H, Nq, Nk, D = case.B, case.H, case.Nq, case.Nk, case.D

    def arr(n: int) -> np.ndarray:
        if case.strided:
            # (B, N, H, D) storage viewed as (B, H, N, D).
            return rng.standard_normal((B, n, H, D)).astype(np.float32).transpose(0, 2, 1, 3)
        return rng.standard_normal((B, H, n, D)).astype(np.float32)

    q, k, v, do = arr(Nq), arr(Nk), arr(Nk), arr(Nq)
    kl = None if case.key_lengths is None else np.array(case.key_lengths, dtype=np.int32)
    return dict(q=q, k=k, v=v, dout=do, mask=_make_mask(case, rng), key_lengths=kl)


def _run_cpu(case: Case, inp: dict, dtype: Any = np.float32) -> dict:
    """Forward and backward through the tiled backend in storage dtype ``dtype``."""
    q, k, v, do = (inp[n].astype(dtype) for n in ("q", "k", "v", "dout"))
    B, H, Nq, D = q.shape
    mode = normalize_causal(case.causal)
    left, right = normalize_window(case.window)
    scale = normalize_scale(case.scale, D)
    mask = inp["mask"]
    if mask is not None:
        mask = np.broadcast_to(mask, (B, H, Nq, k.shape[2]))
    opts = dict(
        scale=scale, causal=mode, window_left=left, window_right=right,
        mask=mask, key_lengths=inp["key_lengths"],
        block_q=case.blocks[0], block_k=case.blocks[1],
    )
    out = np.full(q.shape, np.nan, dtype=dtype)
    lse = np.full((B, H, Nq), np.nan, dtype=np.float32)
    dq = np.full(q.shape, np.nan, dtype=dtype)
    dk = np.full(k.shape, np.nan, dtype=dtype)
    dv = np.full(v.shape, np.nan, dtype=dtype)
    with np.errstate(divide="raise", invalid="raise", over="raise"):
        cpu.forward(q, k, v, out=out, lse=lse, **opts)
        cpu.backward(do, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **opts)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


def _run_ref(case: Case, inp: dict, dtype: Any = np.float32) -> dict:
    """Forward and backward through the float64 reference."""
    q, k, v, do = (inp[n].astype(dtype) for n in ("q", "k", "v", "dout"))
    opts = dict(
        scale=case.scale, causal=case.causal, window=case.window,
        mask=inp["mask"], key_lengths=inp["key_lengths"],
    )
    with np.errstate(divide="raise", invalid="raise", over="raise"):
        out, lse = reference_forward(q, k, v, **opts)
        dq, dk, dv = reference_backward(do, q, k, v, **opts)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


def _rel(x: np.ndarray, ref: np.ndarray) -> float:
    """Relative Frobenius error; finite entries of ``lse`` only, 0 when both vanish."""
    x = np.asarray(x, dtype=np.float64)
    keep = np.isfinite(ref)
    num = np.linalg.norm(x[keep] - ref[keep])
    den = np.linalg.norm(ref[keep])
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return float(num / den)


def _errors(got: dict, ref: dict) -> dict:
    return {name: _rel(got[name], ref[name]) for name in ("out", "lse", "dq", "dk", "dv")}


def _check_empty_rows(got: dict, ref: dict) -> None:
    """Rows that see no key: exact zeros and -inf; no NaN anywhere."""
    for name, x in got.items():
        assert not np.isnan(x).any(), f"NaN in {name}"
    empty = np.isneginf(ref["lse"])
    assert np.array_equal(np.isneginf(got["lse"]), empty)
    assert np.all(got["out"][empty] == 0)
    assert np.all(got["dq"][empty] == 0)
    # Keys that no row sees (their reference dV row is exactly 0) get zero dK, dV.
    unseen = np.all(ref["dv"] == 0, axis=-1)
    for name in ("dk", "dv"):
        assert np.all(got[name][unseen] == 0), name


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_cpu_matches_reference_float32(case: Case) -> None:
    inp = _make_inputs(case)
    ref = _run_ref(case, inp)
    got = _run_cpu(case, inp)
    assert got["out"].dtype == np.float32 and got["dq"].dtype == np.float32
    _check_empty_rows(got, ref)
    err = _errors(got, ref)
    bounds = dict(out=TOL_OUT, lse=TOL_LSE, dq=TOL_DQ, dk=TOL_DK, dv=TOL_DV)
    for name, bound in bounds.items():
        bound *= case.tol_factor
        if name in ("dq", "dk") and not np.any(ref[name]):
            # Every row sees a single key (e.g. Nk = 1): the softmax gradient
            # cancels exactly, so only float32 rounding noise may remain; hold
            # it to the size of the cancelling terms, as test_cpu_single_key_window.
            _assert_rounding_noise(got[name], inp, name)
            continue
        assert err[name] <= bound, f"{name}: {err[name]:.3g} > {bound:.3g} ({err})"


def _assert_rounding_noise(x: np.ndarray, inp: dict, name: str) -> None:
    D = inp["q"].shape[-1]
    size = np.linalg.norm(inp["dout"]) * np.linalg.norm(inp["v"]) / math.sqrt(D)
    assert np.linalg.norm(x) <= 1e-6 * size * np.linalg.norm(inp["k"]), name


@pytest.mark.parametrize("name", ["causal_br_113x97", "everything", "key_lengths"])
def test_cpu_float16_storage(name: str) -> None:
    case = next(c for c in CASES if c.name == name)
    inp = _make_inputs(case)
    ref = _run_ref(case, inp, dtype=np.float16)
    got = _run_cpu(case, inp, dtype=np.float16)
    for key in ("out", "dq", "dk", "dv"):
        assert got[key].dtype == np.float16
    assert got["lse"].dtype == np.float32
    _check_empty_rows(got, ref)
    err = _errors(got, ref)
    assert err["lse"] <= TOL_LSE, err
    bounds = dict(out=TOL_F16_OUT, dq=TOL_F16_GRAD, dk=TOL_F16_GRAD, dv=TOL_F16_OUT)
    for key, bound in bounds.items():
        assert err[key] <= bound, f"{key}: {err[key]:.3g} > {bound:.3g} ({err})"


@pytest.mark.parametrize("name", ["causal_br_113x97", "everything", "key_lengths"])
def test_cpu_bfloat16_storage(name: str) -> None:
    bf16 = np.dtype(ml_dtypes.bfloat16)
    case = next(c for c in CASES if c.name == name)
    inp = _make_inputs(case)
    ref = _run_ref(case, inp, dtype=bf16)
    got = _run_cpu(case, inp, dtype=bf16)
    for key in ("out", "dq", "dk", "dv"):
        assert got[key].dtype == bf16
    assert got["lse"].dtype == np.float32
    _check_empty_rows(got, ref)
    err = _errors(got, ref)
    assert err["lse"] <= TOL_LSE, err
    bounds = dict(out=TOL_BF16_OUT, dq=TOL_BF16_GRAD, dk=TOL_BF16_GRAD, dv=TOL_BF16_OUT)
    for key, bound in bounds.items():
        assert err[key] <= bound, f"{key}: {err[key]:.3g} > {bound:.3g} ({err})"


HALF = {"float16": (np.dtype(np.float16), TOL_F16_OUT, TOL_F16_GRAD),
        "bfloat16": (np.dtype(ml_dtypes.bfloat16), TOL_BF16_OUT, TOL_BF16_GRAD)}


@pytest.mark.parametrize("given", [False, True], ids=["allocated", "given"])
@pytest.mark.parametrize("dtype_name", list(HALF))
def test_public_api_half_dtypes_on_numpy_backend(dtype_name: str, given: bool) -> None:
    # 16-bit inputs through the public API: outputs in the input dtype, lse
    # float32, caller buffers written and returned; a float mask in the input dtype.
    dtype, tol_out, tol_grad = HALF[dtype_name]
    case = Case("api", 2, 2, 50, 70, 16, causal="bottom_right", mask="float_rows",
                key_lengths=(70, 33))
    inp = _make_inputs(case)
    q, k, v, do = (inp[n].astype(dtype) for n in ("q", "k", "v", "dout"))
    kw = dict(causal=case.causal, mask=inp["mask"].astype(dtype), key_lengths=inp["key_lengths"])
    ref = _run_ref(case, dict(inp, mask=kw["mask"]), dtype=dtype)

    fwd_bufs: dict = {}
    if given:
        fwd_bufs = dict(out=np.full(q.shape, np.nan, dtype), lse=np.full(q.shape[:3], np.nan, np.float32))
    out, lse = flash_attn_forward(q, k, v, **kw, backend="numpy", **fwd_bufs)
    assert out.dtype == dtype and lse.dtype == np.float32
    if given:
        assert out is fwd_bufs["out"] and lse is fwd_bufs["lse"]

    bwd_bufs: dict = {}
    if given:
        bwd_bufs = {n: np.full(a.shape, np.nan, dtype) for n, a in (("dq", q), ("dk", k), ("dv", v))}
    dq, dk, dv = flash_attn_backward(do, q, k, v, out, lse, **kw, backend="numpy",
                                     dtype=dtype_name, **bwd_bufs)
    if given:
        assert dq is bwd_bufs["dq"] and dk is bwd_bufs["dk"] and dv is bwd_bufs["dv"]
    got = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    for name in ("dq", "dk", "dv"):
        assert got[name].dtype == dtype, name
    _check_empty_rows(got, ref)
    err = _errors(got, ref)
    bounds = dict(out=tol_out, lse=TOL_LSE, dq=tol_grad, dk=tol_grad, dv=tol_out)
    for name, bound in bounds.items():
        assert err[name] <= bound, f"{name}: {err[name]:.3g} > {bound:.3g} ({err})"


def test_cpu_everything_masked() -> None:
    case = Case("all_masked", 2, 2, 33, 40, 16, causal=True, key_lengths=(0, 0))
    inp = _make_inputs(case)
    got = _run_cpu(case, inp)
    assert np.all(np.isneginf(got["lse"]))
    for name in ("out", "dq", "dk", "dv"):
        assert np.all(got[name] == 0), name


def test_cpu_bottom_right_leading_rows_masked() -> None:
    # Nq > Nk with bottom-right alignment: the first Nq - Nk rows see nothing.
    case = Case("br_tall", 1, 2, 113, 17, 8, causal="bottom_right")
    inp = _make_inputs(case)
    got = _run_cpu(case, inp)
    assert np.all(np.isneginf(got["lse"][:, :, : 113 - 17]))
    assert np.all(np.isfinite(got["lse"][:, :, 113 - 17 :]))
    assert np.all(got["out"][:, :, : 113 - 17] == 0)
    assert np.all(got["dq"][:, :, : 113 - 17] == 0)


def test_cpu_single_key_window() -> None:
    # window (0, 0): each row sees one key, so out copies it exactly and the
    # softmax gradient vanishes (dQ, dK are float32 rounding noise only).
    case = Case("diag", 1, 2, 97, 113, 64, causal="bottom_right", window=(0, 0))
    inp = _make_inputs(case)
    got = _run_cpu(case, inp)
    off = 113 - 97
    assert np.array_equal(got["out"], inp["v"][:, :, off:, :])
    assert np.array_equal(got["dv"][:, :, off:, :], inp["dout"])
    assert np.all(got["dv"][:, :, :off, :] == 0)
    for name in ("dq", "dk"):
        _assert_rounding_noise(got[name], inp, name)


def test_cpu_tile_sizes_agree() -> None:
    # Different tilings give the same result to float32 accuracy.
    base = Case("tiles", 2, 2, 97, 113, 32, causal="bottom_right", window=(25, 4),
                mask="float_rows", key_lengths=(100, 60))
    inp = _make_inputs(base)
    first = _run_cpu(base, inp)
    for blocks in [(1, 1), (16, 16), (32, 128), (128, 8)]:
        other = _run_cpu(Case(**{**base.__dict__, "blocks": blocks}), inp)
        _check_empty_rows(other, first)
        for name in ("out", "lse", "dq", "dk", "dv"):
            assert _rel(other[name], np.asarray(first[name], np.float64)) <= 1e-6, name


def _problem(case: Case, inp: dict, *, backward: bool, given: bool) -> Tuple[Problem, dict]:
    """A host Problem for run_forward/run_backward, with or without output buffers."""
    q, k, v, do = inp["q"], inp["k"], inp["v"], inp["dout"]
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    mode = normalize_causal(case.causal)
    left, right = normalize_window(case.window)

    def op(name: str, a: np.ndarray) -> Operand:
        return Operand(name, "host", a, a.shape, tuple(s // a.itemsize for s in a.strides),
                       a.dtype, 0, a)

    mask = inp["mask"]
    mask_op = None
    mask_kind = "none"
    if mask is not None:
        full = np.broadcast_to(mask, (B, H, Nq, Nk))
        mask_op = op("mask", full)
        mask_kind = "bool" if full.dtype == np.bool_ else "float"
    bufs: dict = {}
    fields: dict = {}
    if backward:
        ref_out, ref_lse = reference_forward(q, k, v, scale=case.scale, causal=case.causal,
                                             window=case.window, mask=mask,
                                             key_lengths=inp["key_lengths"])
        fields["out"] = op("out", ref_out.astype(np.float32))
        fields["lse"] = op("lse", ref_lse.astype(np.float32))
        fields["dout"] = op("dout", do)
        if given:
            for name, like in (("dq", q), ("dk", k), ("dv", v)):
                bufs[name] = np.empty_like(like)
                fields[name] = op(name, bufs[name])
    elif given:
        bufs["out"] = np.empty_like(q)
        bufs["lse"] = np.empty((B, H, Nq), np.float32)
        fields["out"] = op("out", bufs["out"])
        fields["lse"] = op("lse", bufs["lse"])
    prob = Problem(
        B=B, H=H, Nq=Nq, Nk=Nk, D=D, dtype=q.dtype,
        scale=normalize_scale(case.scale, D), causal=mode,
        window_left=left, window_right=right, band=band(Nq, Nk, mode, left, right),
        on_device=False, q=op("q", q), k=op("k", k), v=op("v", v),
        mask=mask_op, mask_kind=mask_kind, key_lengths=inp["key_lengths"], **fields,
    )
    return prob, bufs


@pytest.mark.parametrize("given", [False, True])
def test_run_forward_backward(given: bool) -> None:
    case = Case("run", 2, 2, 50, 70, 16, causal="bottom_right", mask="float_rows",
                key_lengths=(70, 33))
    inp = _make_inputs(case)
    ref = _run_ref(case, inp)

    prob, bufs = _problem(case, inp, backward=False, given=given)
    out, lse = cpu.run_forward(prob)
    assert out.shape == inp["q"].shape and out.dtype == np.float32
    assert lse.shape == inp["q"].shape[:3] and lse.dtype == np.float32
    if given:
        assert out is bufs["out"] and lse is bufs["lse"]
    assert _rel(out, ref["out"]) <= TOL_OUT
    assert _rel(lse, ref["lse"]) <= TOL_LSE

    prob, bufs = _problem(case, inp, backward=True, given=given)
    dq, dk, dv = cpu.run_backward(prob)
    if given:
        assert dq is bufs["dq"] and dk is bufs["dk"] and dv is bufs["dv"]
    for name, x in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert x.dtype == np.float32
        assert _rel(x, ref[name]) <= TOL_DQ, name


# The reference itself.


def test_reference_matches_naive_softmax() -> None:
    rng = np.random.default_rng(1)
    B, H, Nq, Nk, D = 2, 3, 5, 7, 4
    q, k, v = (rng.standard_normal(s) for s in ((B, H, Nq, D), (B, H, Nk, D), (B, H, Nk, D)))
    out, lse = reference_forward(q, k, v)
    scale = 1.0 / math.sqrt(D)
    for b in range(B):
        for h in range(H):
            for i in range(Nq):
                s = [scale * float(np.dot(q[b, h, i], k[b, h, j])) for j in range(Nk)]
                w = [math.exp(x) for x in s]
                total = sum(w)
                o = sum(w[j] * v[b, h, j] for j in range(Nk)) / total
                np.testing.assert_allclose(out[b, h, i], o, rtol=1e-12, atol=1e-12)
                assert abs(lse[b, h, i] - math.log(total)) <= 1e-12


def test_reference_mask_agrees_with_band() -> None:
    # The reference's index-grid mask equals the band of semantics.py.
    Nq_Nk = [(1, 1), (5, 9), (9, 5), (17, 17)]
    windows = [None, (0, 0), (2, None), (None, 3), (3, 1)]
    for (Nq, Nk) in Nq_Nk:
        for causal in (False, "top_left", "bottom_right"):
            for window in windows:
                q = np.zeros((1, 1, Nq, 1))
                k = np.zeros((1, 1, Nk, 1))
                v = np.ones((1, 1, Nk, 1))
                _, lse = reference_forward(q, k, v, causal=causal, window=window)
                left, right = normalize_window(window)
                bnd = band(Nq, Nk, normalize_causal(causal), left, right)
                for i in range(Nq):
                    lo, hi = bnd.key_range(i, i + 1, Nk)
                    # All scores are 0, so lse = log(number of keys seen).
                    expect = math.log(hi - lo) if hi > lo else -math.inf
                    assert lse[0, 0, i] == pytest.approx(expect, abs=1e-12)


def _loss(q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray, opts: dict) -> float:
    out, _ = reference_forward(q, k, v, **opts)
    return float(np.sum(out * do))


@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(causal="bottom_right", scale=0.7),
        dict(causal=True, window=(1, None), key_lengths=np.array([3, 4])),
        dict(mask="float"),
    ],
    ids=["plain", "causal_br", "window_keylen", "float_mask"],
)
def test_reference_gradient_finite_differences(opts: dict) -> None:
    rng = np.random.default_rng(2)
    B, H, Nq, Nk, D = 2, 1, 4, 5, 3
    q = rng.standard_normal((B, H, Nq, D))
    k = rng.standard_normal((B, H, Nk, D))
    v = rng.standard_normal((B, H, Nk, D))
    do = rng.standard_normal((B, H, Nq, D))
    opts = dict(opts)
    if opts.get("mask") == "float":
        m = rng.standard_normal((B, H, Nq, Nk))
        m[0, 0, 1, :] = -np.inf  # a row that sees nothing
        m[1, 0, :, 2] = -np.inf
        opts["mask"] = m
    grads = reference_backward(do, q, k, v, **opts)
    eps = 1e-6
    for x, g in zip((q, k, v), grads):
        for idx in np.ndindex(*x.shape):
            keep = x[idx]
            x[idx] = keep + eps
            up = _loss(q, k, v, do, opts)
            x[idx] = keep - eps
            down = _loss(q, k, v, do, opts)
            x[idx] = keep
            fd = (up - down) / (2 * eps)
            assert abs(fd - g[idx]) <= 1e-7 * (1 + abs(fd)), (idx, fd, g[idx])


def test_reference_empty_rows_are_clean() -> None:
    q = np.ones((1, 1, 3, 2))
    k = np.ones((1, 1, 4, 2))
    v = np.ones((1, 1, 4, 2))
    mask = np.ones((3, 4), dtype=bool)
    mask[1] = False
    with np.errstate(all="raise", under="ignore"):
        out, lse = reference_forward(q, k, v, mask=mask)
        dq, dk, dv = reference_backward(np.ones_like(q), q, k, v, mask=mask)
    assert lse[0, 0, 1] == -np.inf and np.all(out[0, 0, 1] == 0)
    assert np.all(dq[0, 0, 1] == 0)
    assert np.isfinite(lse[0, 0, [0, 2]]).all()
    for x in (out, dq, dk, dv):
        assert not np.isnan(x).any()
