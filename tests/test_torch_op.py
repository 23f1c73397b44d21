"""The torch operator (``pycudaflash.torch``), torch tensors through the plain
API, and output buffers that overlap other arrays.

The operator runs CPU tensors on the NumPy backend, so its forward, its
gradients (through autograd), its custom operators and ``torch.compile`` are
all tested without a GPU; with a GPU, the same properties run on CUDA tensors
and the GPU-only tests at the end check streams, graphs and threads.
Results are held to the bounds of the property suite (``test_properties``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any, Dict, Tuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[test]')")

from pycudaflash import flash_attn_backward, flash_attn_forward  # noqa: E402
from pycudaflash.testing import AttentionProblem, attention_kwargs, attention_problems, make_inputs  # noqa: E402
from pycudaflash.torch import flash_attention  # noqa: E402
from test_properties import _assert_all, _backward_checks  # noqa: E402

DTYPES = ("float32", "float16", "bfloat16")


def _devices() -> Tuple[Any, ...]:
    return ("cpu", pytest.param("cuda", marks=pytest.mark.gpu))


def _need(device: str) -> None:
    if device == "cuda":
        from pycudaflash import cuda_status

        usable, reason = cuda_status()
        if not usable:
            pytest.skip(f"CUDA backend unavailable: {reason}")
        if not torch.cuda.is_available():
            pytest.skip("torch sees no CUDA device")


def _tensor(a: np.ndarray, device: str, requires_grad: bool = False) -> Any:
    """A tensor with ``a``'s values, dtype and strides (a 'bnhd' view stays a view)."""
    if a.dtype.name == "bfloat16":
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    if device != "cpu":
        base = t.transpose(1, 2) if not a.flags.c_contiguous and a.ndim == 4 else t
        moved = base.contiguous().to(device)
        t = moved.transpose(1, 2) if base is not t else moved
    return t.detach().requires_grad_(requires_grad)


def _op_kwargs(problem: AttentionProblem, x: Dict[str, Any], device: str) -> Dict[str, Any]:
    kw = attention_kwargs(problem, x)
    if kw["mask"] is not None:
        kw["mask"] = _tensor(np.ascontiguousarray(kw["mask"]), device)
    if kw["key_lengths"] is not None:
        kw["key_lengths"] = torch.from_numpy(np.asarray(kw["key_lengths"])).to(device)
    return kw


def _run_op(problem: AttentionProblem, x: Dict[str, Any], device: str, fn: Any = flash_attention,
            deterministic: bool = False) -> Tuple[Any, ...]:
    """out, lse, dq, dk, dv of the operator (gradients through autograd)."""
    q, k, v = (_tensor(x[n], device, True) for n in ("q", "k", "v"))
    dout = _tensor(x["dout"], device)
    out, lse = fn(q, k, v, **_op_kwargs(problem, x, device), deterministic=deterministic, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32 and not lse.requires_grad
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out, lse, dq, dk, dv


# (4 heads: K/V head groups of 2 and of 4 can be drawn.)
PROBLEMS = {dtype: attention_problems(dtypes=(dtype,), max_elements=2_000_000, groups=True, max_heads=4)
            for dtype in DTYPES}


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=25)
@given(data=st.data())
def test_op_and_gradients_match_reference(device: str, dtype: str, data: Any) -> None:
    """Every mask mode, layout and odd size: out, lse and autograd's dq, dk, dv."""
    _need(device)
    problem = data.draw(PROBLEMS[dtype], label="problem")
    x = make_inputs(problem)
    res = _run_op(problem, x, device, deterministic=data.draw(st.booleans(), label="deterministic"))
    backend = "numpy" if device == "cpu" else "cuda"
    _assert_all(_backward_checks(problem, x, backend, *res), problem, f"torch op on {device}")


