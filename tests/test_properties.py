"""Property tests of every backend against the float64 reference.

Each drawn problem (sizes, masks, layouts, float32/float16/bfloat16 inputs:
:func:`pycudaflash.testing.attention_problems`) runs through the public API
into output buffers poisoned with NaN, so an element that no kernel writes
is caught.  Forward and backward are separate properties, each with its own
example count (the Hypothesis profile: ``ci`` or ``gpu``, see
``conftest.py``).

float32 results are held to fixed bounds (:data:`BOUNDS`).  float16 and
bfloat16 results are held to the error of a naive attention computed in the
same dtype, measured on each example (:func:`_lowp_bounds`).

The CUDA-only tests at the end (determinism, concurrent streams, foreign
array types) skip with the reason when no GPU or PyCUDA is present.
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pycudaflash import clear_plans, compiler, flash_attn_backward, flash_attn_forward
from pycudaflash.reference import reference_backward, reference_forward
from pycudaflash.semantics import normalize_scale
from pycudaflash.testing import (
    AttentionProblem,
    CheckResult,
    allowed_and_bias,
    attention_kwargs,
    attention_problems,
    check,
    lowp_reference_backward,
    lowp_reference_forward,
    make_inputs,
    noise_floors,
    numpy_dtype,
    relative_error,
    selected_profile,
    to_host,
)

# Relative-norm bounds per (backend, input dtype), one number per compared
# quantity, set from measurement: the worst error (the smallest passing rtol
# reported by scripts/calibrate_bounds.py) was
#   numpy float32, 1000 examples:       out 4.7e-7, lse 2.3e-7, dq 7.4e-7, dk 6.9e-7, dv 5.4e-7
#   numpy float32, the largest draws (D 64, 197, 255, 256; (Nq, Nk) (197, 197),
#     (700, 700), (129, 700), (700, 129); scale +-2 / sqrt(D) and the default;
#     causal or not; 3 seeds; 192 problems): out 7.1e-7, lse 1.4e-7, dq 6.6e-7,
#     dk 6.1e-7, dv 7.3e-7
#   cuda  float32, 4818 examples, H200: out 1.75e-6, lse 1.94e-6, dq 4.14e-6, dk 3.28e-6, dv 1.69e-6
# and each bound is that worst case with a margin of about 1.5x.  The CUDA
# kernels run the float32 products as split TF32 on the tensor cores, whose
# truncating accumulation makes the error grow with the head dim (1e-6 at
# D = 64 to 3e-6 at D = 256 for random inputs; the worst lse is a single
# score q.k at D = 255).
BOUNDS: Dict[Tuple[str, str], Dict[str, float]] = {
    ("numpy", "float32"): {"out": 1.1e-6, "lse": 3.5e-7, "dq": 1.1e-6, "dk": 1.1e-6, "dv": 1.1e-6},
    ("cuda", "float32"): {"out": 2.6e-6, "lse": 2.9e-6, "dq": 6.2e-6, "dk": 4.9e-6, "dv": 2.6e-6},
}

# float16 and bfloat16 have no fixed bounds.  Each result is compared with
# the float64 reference, and so is the same attention computed naively in
# that dtype (the baseline: torch on the GPU when the CUDA backend is under
# test and torch is importable, else its NumPy emulation
# pycudaflash.testing.lowp_reference_forward/backward).  The bound is
#     rtol_norm = 2 * baseline_error + LOWP_FLOOR[dtype][quantity],
# with atol = rtol_norm * noise floor as for float32, where baseline_error is
# the baseline's relative-norm error on the scale that check() applies its
# norm bound on (||ref|| + ||noise floor||, relative_error(..., floor=)).
# The norm condition then reads
#     ||result - ref|| <= 2 ||baseline - ref|| + floor * (||ref|| + ||noise floor||):
# at most twice the baseline's error, plus the floor.  The element bound of
# check() scales with the same rtol_norm.  baseline_error is the larger of two
# naive orders' errors: torch's (above: scores rounded to the dtype, the
# normalized softmax rounded) and the blockwise one of fused kernels
# (order='blockwise': scores and P in float32, exp(s - rowmax) rounded and
# divided by the row sum at the end; dS rounded once).  On large outputs the two
# agree; on a handful of elements one order can be lucky where the other is
# not.  Seen on the GPU, with the kernels matching the blockwise order to the
# bit: bfloat16 out of Nq = 1, Nk = 2, D = 1 (two opposite-signed terms that
# cancel to a tenth of their size) 1.08 units in the last place off, torch's
# order 0.08; float16 dv of Nq = Nk = 2, D = 1 off by 8.4e-4, torch's order
# (its scores rounded first) by 1.4e-4.
#
# The floors, as fractions of the unit roundoff u (2**-11 for float16, 2**-8
# for bfloat16):
# * out, lse, dv: u/8.  Every implementation rounds out/dv to the dtype once,
#   an error of about u/2 relative (RMS) that the baseline incurs too, so the
#   floor only matters where the baseline is (almost) exact: lse of scores that
#   the dtype holds exactly (scale 0, a single key), where both are float32
#   computations differing by ~1e-7; u/8 (6e-5 / 5e-4) covers that and stays
#   well below any rounding to the dtype.
# * dq, dk: u/2.  The backward pass receives out rounded to the dtype, and
#   D_i = rowsum(dO * out) inherits that rounding (~u relative); in dS it no
#   longer cancels and adds D_i-sized noise to dq and dk, which torch's
#   autograd does not see (its softmax backward uses its own float32 P).  The
#   noise floors scale with D_i, and over 400 drawn problems the NumPy
#   backend, and an emulation of kernels that round P and dS to the dtype,
#   needed at most 0.21 u of floor there (cases where one key dominates a
#   row and dq is far smaller than D_i).
UNIT_ROUNDOFF: Dict[str, float] = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
LOWP_FLOOR: Dict[str, Dict[str, float]] = {
    name: {"out": u / 8, "lse": u / 8, "dv": u / 8, "dq": u / 2, "dk": u / 2}
    for name, u in UNIT_ROUNDOFF.items()
}
DTYPES = ("float32",) + tuple(UNIT_ROUNDOFF)


# Cap on B * H * Nq * Nk * D per profile, which bounds the cost of every
# example (the float64 reference is dense); None: only the per-dimension
# maxima (B <= 2, H <= 4, N <= 700, D <= 256).
MAX_ELEMENTS: Dict[str, Optional[int]] = {"ci": 10_000_000, "gpu": None}

# One strategy per dtype: the properties are parametrized by dtype, so each
# dtype gets the profile's full example count.  Up to 4 heads, so that K/V
# head groups of 2 and of 4 can be drawn.
PROBLEMS = {
    dtype: attention_problems(
        dtypes=(dtype,),
        max_elements=MAX_ELEMENTS.get(selected_profile(), MAX_ELEMENTS["ci"]),
        groups=True,
        max_heads=4,
    )
    for dtype in DTYPES
}


# --------------------------------------------------------------------------
# moving arrays to a backend
# --------------------------------------------------------------------------


def _to_device(x: Optional[np.ndarray]) -> Any:
    """Upload a host array as a pycuda GPUArray with the same (B, H, N, D) layout.

    A C-contiguous array is uploaded as is.  A 'bnhd' view (the transpose of
    a contiguous (B, N, H, D) array) is uploaded as its (B, N, H, D) base and
    viewed as (B, H, N, D) through strides, without a copy on the device.
    """
    if x is None:
        return None
    import pycuda.gpuarray as gpuarray

    if x.flags.c_contiguous:
        return gpuarray.to_gpu(x)
    base_host = x.transpose(0, 2, 1, 3)
    assert base_host.flags.c_contiguous, "only 'bhnd' and 'bnhd' layouts are uploaded"
    base = gpuarray.to_gpu(base_host)
    B, N, H, D = base_host.shape
    it = x.dtype.itemsize
    return gpuarray.GPUArray(
        (B, H, N, D), x.dtype, gpudata=base.gpudata,
        strides=(N * H * D * it, D * it, H * D * it, it), base=base,
    )


def _put(x: Optional[np.ndarray], backend: str) -> Any:
    return _to_device(x) if backend == "cuda" and x is not None else x


def _poisoned(shape: Tuple[int, ...], dtype: Any, backend: str) -> Any:
    """A contiguous output buffer filled with NaN."""
    host = np.full(shape, np.nan, dtype=dtype)
    return _to_device(host) if backend == "cuda" else host


def _device_kwargs(problem: AttentionProblem, x: Dict[str, Any], backend: str) -> Dict[str, Any]:
    """Attention keywords with the mask on the backend's side (key lengths stay on the host)."""
    kw = attention_kwargs(problem, x)
    kw["mask"] = _put(kw["mask"], backend)
    return kw


