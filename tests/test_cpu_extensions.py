"""The NumPy backend with score and mask modifiers and with grouped-query attention, against
the float64 reference, directly and through the public calls (the kernels: test_mods_gpu.py,
test_mod_properties.py and the property suite's K/V groupings)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pycudaflash import cpu, flash_attn_backward, flash_attn_forward
from pycudaflash.mods import mask_mod, score_mod
from pycudaflash.reference import reference_backward, reference_forward
from pycudaflash.testing import relative_error

B, H, NQ, NK, D = 2, 4, 97, 113, 32
RNG = np.random.default_rng(41)
SLOPE = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
DOC = np.sort(RNG.integers(0, 4, size=(B, 128)), axis=1).astype(np.int32)
PREFIX = np.array([10, 40])
TENSORS = dict(slope=SLOPE, doc=DOC, prefix=PREFIX)

CASES = {
    "softcap_causal": (dict(causal="top_left"), "10 * tanh(score / 10)", None, H),
    "alibi_key_lengths": (dict(key_lengths=np.array([100, 60])), "score - slope[h] * abs(i - j)", None, H),
    "mixed_window": (dict(window=(30, 5)), "where(score > 0, score * 1.5, exp(score) - 1)", None, H),
    "document": ({}, None, "doc[b, i] == doc[b, j]", H),
    "prefix_lm_and_softcap": ({}, "20 * tanh(score / 20)", "(j <= i) | (j < prefix[b])", H),
    "gqa_2_causal": (dict(causal="bottom_right"), None, None, 2),
    "mqa_alibi": ({}, "score - slope[h] * abs(i - j)", None, 1),
    "gqa_2_document": ({}, None, "doc[b, i] == doc[b, j]", 2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_numpy_backend_matches_the_reference(name: str) -> None:
    opts, smod_src, mmod_src, hkv = CASES[name]
    q, dout = (RNG.standard_normal((B, H, NQ, D)).astype(np.float32) for _ in range(2))
    k, v = (RNG.standard_normal((B, hkv, NK, D)).astype(np.float32) for _ in range(2))
    used = {n: t for n, t in TENSORS.items() if any(src and n + "[" in src for src in (smod_src, mmod_src))}
    smod = score_mod(smod_src, used) if smod_src else None
    mmod = mask_mod(mmod_src, used) if mmod_src else None
    causal = opts.get("causal", "none")
    left, right = opts.get("window", (-1, -1))
    kl = opts.get("key_lengths")
    common = dict(scale=D ** -0.5, causal=causal, window_left=left, window_right=right, mask=None,
                  key_lengths=kl, score_mod=smod, mask_mod=mmod, mod_tensors=used)
    out, lse = np.full((B, H, NQ, D), np.nan, np.float32), np.full((B, H, NQ), np.nan, np.float32)
    cpu.forward(q, k, v, out=out, lse=lse, **common)
    dq = np.full((B, H, NQ, D), np.nan, np.float32)
    dk, dv = (np.full((B, hkv, NK, D), np.nan, np.float32) for _ in range(2))
    cpu.backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **common)
    ref_kw = dict(causal=False if causal == "none" else causal, window=opts.get("window"), key_lengths=kl,
                  score_mod=smod, mask_mod=mmod, mod_tensors=used)
    r_out, r_lse = reference_forward(q, k, v, **ref_kw)
    r_dq, r_dk, r_dv = reference_backward(dout, q, k, v, **ref_kw)
    # float32 tiles against float64: at most 3.0e-7 measured over these cases; the bound is 2x that.
    for got, want, what in ((out, r_out, "out"), (dq, r_dq, "dq"), (dk, r_dk, "dk"), (dv, r_dv, "dv")):
        assert got.shape == want.shape, what
        assert relative_error(got, want) < 6e-7, (what, relative_error(got, want))
    finite = np.isfinite(r_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], r_lse[finite], rtol=0, atol=2e-5)


# ------------------------------------------------------------- the public calls

def _inputs(hkv: int = H, seed: int = 3):
    g = np.random.default_rng(seed)
    q, dout = (g.standard_normal((B, H, NQ, D)).astype(np.float32) for _ in range(2))
    k, v = (g.standard_normal((B, hkv, NK, D)).astype(np.float32) for _ in range(2))
    return q, k, v, dout


def test_public_calls_take_modifiers_and_grouped_heads() -> None:
    q, k, v, dout = _inputs(hkv=2)
    kw = dict(causal=True, score_mod="score - slope[h] * abs(i - j)", mask_mod="doc[b, i] == doc[b, j]",
              mod_tensors=dict(slope=SLOPE, doc=DOC), backend="numpy")
    out, lse = flash_attn_forward(q, k, v, **kw)
    dq, dk, dv = flash_attn_backward(dout, q, k, v, out, lse, **kw)
    assert dk.shape == k.shape and dv.shape == v.shape
    ref = dict(causal=True, score_mod=kw["score_mod"], mask_mod=kw["mask_mod"], mod_tensors=kw["mod_tensors"])
    r_out, _ = reference_forward(q, k, v, **ref)
    r_grads = reference_backward(dout, q, k, v, **ref)
    assert relative_error(out, r_out) < 6e-7
    for got, want in zip((dq, dk, dv), r_grads):
        assert relative_error(got, want) < 6e-7


def test_torch_cpu_tensors_with_modifiers_come_back_as_torch() -> None:
    torch = pytest.importorskip("torch")
    q, k, v, _ = _inputs()
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    out, lse = flash_attn_forward(tq, tk, tv, score_mod="30 * tanh(score / 30)")
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    r_out, _ = reference_forward(q, k, v, score_mod="30 * tanh(score / 30)")
    assert relative_error(out.numpy(), r_out) < 6e-7


def test_modifiers_run_where_cuda_is_usable(monkeypatch) -> None:
    """Where CUDA is usable, a host call with modifiers goes to the CUDA kernels like any other."""
    import pycudaflash._backends as backends
    from pycudaflash._validate import validate_forward

    monkeypatch.setattr(backends, "cuda_status", lambda: (True, "usable"))
    q, k, v, _ = _inputs()
    prob = validate_forward(q, k, v, score_mod="score - slope[h]", mod_tensors=dict(slope=SLOPE))
    assert backends.choose_backend(prob, None, None) == "cuda"
    assert backends.choose_backend(prob, "numpy", None) == "numpy"


def test_mod_tensors_the_kernels_cannot_read_are_refused() -> None:
    from pycudaflash._validate import kernel_array

    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="empty dimension"):
        flash_attn_forward(q, k, v, score_mod="score - t[h]", mod_tensors=dict(t=np.zeros(0, np.float32)),
                           backend="numpy")
    with pytest.raises(ValueError, match="do not fit"):
        kernel_array("t", np.array([2**40]))
    assert kernel_array("t", np.array([1, 2], np.int64)).dtype == np.int32
    assert kernel_array("t", np.array([0.5])).dtype == np.float32
    made = score_mod("score - t[h]", dict(t=np.zeros(3, np.float32)))
    with pytest.raises(ValueError, match="was made for mod_tensors\\['t'\\]"):
        flash_attn_forward(q, k, v, score_mod=made, mod_tensors=dict(t=np.zeros(3, np.int32)), backend="numpy")


def test_modifier_arguments_are_checked() -> None:
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="mod_tensors given without a score_mod or mask_mod"):
        flash_attn_forward(q, k, v, mod_tensors=dict(slope=SLOPE), backend="numpy")
    with pytest.raises(TypeError, match="score_mod must be a string expression or a Modifier"):
        flash_attn_forward(q, k, v, score_mod=lambda s: s, backend="numpy")
    with pytest.raises(ValueError, match="a mask_mod was given as score_mod"):
        flash_attn_forward(q, k, v, score_mod=mask_mod("i >= j"), backend="numpy")
    with pytest.raises(ValueError, match="reads mod_tensors \\['slope'\\], which were not given"):
        flash_attn_forward(q, k, v, score_mod=score_mod("score * slope[h]", dict(slope=SLOPE)), backend="numpy")
    with pytest.raises(ValueError, match="unknown tensor 'slope'"):
        flash_attn_forward(q, k, v, score_mod="score * slope[h]", backend="numpy")
    with pytest.raises(TypeError, match="mod_tensors must be a mapping"):
        flash_attn_forward(q, k, v, score_mod="score", mod_tensors=[SLOPE], backend="numpy")


def test_torch_op_with_modifiers_and_grouped_heads_on_the_cpu() -> None:
    torch = pytest.importorskip("torch")
    from pycudaflash.torch import flash_attention

    q, k, v, dout = _inputs(hkv=2, seed=9)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    kw = dict(score_mod="10 * tanh(score / 10)", mask_mod="(j <= i) | (j < prefix[b])",
              mod_tensors=dict(prefix=torch.from_numpy(PREFIX)))
    out = flash_attention(tq, tk, tv, **kw)
    out.backward(torch.from_numpy(dout))
    assert tk.grad.shape == tk.shape
    ref = dict(score_mod=kw["score_mod"], mask_mod=kw["mask_mod"], mod_tensors=dict(prefix=PREFIX))
    r_out, _ = reference_forward(q, k, v, **ref)
    for got, want in zip((out.detach(), tq.grad, tk.grad, tv.grad), (r_out, *reference_backward(dout, q, k, v, **ref))):
        assert relative_error(got.numpy(), want) < 6e-7
    with torch.no_grad():
        again, lse = flash_attention(tq, tk, tv, return_lse=True, **kw)
    assert torch.equal(again, out.detach()) and lse.shape == (B, H, NQ)


def test_torch_op_with_grouped_heads_compiles_without_a_graph_break() -> None:
    torch = pytest.importorskip("torch")
    from pycudaflash.torch import flash_attention

    q, k, v, dout = (torch.from_numpy(x).requires_grad_() for x in _inputs(hkv=2, seed=17))

    def f(q: Any, k: Any, v: Any) -> Any:
        return flash_attention(q, k, v, causal=True)

    eager = f(q, k, v)
    g_eager = torch.autograd.grad(eager, (q, k, v), dout)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    g_compiled = torch.autograd.grad(compiled, (q, k, v), dout)
    assert torch.equal(eager, compiled)
    for a, b in zip(g_eager, g_compiled):
        assert torch.equal(a, b)
    assert g_compiled[1].shape == k.shape