_COMPILE_PROBLEMS = (
    AttentionProblem(B=2, H=3, Nq=97, Nk=113, D=24, causal="bottom_right", seed=3),
    AttentionProblem(B=1, H=2, Nq=65, Nk=65, D=64, dtype="bfloat16", window=(17, 3), key_lengths=(40,),
                     mask_kind="bool", mask_shape="1HNqNk", layout="bnhd", seed=4),
    AttentionProblem(B=2, H=1, Nq=17, Nk=129, D=32, dtype="float16", mask_kind="float", mask_shape="NqNk",
                     seed=5),
)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("problem", _COMPILE_PROBLEMS, ids=lambda p: f"{p.dtype}-{p.Nq}x{p.Nk}")
def test_compiled_matches_eager(device: str, problem: AttentionProblem) -> None:
    """``torch.compile(fullgraph=True)`` (no graph break) gives eager's bits, forward and gradients."""
    _need(device)
    import torch._dynamo

    torch._dynamo.reset()
    x = make_inputs(problem)
    eager = _run_op(problem, x, device, deterministic=True)
    backend = "aot_eager" if device == "cpu" else "inductor"
    compiled = torch.compile(flash_attention, fullgraph=True, backend=backend)
    again = _run_op(problem, x, device, fn=compiled, deterministic=True)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), eager, again):
        assert torch.equal(a, b), f"compiled {name} differs from eager"