# --------------------------------------------------------------------------
# running and checking
# --------------------------------------------------------------------------


def _assert_all(results: List[CheckResult], problem: AttentionProblem, backend: str) -> None:
    failed = [r for r in results if not r.ok]
    if failed:
        lines = "\n".join(str(r) for r in results)
        raise AssertionError(f"backend {backend!r}, {problem}\n{lines}")


def _dtype_kwargs(problem: AttentionProblem) -> Dict[str, Any]:
    """``dtype=`` for 16-bit problems: a bfloat16 GPUArray exports the opaque '<V2'."""
    return {} if problem.dtype == "float32" else {"dtype": problem.dtype}


def _run_forward(
    problem: AttentionProblem, x: Dict[str, Any], backend: str, stream: Any = None,
) -> Tuple[Any, Any, Dict[str, Any]]:
    """Forward pass (on ``stream``, not synchronised) into poisoned buffers;
    returns the buffers and the device inputs."""
    B, H, Nq, D = problem.B, problem.H, problem.Nq, problem.D
    dev = {name: _put(x[name], backend) for name in ("q", "k", "v", "dout")}
    kw = _device_kwargs(problem, x, backend)
    out = _poisoned((B, H, Nq, D), x["q"].dtype, backend)
    lse = _poisoned((B, H, Nq), np.float32, backend)
    ret_out, ret_lse = flash_attn_forward(
        dev["q"], dev["k"], dev["v"], **kw, out=out, lse=lse, backend=backend, stream=stream,
        **_dtype_kwargs(problem),
    )
    assert ret_out is out and ret_lse is lse, "the out=/lse= buffers must be returned"
    return out, lse, dev


# --------------------------------------------------------------------------
# float16/bfloat16 bounds from a baseline in the same dtype
# --------------------------------------------------------------------------


def _torch_usable() -> bool:
    """Whether torch imports and sees a CUDA device."""
    try:
        import torch
    except Exception:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _torch_baseline(
    problem: AttentionProblem, x: Dict[str, Any], kw: Dict[str, Any], backward: bool,
) -> Dict[str, np.ndarray]:
    """The attention computed explicitly by torch in the problem's dtype on the GPU.

    ``s = (q @ k^T) * scale``, plus the float mask (a float32 mask promotes
    ``s`` to float32), ``masked_fill`` with ``-inf``, ``softmax(s, dtype=
    float32).to(dtype)``, ``out = p @ v``; ``lse = logsumexp(s.float())``;
    the gradients by autograd.  Rows that see no key get ``out = 0``,
    ``lse = -inf`` and zero gradients (their softmax input is replaced by
    zeros and their probabilities by 0, so no NaN arises).  cuBLAS keeps its
    float32 accumulation throughout (no reduced-precision split-K
    reductions), like the NumPy emulation.
    """
    import torch

    flags = torch.backends.cuda.matmul
    names = [n for n in ("allow_fp16_reduced_precision_reduction",
                         "allow_bf16_reduced_precision_reduction") if hasattr(flags, n)]
    saved = {n: getattr(flags, n) for n in names}
    try:
        for n in names:
            setattr(flags, n, False)
        return _torch_attention(torch, "cuda", problem, x, kw, backward)
    finally:
        for n, value in saved.items():
            setattr(flags, n, value)


def _torch_attention(
    torch: Any, device: str, problem: AttentionProblem, x: Dict[str, Any], kw: Dict[str, Any],
    backward: bool,
) -> Dict[str, np.ndarray]:
    """The body of :func:`_torch_baseline`, on ``device``."""
    dev = torch.device(device)
    tdt = getattr(torch, problem.dtype)
    in_dtype = numpy_dtype(problem.dtype)

    def tensor(a: np.ndarray, dtype: Any = tdt) -> Any:
        return torch.from_numpy(np.array(a, dtype=np.float32, order="C")).to(dev).to(dtype)

    q, k_in, v_in = (tensor(x[n]).requires_grad_(backward) for n in ("q", "k", "v"))
    B, H, Nq, D = q.shape
    Nk = k_in.shape[2]
    # Grouped K/V heads: repeated to H (autograd sums each group's gradients).
    k, v = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (k_in, v_in))
    scale = normalize_scale(kw["scale"], D)
    allowed, bias = allowed_and_bias(
        B, H, Nq, Nk, causal=kw["causal"], window=kw["window"], mask=kw["mask"],
        key_lengths=kw["key_lengths"],
    )
    s = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + tensor(bias, tdt if bias.dtype == in_dtype else torch.float32)
    s = s.masked_fill(~torch.from_numpy(np.array(allowed, order="C")).to(dev), float("-inf"))
    seen = torch.isfinite(s).any(dim=-1, keepdim=True)
    p = torch.softmax(torch.where(seen, s, torch.zeros_like(s)), dim=-1, dtype=torch.float32)
    p = torch.where(seen, p, torch.zeros_like(p)).to(tdt)
    out = p @ v
    res = {"out": out, "lse": torch.logsumexp(s.detach().float(), dim=-1)}
    if backward:
        grads = torch.autograd.grad(out, (q, k_in, v_in), tensor(x["dout"]))
        res.update(zip(("dq", "dk", "dv"), grads))
    return {n: a.detach().float().cpu().numpy() for n, a in res.items()}