def test_custom_operators_pass_opcheck() -> None:
    """Schemas, fake implementations and the registered autograd of both operators."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 17, 8, generator=g, requires_grad=True) for _ in range(3))
    scale = 8 ** -0.5
    torch.library.opcheck(torch.ops.pycudaflash.flash_fwd.default,
                          (q, k, v, None, None, "top_left", -1, -1, scale, False))
    out, lse = torch.ops.pycudaflash.flash_fwd(q, k, v, None, None, "top_left", -1, -1, scale, False)
    dout = torch.randn(out.shape, generator=g)
    torch.library.opcheck(torch.ops.pycudaflash.flash_bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, None, None, "top_left",
                           -1, -1, scale, False))


def test_custom_operator_path_matches_autograd_function() -> None:
    """The operators (used under torch.compile) and the eager path give the same bits."""
    p = AttentionProblem(B=2, H=2, Nq=33, Nk=47, D=16, causal=True, seed=9)
    x = make_inputs(p)

    def via_ops(q: Any, k: Any, v: Any, **kw: Any) -> Any:
        kl = kw.get("key_lengths")
        out, lse = torch.ops.pycudaflash.flash_fwd(q, k, v, None, kl, "top_left", -1, -1, p.D ** -0.5,
                                                   kw["deterministic"])
        return out, lse

    a = _run_op(p, x, "cpu")
    b = _run_op(p, x, "cpu", fn=via_ops)
    for name, u, w in zip(("out", "lse", "dq", "dk", "dv"), a, b):
        assert torch.equal(u, w), f"{name} differs between the operator and the eager path"


def test_op_rejects_bad_arguments() -> None:
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        flash_attention(q.numpy(), q, q)
    with pytest.raises(ValueError, match="4 dimensions"):
        flash_attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="causal must be"):
        flash_attention(q, q, q, causal="diagonal")
    with pytest.raises(TypeError, match="key_lengths must have an integer dtype"):
        flash_attention(q, q, q, key_lengths=torch.tensor([1.5]))
    with pytest.raises(ValueError, match=r"key_lengths values must lie in \[0, Nk\]"):
        flash_attention(q, q, q, key_lengths=[9])
    with pytest.raises(TypeError, match="dtype"):
        flash_attention(q.double(), q.double(), q.double())


def test_op_copies_a_strided_last_dimension() -> None:
    p = AttentionProblem(B=1, H=2, Nq=9, Nk=9, D=8, seed=12)
    x = make_inputs(p)
    q, k, v = (torch.from_numpy(np.ascontiguousarray(x[n])) for n in ("q", "k", "v"))
    wide = torch.stack([q, torch.full_like(q, float("nan"))], dim=-1).reshape(1, 2, 9, 16)[..., ::2]
    assert wide.stride(-1) == 2 and torch.equal(wide, q)
    assert torch.equal(flash_attention(wide, k, v), flash_attention(q, k, v))


# --------------------------------------------------------------------------
# torch CPU tensors through the plain API
# --------------------------------------------------------------------------


def test_plain_api_returns_torch_tensors_for_torch_cpu_inputs() -> None:
    p = AttentionProblem(B=2, H=2, Nq=21, Nk=30, D=16, dtype="bfloat16", causal="bottom_right", seed=13)
    x = make_inputs(p)
    q, k, v, dout = (_tensor(x[n], "cpu") for n in ("q", "k", "v", "dout"))
    out, lse = flash_attn_forward(q, k, v, causal="bottom_right")
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == q.shape
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    ref_out, ref_lse = flash_attn_forward(x["q"], x["k"], x["v"], causal="bottom_right", backend="numpy")
    assert np.array_equal(out.float().numpy(), ref_out.astype(np.float32))
    assert np.array_equal(lse.numpy(), ref_lse)
    grads = flash_attn_backward(dout, q, k, v, out, lse, causal="bottom_right")
    assert all(isinstance(g, torch.Tensor) and g.dtype == torch.bfloat16 for g in grads)
    # Buffers given as tensors are filled in place and returned as given.
    buf_out, buf_lse = torch.full_like(q, float("nan")), torch.full((2, 2, 21), float("nan"))
    ret = flash_attn_forward(q, k, v, causal="bottom_right", out=buf_out, lse=buf_lse)
    assert ret[0] is buf_out and ret[1] is buf_lse and torch.equal(buf_out, out)


def test_plain_api_rejects_mixed_torch_and_numpy() -> None:
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(TypeError, match="k must be a torch CPU tensor like q"):
        flash_attn_forward(q, q.numpy(), q)


# --------------------------------------------------------------------------
# output buffers that overlap other arrays
# --------------------------------------------------------------------------

B, H, N, D = 2, 3, 16, 8


def _host(*shape: int) -> np.ndarray:
    return np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)


def _forward_aliasing_cases() -> Dict[str, Tuple[Dict[str, Any], str]]:
    q, k, v = (_host(B, H, N, D) for _ in range(3))
    lse = np.empty((B, H, N), np.float32)
    packed = _host(B, N, 3, H, D)  # q, k, v slices of one tensor, (B, N, 3, H, D)
    pq, pk, pv = (packed[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    lse_in_q = q.reshape(-1)[: B * H * N].reshape(B, H, N)
    shared = _host(B * H * N * D + D // 2).reshape(-1)  # v, and out starting half a row later
    shifted_v = shared[: B * H * N * D].reshape(B, H, N, D)
    shifted_out = shared[D // 2:].reshape(B, H, N, D)
    return {
        "out=v": (dict(q=q, k=k, v=v, out=v, lse=lse), "output buffer out overlaps v"),
        "out=q": (dict(q=q, k=k, v=v, out=q, lse=lse), "output buffer out overlaps q"),
        "lse inside q": (dict(q=q, k=k, v=v, lse=lse_in_q), "output buffer lse overlaps q"),
        "out into the packed k slot": (dict(q=pq, k=pk, v=pv, out=pk, lse=lse), "output buffer out overlaps k"),
        "out half a row past v": (dict(q=q, k=k, v=shifted_v, out=shifted_out, lse=lse),
                                  "output buffer out overlaps v"),
    }


@pytest.mark.parametrize("case", list(_forward_aliasing_cases()))
def test_forward_output_overlapping_an_input_is_rejected(case: str) -> None:
    kw, message = _forward_aliasing_cases()[case]
    before = {n: a.copy() for n, a in kw.items()}
    with pytest.raises(ValueError, match=message):
        flash_attn_forward(backend="numpy", **kw)
    for n, a in kw.items():
        assert np.array_equal(a, before[n], equal_nan=True), f"{n} was written before the error"


def test_disjoint_slices_of_one_buffer_are_accepted() -> None:
    """Interleaved but disjoint: q, k, v and out as four slots of one packed tensor."""
    packed = _host(B, N, 4, H, D)
    q, k, v, out = (packed[:, :, i].transpose(0, 2, 1, 3) for i in range(4))
    expect, _ = flash_attn_forward(q.copy(), k.copy(), v.copy(), backend="numpy")
    ret, _ = flash_attn_forward(q, k, v, out=out, backend="numpy")
    assert ret is out and np.array_equal(out, expect)


def _backward_aliasing_cases() -> Dict[str, Tuple[Dict[str, Any], str]]:
    q, k, v, dout = (_host(B, H, N, D) for _ in range(4))
    out, lse = flash_attn_forward(q, k, v, backend="numpy")
    base = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    dq, dk, dv = (np.empty_like(q) for _ in range(3))
    return {
        "dk=q": (dict(base, dq=dq, dk=q, dv=dv), "output buffer dk overlaps q"),
        "dq and dk the same array": (dict(base, dq=dq, dk=dq, dv=dv), "output buffer dk overlaps dq"),
        "dv=dout": (dict(base, dq=dq, dk=dk, dv=dout), "output buffer dv overlaps dout"),
        "dq=out": (dict(base, dq=out, dk=dk, dv=dv), "output buffer dq overlaps out"),
    }


@pytest.mark.parametrize("case", list(_backward_aliasing_cases()))
def test_backward_output_overlapping_another_array_is_rejected(case: str) -> None:
    kw, message = _backward_aliasing_cases()[case]
    with pytest.raises(ValueError, match=message):
        flash_attn_backward(backend="numpy", **kw)


def test_device_output_overlap_is_rejected_before_any_launch() -> None:
    """Device arrays are checked by address: an interleaved disjoint layout passes
    validation, an overlapping one raises (no GPU is touched by either)."""
    from pycudaflash._validate import validate_forward
    from test_validation import FakeDeviceArray

    q, k, v = (FakeDeviceArray((B, H, N, D)) for _ in range(3))
    lse = FakeDeviceArray((B, H, N))
    alias = FakeDeviceArray((B, H, N, D))
    alias.__cuda_array_interface__ = dict(v.__cuda_array_interface__)
    with pytest.raises(ValueError, match="output buffer out overlaps v"):
        validate_forward(q, k, v, out=alias, lse=lse)
    # (B, N, 4, H, D) storage: q, k, v, out as its four slots.
    st = (N * 4 * H * D, D, 4 * H * D, 1)
    base = FakeDeviceArray((B, N, 4, H, D)).ptr
    slots = [FakeDeviceArray((B, H, N, D), strides=st) for _ in range(4)]
    for i, s in enumerate(slots):
        s.__cuda_array_interface__["data"] = (base + 4 * i * H * D, False)
    validate_forward(*slots[:3], out=slots[3], lse=lse)
    with pytest.raises(ValueError, match="output buffer out overlaps k"):
        validate_forward(*slots[:3], out=slots[1], lse=lse)


# --------------------------------------------------------------------------
# GPU only
# --------------------------------------------------------------------------

_GPU_PROBLEM = AttentionProblem(B=2, H=4, Nq=300, Nk=300, D=64, dtype="bfloat16", causal=True, seed=21)


def _gpu_inputs(problem: AttentionProblem = _GPU_PROBLEM) -> Tuple[Any, ...]:
    x = make_inputs(problem)
    q, k, v = (_tensor(x[n], "cuda", True) for n in ("q", "k", "v"))
    return q, k, v, _tensor(x["dout"], "cuda")


def _fwd_bwd(q: Any, k: Any, v: Any, dout: Any) -> Tuple[Any, ...]:
    out = flash_attention(q, k, v, causal=True, deterministic=True)
    return (out,) + torch.autograd.grad(out, (q, k, v), dout)


_HOST_PATH_PROBLEMS = (
    AttentionProblem(B=2, H=3, Nq=97, Nk=257, D=64, dtype="bfloat16", causal="bottom_right", seed=31),
    AttentionProblem(B=1, H=4, Nq=130, Nk=77, D=128, dtype="float16", Hkv=2, window=(33, 0), seed=32),
    AttentionProblem(B=2, H=2, Nq=65, Nk=113, D=64, dtype="bfloat16", key_lengths=(50, 113), mask_kind="bool",
                     mask_shape="1HNqNk", layout="bnhd", seed=33),
    AttentionProblem(B=1, H=2, Nq=17, Nk=200, D=32, dtype="float32", mask_kind="float", mask_shape="NqNk",
                     seed=34),
    AttentionProblem(B=1, H=2, Nq=129, Nk=129, D=256, dtype="bfloat16", causal=True, seed=35),
)


def _python_path(q: Any, k: Any, v: Any, *, causal: Any = False, window: Any = None, mask: Any = None,
                 key_lengths: Any = None, scale: Any = None, deterministic: bool = False,
                 return_lse: bool = True) -> Tuple[Any, Any]:
    """The operator's eager Python implementation (the autograd function of pycudaflash.torch)."""
    from pycudaflash import torch as pt

    opts = pt._options(q, causal, window, scale)
    kl = None if key_lengths is None else pt._key_lengths_tensor(key_lengths)
    return pt._Attention.apply(q, k, v, mask, kl, opts, deterministic, True)