def _lowp_baseline(
    problem: AttentionProblem, x: Dict[str, Any], kw: Dict[str, Any], backend: str,
    backward: bool,
) -> Dict[str, np.ndarray]:
    """The naive attention in the problem's dtype: torch for the CUDA backend when
    it is usable, else the NumPy emulation."""
    if backend == "cuda" and _torch_usable():
        return _torch_baseline(problem, x, kw, backward)
    res: Dict[str, np.ndarray] = {}
    res["out"], res["lse"] = lowp_reference_forward(x["q"], x["k"], x["v"], **kw)
    if backward:
        grads = lowp_reference_backward(x["dout"], x["q"], x["k"], x["v"], **kw)
        res.update(zip(("dq", "dk", "dv"), grads))
    return res


def _bounds(
    problem: AttentionProblem, x: Dict[str, Any], kw: Dict[str, Any], backend: str,
    ref: Dict[str, np.ndarray], floors: Dict[str, np.ndarray], names: Sequence[str],
) -> Dict[str, float]:
    """rtol_norm per quantity: :data:`BOUNDS` for float32, else measured (see the top)."""
    if problem.dtype == "float32":
        return BOUNDS[(backend, problem.dtype)]
    return _lowp_bounds(problem, x, kw, backend, ref, floors, names)


def _lowp_bounds(
    problem: AttentionProblem, x: Dict[str, Any], kw: Dict[str, Any], backend: str,
    ref: Dict[str, np.ndarray], floors: Dict[str, np.ndarray], names: Sequence[str],
) -> Dict[str, float]:
    """``2 * baseline_error + LOWP_FLOOR`` for each quantity in ``names``."""
    backward = "dq" in names
    base = _lowp_baseline(problem, x, kw, backend, backward)
    block = dict(zip(("out", "lse"), lowp_reference_forward(x["q"], x["k"], x["v"], order="blockwise", **kw)))
    if backward:
        block.update(zip(("dq", "dk", "dv"), lowp_reference_backward(x["dout"], x["q"], x["k"], x["v"],
                                                                    order="blockwise", **kw)))
    bounds = {}
    for name in names:
        err = max(relative_error(base[name], ref[name], floors[name]),
                  relative_error(block[name], ref[name], floors[name]))
        assert math.isfinite(err), (
            f"the {problem.dtype} baseline itself is not finite for {name} (or misses the "
            f"reference's -inf pattern): {problem}"
        )
        bounds[name] = 2.0 * err + LOWP_FLOOR[problem.dtype][name]
    return bounds


def _forward_checks(
    out: np.ndarray, lse: np.ndarray, ref_out: np.ndarray, ref_lse: np.ndarray,
    floors: Dict[str, np.ndarray], bounds: Dict[str, float],
) -> List[CheckResult]:
    sees_nothing = ~np.isfinite(ref_lse)  # rows that see no key: lse = -inf, out = 0
    return [
        check("out", out, ref_out, rtol_norm=bounds["out"], atol=bounds["out"] * floors["out"],
              exact=sees_nothing[..., None]),
        check("lse", lse, ref_lse, rtol_norm=bounds["lse"], atol=bounds["lse"] * floors["lse"]),
    ]


def _skip_float32_repeat(dtype: str) -> None:
    """float32 has no Hopper kernels: its 'cuda-mma' run would repeat the 'cuda' one."""
    if dtype == "float32" and os.environ.get(compiler.HOPPER_ENV) == "0":
        pytest.skip("float32 runs the same kernels with or without $PYCUDAFLASH_WGMMA")


@pytest.mark.parametrize("dtype", DTYPES)
@given(data=st.data())
def test_forward_matches_reference(backend: str, dtype: str, data: Any) -> None:
    _skip_float32_repeat(dtype)
    problem = data.draw(PROBLEMS[dtype], label="problem")
    x = make_inputs(problem)
    kw_host = attention_kwargs(problem, x)
    ref_out, ref_lse = reference_forward(x["q"], x["k"], x["v"], **kw_host)
    out, lse, _ = _run_forward(problem, x, backend)
    floors = noise_floors(x["q"], x["k"], x["v"], **kw_host)
    ref = {"out": ref_out, "lse": ref_lse}
    bounds = _bounds(problem, x, kw_host, backend, ref, floors, ("out", "lse"))
    results = _forward_checks(to_host(out), to_host(lse), ref_out, ref_lse, floors, bounds)
    _assert_all(results, problem, backend)