@pytest.mark.gpu
@pytest.mark.parametrize("problem", _HOST_PATH_PROBLEMS, ids=lambda p: f"{p.dtype}-D{p.D}-{p.Nq}x{p.Nk}")
def test_cpp_host_path_gives_the_python_paths_bits(problem: AttentionProblem) -> None:
    """With a C++ compiler the C++ host path loads and serves CUDA calls (forward, autograd,
    backward) with the bits of the Python path, in every kind of call; key lengths given on the
    host go through its hand-over to the Python kernels."""
    _need("cuda")
    from pycudaflash import _fastpath

    assert _fastpath.loaded(), _fastpath.reason
    x = make_inputs(problem)
    for deterministic in (True, False):
        ours = _run_op(problem, x, "cuda", deterministic=deterministic)
        python = _run_op(problem, x, "cuda", fn=_python_path, deterministic=deterministic)
        names = ("out", "lse", "dq", "dk", "dv") if deterministic else ("out", "lse")
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), ours, python):
            if name in names:
                assert torch.equal(a, b), f"{name}: the C++ host path differs from the Python path"
    if problem.key_lengths is not None:
        host = dict(attention_kwargs(problem, x), key_lengths=list(problem.key_lengths))
        host["mask"] = _op_kwargs(problem, x, "cuda")["mask"]
        q, k, v = (_tensor(x[n], "cuda") for n in ("q", "k", "v"))
        out, lse = flash_attention(q, k, v, **host, return_lse=True)
        assert torch.equal(out, ours[0]) and torch.equal(lse, ours[1])