def _launch_backward(
    problem: AttentionProblem, x: Dict[str, Any], backend: str, deterministic: bool, stream: Any = None,
) -> Tuple[Any, ...]:
    """Forward, then backward into poisoned buffers, on ``stream`` (not
    synchronised); returns out, lse, dq, dk, dv and the device inputs."""
    out, lse, dev = _run_forward(problem, x, backend, stream)
    B, H, Nq, Nk, D = problem.B, problem.H, problem.Nq, problem.Nk, problem.D
    dtype = x["q"].dtype
    dq = _poisoned((B, H, Nq, D), dtype, backend)
    dk = _poisoned((B, problem.kv_heads, Nk, D), dtype, backend)
    dv = _poisoned((B, problem.kv_heads, Nk, D), dtype, backend)
    ret = flash_attn_backward(
        dev["dout"], dev["q"], dev["k"], dev["v"], out, lse,
        **_device_kwargs(problem, x, backend), dq=dq, dk=dk, dv=dv, backend=backend,
        deterministic=deterministic, stream=stream, **_dtype_kwargs(problem),
    )
    assert ret[0] is dq and ret[1] is dk and ret[2] is dv, "the dq=/dk=/dv= buffers must be returned"
    return out, lse, dq, dk, dv, dev


def _backward_checks(problem: AttentionProblem, x: Dict[str, Any], backend: str, out: Any, lse: Any, dq: Any,
                     dk: Any, dv: Any) -> List[CheckResult]:
    """Every output of a forward and backward against the float64 reference."""
    kw_host = attention_kwargs(problem, x)
    ref_out, ref_lse = reference_forward(x["q"], x["k"], x["v"], **kw_host)
    ref_dq, ref_dk, ref_dv = reference_backward(x["dout"], x["q"], x["k"], x["v"], **kw_host)
    floors = noise_floors(x["q"], x["k"], x["v"], x["dout"], **kw_host)
    ref = {"out": ref_out, "lse": ref_lse, "dq": ref_dq, "dk": ref_dk, "dv": ref_dv}
    bounds = _bounds(problem, x, kw_host, backend, ref, floors, tuple(ref))
    row_empty = ~np.isfinite(ref_lse)[..., None]  # rows that see no key: dq = 0
    # Keys that no row sees: dk = dv = 0 exactly (with random dout, dv_j is 0
    # only when the whole column of P is).
    key_unseen = np.all(ref_dv == 0.0, axis=-1, keepdims=True)
    results = _forward_checks(to_host(out), to_host(lse), ref_out, ref_lse, floors, bounds)
    results += [
        check("dq", to_host(dq), ref_dq, rtol_norm=bounds["dq"],
              atol=bounds["dq"] * floors["dq"], exact=row_empty),
        check("dk", to_host(dk), ref_dk, rtol_norm=bounds["dk"],
              atol=bounds["dk"] * floors["dk"], exact=key_unseen),
        check("dv", to_host(dv), ref_dv, rtol_norm=bounds["dv"],
              atol=bounds["dv"] * floors["dv"], exact=key_unseen),
    ]
    return results


@pytest.mark.parametrize("dtype", DTYPES)
@given(data=st.data())
def test_backward_matches_reference(backend: str, dtype: str, data: Any) -> None:
    _skip_float32_repeat(dtype)
    problem = data.draw(PROBLEMS[dtype], label="problem")
    # The deterministic mode computes dQ by another kernel (no atomics).
    deterministic = data.draw(st.booleans(), label="deterministic")
    x = make_inputs(problem)
    bufs = _launch_backward(problem, x, backend, deterministic)
    _assert_all(_backward_checks(problem, x, backend, *bufs[:5]), problem, backend)


# --------------------------------------------------------------------------
# CUDA only
# --------------------------------------------------------------------------


def _bytes(*arrays: Any) -> Tuple[bytes, ...]:
    return tuple(np.ascontiguousarray(to_host(a)).tobytes() for a in arrays)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hkv", [3, 1], ids=["heads", "grouped"])
def test_deterministic_backward_is_bit_identical(cuda: None, causal: bool, dtype: str, hkv: int) -> None:
    problem = AttentionProblem(B=2, H=3, Nq=700, Nk=700, D=64 if dtype == "float32" else 128,
                               dtype=dtype, causal=causal, seed=11, Hkv=hkv)
    x = make_inputs(problem)
    out, lse, dev = _run_forward(problem, x, "cuda")
    runs = []
    for _ in range(3):
        grads = flash_attn_backward(
            dev["dout"], dev["q"], dev["k"], dev["v"], out, lse,
            causal=causal, deterministic=True, backend="cuda", **_dtype_kwargs(problem),
        )
        runs.append(_bytes(*grads))
    assert runs[0] == runs[1], "deterministic backward differs between runs 1 and 2"
    assert runs[0] == runs[2], "deterministic backward differs between runs 1 and 3"


_STREAM_PROBLEMS = (
    AttentionProblem(B=2, H=3, Nq=700, Nk=700, D=64, causal=True, seed=21),
    AttentionProblem(
        B=2, H=2, Nq=257, Nk=513, D=128, causal="bottom_right", window=(200, None),
        key_lengths=(400, 513), mask_kind="float", mask_shape="1HNqNk",
        mask_inf_fraction=0.1, mask_empty_rows=True, layout="bnhd", seed=22,
    ),
)


@pytest.mark.gpu
def test_two_streams_match_single_runs(cuda: None) -> None:
    import pycuda.driver as drv

    inputs = [make_inputs(p) for p in _STREAM_PROBLEMS]
    alone = []
    for p, x in zip(_STREAM_PROBLEMS, inputs):
        bufs = _launch_backward(p, x, "cuda", deterministic=True)
        drv.Context.synchronize()
        alone.append(_bytes(*bufs[:5]))

    streams = [drv.Stream(), drv.Stream()]
    launched = [_launch_backward(p, x, "cuda", deterministic=True, stream=s)
                for p, x, s in zip(_STREAM_PROBLEMS, inputs, streams)]
    for s in streams:
        s.synchronize()
    together = [_bytes(*bufs[:5]) for bufs in launched]
    for i, (a, t) in enumerate(zip(alone, together)):
        for name, ba, bt in zip(("out", "lse", "dq", "dk", "dv"), a, t):
            assert ba == bt, f"problem {i}: {name} differs when run concurrently on two streams"


_PERSISTENT_PROBLEMS = (
    AttentionProblem(B=4, H=5, Nq=1000, Nk=1000, D=128, dtype="float16", causal=True, seed=23),
    AttentionProblem(B=2, H=3, Nq=257, Nk=513, D=100, dtype="bfloat16", causal="bottom_right",
                     window=(200, None), key_lengths=(0, 300), seed=24),
)