@pytest.mark.gpu
def test_cuda_op_rejects_bad_shapes_with_value_error() -> None:
    """On CUDA (the C++ host path where it loads) a q, k or v without four dimensions is a
    ValueError before any launch, also once the call's options are remembered."""
    _need("cuda")
    q = torch.randn(1, 2, 8, 64, device="cuda")
    flash_attention(q, q, q)  # (remembers these options)
    with pytest.raises(ValueError, match="4 dimensions"):
        flash_attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="4 dimensions"):
        torch.ops.pycudaflash.flash_fwd(q[0], q[0], q[0], None, None, "none", -1, -1, 0.125, False)
    out, lse = torch.ops.pycudaflash.flash_fwd(q, q, q, None, None, "none", -1, -1, 0.125, False)
    with pytest.raises(ValueError, match="4 dimensions"):
        torch.ops.pycudaflash.flash_bwd(out, q, q[0], q, out, lse, None, None, "none", -1, -1, 0.125, False)


@pytest.mark.gpu
def test_op_on_a_side_stream_gives_the_default_streams_bits() -> None:
    _need("cuda")
    q, k, v, dout = _gpu_inputs()
    ref = [t.clone() for t in _fwd_bwd(q, k, v, dout)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        got = _fwd_bwd(*leaves, dout)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for name, a, b in zip(("out", "dq", "dk", "dv"), ref, got):
        assert torch.equal(a, b), f"{name} on a side stream differs from the default stream's"


@pytest.mark.gpu
def test_forward_without_lse_gives_the_same_bits() -> None:
    """An inference call (no gradient, no lse asked) stores no lse; its out must not change."""
    _need("cuda")
    q, k, v, _ = _gpu_inputs()
    with torch.no_grad():
        ref, lse = flash_attention(q, k, v, causal=True, return_lse=True)
        torch.cuda.synchronize()
        # Fill the allocator's freed blocks with NaN so that unwritten output elements would show.
        junk = torch.full_like(ref, float("nan"))
        del junk
        got = flash_attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    assert torch.isfinite(lse).all()
    assert torch.equal(ref, got)


@pytest.mark.gpu
def test_cuda_graph_of_forward_and_backward_replays_bit_identically() -> None:
    _need("cuda")
    q, k, v, dout = _gpu_inputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch asks
        for _ in range(2):
            eager = [t.clone() for t in _fwd_bwd(q, k, v, dout)]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _fwd_bwd(q, k, v, dout)
    for _ in range(3):
        for t in captured:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for name, a, b in zip(("out", "dq", "dk", "dv"), eager, captured):
            assert torch.equal(a, b), f"graph replay's {name} differs from the eager run"
    # New inputs copied into the captured ones give their own results.
    q2, k2, v2, dout2 = _gpu_inputs(AttentionProblem(**{**_GPU_PROBLEM.__dict__, "seed": 22}))
    with torch.no_grad():
        for dst, src in ((q, q2), (k, k2), (v, v2), (dout, dout2)):
            dst.copy_(src)
    graph.replay()
    expect = _fwd_bwd(q, k, v, dout)
    torch.cuda.synchronize()
    for name, a, b in zip(("out", "dq", "dk", "dv"), expect, captured):
        assert torch.equal(a, b), f"graph replay on new inputs: {name} differs"


@pytest.mark.gpu
def test_plain_api_returns_the_inputs_kind_on_the_gpu() -> None:
    _need("cuda")
    q, k, v, dout = (t.detach() for t in _gpu_inputs())
    out, lse = flash_attn_forward(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor) and out.is_cuda and out.dtype == torch.bfloat16
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    ref, ref_lse = flash_attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    dq, dk, dv = flash_attn_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    assert all(isinstance(g, torch.Tensor) and g.is_cuda for g in (dq, dk, dv))
    cupy = pytest.importorskip("cupy", reason="cupy is not installed")
    x = make_inputs(AttentionProblem(B=1, H=2, Nq=70, Nk=70, D=64, dtype="float16", seed=23))
    cq, ck, cv = (cupy.asarray(x[n]) for n in ("q", "k", "v"))
    cout, clse = flash_attn_forward(cq, ck, cv)
    assert isinstance(cout, cupy.ndarray) and isinstance(clse, cupy.ndarray)
    hout, _ = flash_attn_forward(x["q"], x["k"], x["v"])
    assert np.array_equal(cupy.asnumpy(cout), hout)


@pytest.mark.gpu
def test_plain_api_overlap_is_checked_on_repeated_calls() -> None:
    """The fast path of a repeated signature still refuses an overlapping buffer."""
    _need("cuda")
    q, k, v, _ = (t.detach() for t in _gpu_inputs())
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")
    for _ in range(3):
        flash_attn_forward(q, k, v, causal=True, out=out, lse=lse)
    v_like = v.clone()
    with pytest.raises(ValueError, match="output buffer out overlaps v"):
        flash_attn_forward(q, k, v_like, causal=True, out=v_like, lse=lse)


_THREAD_SCRIPT = textwrap.dedent("""
    import threading, torch
    from pycudaflash import flash_attn_forward
    from pycudaflash.torch import flash_attention
    from cuda.bindings import driver
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = flash_attention(q, k, v, causal=True)
    out.float().square().sum().backward()          # backward on torch's autograd thread
    torch.cuda.synchronize()
    found = []
    def worker():                                   # a thread with no CUDA context of its own
        try:
            a = q.detach()
            flash_attn_forward(a, a, a)
            flash_attention(a, a, a)
            torch.cuda.synchronize()
            depth = 0                               # contexts stacked on this thread now
            while int(driver.cuCtxGetCurrent()[1]) != 0:
                driver.cuCtxPopCurrent()
                depth += 1
            found.append(depth)
        except Exception as exc:
            found.append(repr(exc))
    t = threading.Thread(target=worker); t.start(); t.join()
    lin = torch.nn.Linear(64, 64).cuda()
    lin(torch.randn(8, 64, device="cuda")).sum().backward()   # cuBLAS after our calls
    print("grads", all(x.grad is not None and torch.isfinite(x.grad).all().item() for x in (q, k, v)))
    print("worker", found)
""")


@pytest.mark.gpu
def test_script_with_autograd_and_threads_exits_cleanly(tmp_path: Any) -> None:
    """Backward on autograd's thread, a call from a fresh thread, then cuBLAS: exit
    status 0, no context left pushed, no warning from torch or PyCUDA."""
    _need("cuda")
    script = tmp_path / "thread_script.py"
    script.write_text(_THREAD_SCRIPT)
    env = dict(os.environ, PYTHONWARNINGS="default")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "grads True" in proc.stdout, proc.stdout + proc.stderr
    # torch's runtime binds the primary context to a thread it runs on (depth 1);
    # a context this library pushed and left would stack on it.
    worker = proc.stdout.split("worker", 1)[1].strip()
    assert worker in ("[0]", "[1]"), f"the worker thread was left with contexts stacked: {worker}"
    for text in ("context", "Context", "PyCUDA ERROR", "Warning"):
        assert text not in proc.stderr, proc.stderr


def test_output_overlapping_a_modifier_tensor_is_rejected() -> None:
    """Modifier tensors are inputs: an output buffer that shares their memory raises, host
    (numpy backend) and device (by address, before any launch)."""
    from pycudaflash._validate import validate_backward, validate_forward
    from test_validation import FakeDeviceArray

    q, k, v = (_host(B, H, N, D) for _ in range(3))
    out = np.empty_like(q)
    bias = out.reshape(-1)[:N]  # the first row of out, read by the modifier
    with pytest.raises(ValueError, match=r"output buffer out overlaps mod_tensors\['bias'\]"):
        flash_attn_forward(q, k, v, out=out, score_mod="score + bias[j]", mod_tensors=dict(bias=bias),
                           backend="numpy")
    fq, fk, fv, fdo, fo = (FakeDeviceArray((B, H, N, D)) for _ in range(5))
    lse = FakeDeviceArray((B, H, N))
    inside = FakeDeviceArray((N,), np.float32)
    inside.__cuda_array_interface__["data"] = (fo.ptr + 4 * D, False)  # row 0 of out, from column D
    with pytest.raises(ValueError, match=r"output buffer out overlaps mod_tensors\['bias'\]"):
        validate_forward(fq, fk, fv, out=fo, lse=lse, score_mod="score + bias[j]", mod_tensors=dict(bias=inside))
    dk = FakeDeviceArray((B, H, N, D))
    inside.__cuda_array_interface__["data"] = (dk.ptr, False)
    with pytest.raises(ValueError, match=r"output buffer dk overlaps mod_tensors\['bias'\]"):
        validate_backward(fdo, fq, fk, fv, fo, lse, dk=dk, score_mod="score + bias[j]",
                          mod_tensors=dict(bias=inside))
    apart = FakeDeviceArray((N,), np.float32)
    validate_forward(fq, fk, fv, out=fo, lse=lse, score_mod="score + bias[j]", mod_tensors=dict(bias=apart))


def test_a_modifier_tensor_past_32_bit_offsets_is_rejected() -> None:
    """The kernels address modifier tensors with 32-bit element offsets: a device tensor spanning
    2**31 elements or more raises before any launch; one just below passes."""
    from pycudaflash._validate import MOD_SPAN_MAX, validate_forward
    from test_validation import FakeDeviceArray

    q, k, v = (FakeDeviceArray((B, H, N, D)) for _ in range(3))
    for span, ok in ((MOD_SPAN_MAX, True), (MOD_SPAN_MAX + 1, False)):
        # two elements, the second span - 1 elements after the first (a strided view)
        table = FakeDeviceArray((2,), np.int32, strides=(span - 1,))
        call = lambda: validate_forward(q, k, v, mask_mod="table[i % 2] >= 0", mod_tensors=dict(table=table))
        if ok:
            call()
        else:
            with pytest.raises(ValueError, match=f"spans {span} elements"):
                call()
    # A host tensor is copied contiguous, so it spans all its elements whatever its strides:
    # refused before that copy (a broadcast view of one element here, which the copy would make 2 GB).
    shape = (2 ** 16, 2 ** 15 + 1)
    keep = np.broadcast_to(np.ones((1, 1), bool), shape)
    with pytest.raises(ValueError, match=f"spans {shape[0] * shape[1]} elements"):
        validate_forward(q, k, v, mask_mod="keep[i % 2, j % 2]", mod_tensors=dict(keep=keep))