@pytest.mark.gpu
def test_forward_job_counter_repeats_and_streams(cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward gives the same bytes run after run and on two streams at
    once, and leaves every job counter of a persistent grid at zero."""
    import pycuda.driver as drv

    from pycudaflash import cuda_backend

    # The kernels the library picks by default (a session-scoped 'cuda-mma'
    # run may still have the Hopper kernels switched off).
    monkeypatch.delenv(compiler.HOPPER_ENV, raising=False)
    # (the persistent forward serves head dim 128 where the TMA forward does not)
    monkeypatch.setenv(compiler.TILES_ENV, "h128:fwd90_tma=0")
    clear_plans()
    counters_before = len(cuda_backend.job_counters())
    inputs = [make_inputs(p) for p in _PERSISTENT_PROBLEMS]
    alone = []
    for p, x in zip(_PERSISTENT_PROBLEMS, inputs):
        runs = []
        for _ in range(3):
            res = _run_forward(p, x, "cuda")
            drv.Context.synchronize()
            runs.append(_bytes(*res[:2]))
        assert runs[1] == runs[0] and runs[2] == runs[0], f"{p}: forward differs between runs"
        alone.append(runs[0])
    streams = [drv.Stream(), drv.Stream()]
    for _ in range(2):
        launched = [_run_forward(p, x, "cuda", s) for p, x, s in zip(_PERSISTENT_PROBLEMS, inputs, streams)]
        for s in streams:
            s.synchronize()
        for p, a, res in zip(_PERSISTENT_PROBLEMS, alone, launched):
            assert _bytes(*res[:2]) == a, f"{p}: forward differs when run on two streams at once"
    counters = cuda_backend.job_counters()
    if compiler.arch_of_current_device() in compiler.HOPPER_ARCHES:
        # The default stream's counter may come from an earlier test; each
        # new stream gets its own.
        assert len(counters) >= max(counters_before, 1) + 2, \
            "the persistent forward did not use one job counter per stream"
    for key, ptr in counters.items():
        left = np.full(2, -1, np.int32)
        drv.memcpy_dtoh(left, ptr)
        assert not left.any(), f"job counter of {key} left at {left.tolist()} after its launches"


# Head dims with whole float4 rows (100), pairs only (70) and odd (33);
# heads whose key length is 0 (no block adds to their dQ); Nq != Nk both ways.
_ROW_KERNEL_PROBLEMS = (
    AttentionProblem(B=2, H=3, Nq=301, Nk=200, D=100, dtype="float16", causal="bottom_right",
                     key_lengths=(0, 150), seed=31),
    AttentionProblem(B=1, H=3, Nq=129, Nk=385, D=70, dtype="bfloat16", window=(64, 32), seed=32),
    AttentionProblem(B=3, H=1, Nq=97, Nk=97, D=33, dtype="float16", seed=33),
    AttentionProblem(B=1, H=3, Nq=65, Nk=77, D=41, dtype="float32", causal=True, seed=34),
)


@pytest.mark.gpu
def test_backward_accumulator_reused_across_calls_and_streams(
    cuda: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The non-deterministic backward (dQ accumulator zeroed by the
    preprocess kernel, rounded by the conversion kernel, both PRE_ROWS rows
    a warp: row counts 301*6, 129*3, 97*3, 65*3 end inside a warp's rows) is
    right run after run, in the stream workspace earlier calls left dirty,
    and on two streams at once."""
    import pycuda.driver as drv

    monkeypatch.delenv(compiler.HOPPER_ENV, raising=False)  # (see the job-counter test)
    inputs = [make_inputs(p) for p in _ROW_KERNEL_PROBLEMS]
    for _ in range(2):
        for p, x in zip(_ROW_KERNEL_PROBLEMS, inputs):
            bufs = _launch_backward(p, x, "cuda", deterministic=False)
            drv.Context.synchronize()
            _assert_all(_backward_checks(p, x, "cuda", *bufs[:5]), p, "cuda")
    streams = [drv.Stream(), drv.Stream()]
    launched = [(p, x, _launch_backward(p, x, "cuda", False, s))
                for p, x, s in zip(_ROW_KERNEL_PROBLEMS, inputs, streams * 2)]
    for s in streams:
        s.synchronize()
    for p, x, bufs in launched:
        _assert_all(_backward_checks(p, x, "cuda", *bufs[:5]), p, "cuda")


# The Hopper backward's dQ through staged tiles and the copy engine (head dims
# 64, 96 and 128, where D is the bucket's; Tiles.bwd90_dq_bulk): one query
# tile (Nq 1), a partial last tile (65, 257), many tiles (700), grouped heads,
# a band, key lengths with a head that sees no key; D 120 (bucket 128) takes
# the atomics beside them.
_STAGED_DQ_PROBLEMS = (
    AttentionProblem(B=2, H=2, Nq=1, Nk=300, D=64, dtype="bfloat16", seed=41),
    AttentionProblem(B=1, H=4, Nq=700, Nk=300, D=64, dtype="float16", causal="bottom_right", Hkv=2, seed=42),
    AttentionProblem(B=2, H=2, Nq=257, Nk=129, D=96, dtype="bfloat16", window=(100, 20), seed=43),
    AttentionProblem(B=2, H=3, Nq=65, Nk=700, D=128, dtype="float16", key_lengths=(0, 513), seed=44),
    AttentionProblem(B=1, H=2, Nq=700, Nk=700, D=128, dtype="bfloat16", causal=True, Hkv=1, seed=45),
    AttentionProblem(B=1, H=2, Nq=257, Nk=300, D=120, dtype="bfloat16", seed=46),
)


@pytest.mark.gpu
@pytest.mark.parametrize("dq_bulk", [0, 1], ids=["atomics", "bulk"])
@pytest.mark.parametrize("problem", _STAGED_DQ_PROBLEMS, ids=lambda p: f"D{p.D}-Nq{p.Nq}")
def test_backward_dq_through_staged_tiles(cuda: None, monkeypatch: pytest.MonkeyPatch, problem: AttentionProblem,
                                          dq_bulk: int) -> None:
    """dq of the atomic backward, with Tiles.bwd90_dq_bulk off and on (on Hopper: staged tiles
    added by the copy engine), against the float64 reference, twice in a row into poisoned
    buffers (a staging buffer or accumulator row left over from the first call would show in
    the second)."""
    import pycuda.driver as drv

    monkeypatch.delenv(compiler.HOPPER_ENV, raising=False)
    monkeypatch.setenv(compiler.TILES_ENV, ";".join(f"h{hd}:bwd90_dq_bulk={dq_bulk}" for hd in (64, 96, 128)))
    clear_plans()
    x = make_inputs(problem)
    for _ in range(2):
        bufs = _launch_backward(problem, x, "cuda", deterministic=False)
        drv.Context.synchronize()
        _assert_all(_backward_checks(problem, x, "cuda", *bufs[:5]), problem, "cuda")
    clear_plans()


@pytest.mark.gpu
def test_numpy_inputs_run_on_gpu_by_default(cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from pycudaflash import cpu

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the NumPy backend ran although a GPU is usable")

    monkeypatch.setattr(cpu, "run_forward", refuse)
    monkeypatch.setattr(cpu, "run_backward", refuse)
    problem = AttentionProblem(
        B=1, H=2, Nq=129, Nk=65, D=64, causal="bottom_right", key_lengths=(50,),
        layout="bnhd", seed=31,
    )
    x = make_inputs(problem)
    kw = attention_kwargs(problem, x)
    out, lse = flash_attn_forward(x["q"], x["k"], x["v"], **kw)
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    dq, dk, dv = flash_attn_backward(x["dout"], x["q"], x["k"], x["v"], out, lse, **kw)
    assert all(isinstance(a, np.ndarray) for a in (dq, dk, dv))
    ref_out, ref_lse = reference_forward(x["q"], x["k"], x["v"], **kw)
    ref_dq, ref_dk, ref_dv = reference_backward(x["dout"], x["q"], x["k"], x["v"], **kw)
    b = BOUNDS[("cuda", "float32")]
    _assert_all([
        check("out", out, ref_out, rtol_norm=b["out"]),
        check("lse", lse, ref_lse, rtol_norm=b["lse"]),
        check("dq", dq, ref_dq, rtol_norm=b["dq"]),
        check("dk", dk, ref_dk, rtol_norm=b["dk"]),
        check("dv", dv, ref_dv, rtol_norm=b["dv"]),
    ], problem, "default")


_FOREIGN_PROBLEM = AttentionProblem(
    B=2, H=3, Nq=97, Nk=130, D=64, causal="bottom_right", layout="bnhd", seed=41,
)


def _foreign_roundtrip(to_dev: Any, full_nan: Any, synchronize: Any) -> None:
    """Run forward and backward on foreign device arrays whose (B, H, N, D)
    operands are ``transpose(1, 2)`` views of (B, N, H, D) storage, outputs
    included, and compare with the reference.

    ``to_dev(a)`` uploads a contiguous host array; ``full_nan(shape)`` makes a
    NaN-filled float32 device array.  Outputs written through their strides
    into the (B, N, H, D) storage show that no copy was made.
    """
    p = _FOREIGN_PROBLEM
    x = make_inputs(p)

    def bnhd(a: np.ndarray) -> Any:
        return to_dev(np.ascontiguousarray(a.transpose(0, 2, 1, 3))).swapaxes(1, 2)

    q, k, v, dout = (bnhd(x[n]) for n in ("q", "k", "v", "dout"))
    out_store = full_nan((p.B, p.Nq, p.H, p.D))
    dq_store = full_nan((p.B, p.Nq, p.H, p.D))
    dk_store = full_nan((p.B, p.Nk, p.H, p.D))
    dv_store = full_nan((p.B, p.Nk, p.H, p.D))
    lse = full_nan((p.B, p.H, p.Nq))
    out = out_store.swapaxes(1, 2)
    dq, dk, dv = (s.swapaxes(1, 2) for s in (dq_store, dk_store, dv_store))

    kw = attention_kwargs(p, x)
    r = flash_attn_forward(q, k, v, **kw, out=out, lse=lse)
    assert r[0] is out and r[1] is lse
    r = flash_attn_backward(dout, q, k, v, out, lse, **kw, dq=dq, dk=dk, dv=dv)
    assert r[0] is dq and r[1] is dk and r[2] is dv
    synchronize()

    def back(store: Any) -> np.ndarray:
        return to_host(store).transpose(0, 2, 1, 3)

    ref_out, ref_lse = reference_forward(x["q"], x["k"], x["v"], **kw)
    ref_dq, ref_dk, ref_dv = reference_backward(x["dout"], x["q"], x["k"], x["v"], **kw)
    b = BOUNDS[("cuda", "float32")]
    _assert_all([
        check("out", back(out_store), ref_out, rtol_norm=b["out"]),
        check("lse", to_host(lse), ref_lse, rtol_norm=b["lse"]),
        check("dq", back(dq_store), ref_dq, rtol_norm=b["dq"]),
        check("dk", back(dk_store), ref_dk, rtol_norm=b["dk"]),
        check("dv", back(dv_store), ref_dv, rtol_norm=b["dv"]),
    ], p, "cuda")


@pytest.mark.gpu
def test_torch_tensors_and_transposed_views(cuda: None) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    _foreign_roundtrip(
        lambda a: torch.from_numpy(a).cuda(),
        lambda shape: torch.full(shape, float("nan"), dtype=torch.float32, device="cuda"),
        torch.cuda.synchronize,
    )


@pytest.mark.gpu
def test_cupy_arrays_and_transposed_views(cuda: None) -> None:
    cupy = pytest.importorskip("cupy", reason="cupy is not installed")
    _foreign_roundtrip(
        cupy.asarray,
        lambda shape: cupy.full(shape, np.nan, dtype=cupy.float32),
        lambda: cupy.cuda.Device().synchronize(),
    )
