"""Score and mask modifiers (pycudaflash.mods): the language, its numpy meaning, the derivative
of a score modifier and its CUDA translation."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pycudaflash.mods import CUDA_PRELUDE, mask_mod, score_mod

B, H, NQ, NK = 2, 3, 7, 11
RNG = np.random.default_rng(5)
SCORE = RNG.standard_normal((B, H, NQ, NK)) * 4
POS = dict(b=np.arange(B)[:, None, None, None], h=np.arange(H)[None, :, None, None],
           i=np.arange(NQ)[None, None, :, None], j=np.arange(NK)[None, None, None, :])
b_, h_, i_, j_ = (POS[n] for n in "bhij")
SLOPE = np.array([0.5, 0.25, 0.125], np.float32)
TABLE = RNG.standard_normal((H, 9)).astype(np.float32)
DOC = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2, 2, 3, 3]], np.int32)
PREFIX = np.array([2, 5], np.int64)
TENSORS = dict(slope=SLOPE, table=TABLE, doc=DOC, prefix=PREFIX)

SCORE_MODS = {
    "alibi": ("score - slope[h] * abs(i - j)", SCORE - SLOPE[h_] * np.abs(i_ - j_)),
    "softcap": ("30 * tanh(score / 30)", 30 * np.tanh(SCORE / 30)),
    # relative position bias from a table, positions clamped into its 9 entries
    "relative": ("score + table[h, j - i + 4]", SCORE + TABLE[h_, np.clip(j_ - i_ + 4, 0, 8)]),
    "mixed": ("where(score > 0, exp(-score) * 2, log(1 + score * score)) + min(score, 1.5) / max(h, 1)",
              np.where(SCORE > 0, np.exp(-SCORE) * 2, np.log(1 + SCORE * SCORE))
              + np.minimum(SCORE, 1.5) / np.maximum(h_, 1)),
}
MASK_MODS = {
    "document": ("doc[b, i] == doc[b, j]", DOC[b_, np.minimum(i_, NK - 1)] == DOC[b_, j_]),
    "prefix_lm": ("(j <= i) | (j < prefix[b])", (j_ <= i_) | (j_ < PREFIX[b_])),
    "window": ("(0 <= i - j) & (i - j < 3) & ~(j == 5)", (i_ - j_ >= 0) & (i_ - j_ < 3) & (j_ != 5)),
    "chain": ("1 < j < i + 2", (1 < j_) & (j_ < i_ + 2)),
}


def _tensors_used(src: str) -> dict:
    return {k: v for k, v in TENSORS.items() if k + "[" in src}


@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_score_mods_mean_what_numpy_says(name: str) -> None:
    src, want = SCORE_MODS[name]
    m = score_mod(src, _tensors_used(src))
    got = m.evaluate(SCORE, tensors=_tensors_used(src), **POS)
    np.testing.assert_allclose(np.broadcast_to(got, want.shape), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(MASK_MODS))
def test_mask_mods_mean_what_numpy_says(name: str) -> None:
    src, want = MASK_MODS[name]
    got = mask_mod(src, _tensors_used(src)).evaluate(tensors=_tensors_used(src), **POS)
    assert got.dtype == np.bool_
    assert np.array_equal(np.broadcast_to(got, np.broadcast(want, SCORE).shape),
                          np.broadcast_to(want, np.broadcast(want, SCORE).shape))


def test_integer_division_rounds_down_and_a_zero_divisor_gives_zero() -> None:
    m = score_mod("(i - j) // 3 + 10 * ((i - j) % 3) + 100 * (i // (j - j))")
    got = m.evaluate(0.0, **POS)
    d = i_ - j_
    np.testing.assert_array_equal(np.broadcast_to(got, (1, 1, NQ, NK)), (d // 3 + 10 * (d % 3)).astype(float))


def test_indices_are_clamped_into_the_tensor() -> None:
    m = score_mod("slope[i - 100] + 10 * slope[i + 100]", {"slope": SLOPE})
    np.testing.assert_array_equal(m.evaluate(0.0, i=np.arange(3), tensors={"slope": SLOPE}),
                                  np.full(3, SLOPE[0] + 10 * SLOPE[-1], np.float64))


DERIVATIVE_CASES = [
    "score", "-score * 2 + 1", "30 * tanh(score / 30)", "exp(score / 4) - score * score",
    "log(1 + score * score)", "score / (1 + abs(score))", "where(score > 0.3, score * score, -score)",
    "min(score, 0.7) + max(score * 2, -1)", "abs(score - 0.25) * slope[h]", "score / slope[h] + i - j",
    "where(i > j, exp(score), score)",
]


@pytest.mark.parametrize("src", DERIVATIVE_CASES)
def test_derivative_matches_central_differences(src: str) -> None:
    m = score_mod(src, _tensors_used(src))
    d = m.derivative()
    x = SCORE / 4
    step = 1e-6
    kw = dict(tensors=_tensors_used(src), **POS)
    numeric = (m.evaluate(x + step, **kw) - m.evaluate(x - step, **kw)) / (2 * step)
    exact = np.broadcast_to(d.evaluate(x, **kw), numeric.shape)
    # Away from the kinks of where/min/max/abs (a step there crosses the branch).
    kinks = np.zeros(x.shape, bool)
    for k in (0.3, 0.7, -0.5, 0.25, 0.0):
        kinks |= np.abs(x - k) < 1e-4
    np.testing.assert_allclose(exact[~kinks], numeric[~kinks], rtol=1e-6, atol=1e-6)
    assert not d.uses_score or "score" in src


def test_the_derivative_folds_constants() -> None:
    assert score_mod("score + slope[h] * i", {"slope": SLOPE}).derivative().node == score_mod("1.0").node
    assert score_mod("i * 2").derivative().evaluate(0.0) == 0.0


@pytest.mark.parametrize("src, tensors, role, match", [
    ("score.real", {}, "score", "Attribute is not part of the language"),
    ("sin(score)", {}, "score", "function 'sin' is not part of the language"),
    ("score if i > j else 0", {}, "score", "IfExp is not part of the language"),
    ("(i > j) and (j > 0)", {}, "mask", "'and'/'or' are not part"),
    ("not (i > j)", {}, "mask", "'not' is not part of the language"),
    ("score + q", {}, "score", "unknown name 'q'"),
    ("score + slope", {"slope": SLOPE}, "score", "tensor 'slope' must be indexed"),
    ("score + slope[h, i]", {"slope": SLOPE}, "score", "slope has 1 dimensions, indexed with 2"),
    ("score + slope[score]", {"slope": SLOPE}, "score", "indices of slope must be ints"),
    ("score + (i > j)", {}, "score", "got a bool"),
    ("score > 0", {}, "mask", "a mask_mod may not use 'score'"),
    ("i - j", {}, "mask", "a mask_mod must give a bool"),
    ("i > j", {}, "score", "a score_mod must give a float"),
    ("score // 2", {}, "score", "// takes ints"),
    ("(i > j) & 1", {}, "mask", "& combines bools"),
    ("where(i > j, score)", {}, "score", r"where\(\) takes 3 positional arguments"),
    ("exp(x=score)", {}, "score", r"exp\(\) takes 1 positional arguments"),
    ("lambda: 1", {}, "score", "Lambda is not part of the language"),
    ("score +", {}, "score", "is not a Python expression"),
])
def test_everything_outside_the_language_is_refused_by_name(src, tensors, role, match) -> None:
    with pytest.raises(ValueError, match=match):
        (score_mod if role == "score" else mask_mod)(src, tensors)


def test_bad_tensor_names_and_kinds_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot name a tensor"):
        score_mod("score", {"score": SLOPE})
    with pytest.raises(ValueError, match="cannot name a tensor"):
        score_mod("score", {"exp": SLOPE})
    with pytest.raises(TypeError, match="must be bool, int or float"):
        score_mod("score", {"c": np.zeros(3, np.complex64)})
    with pytest.raises(ValueError, match="1 to 4 dimensions"):
        score_mod("score", {"c": np.float32(1.0)})
    with pytest.raises(ValueError, match="only a score_mod has a derivative"):
        mask_mod("i > j").derivative()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_translations_compile_with_nvcc(tmp_path: Path) -> None:
    """Every example and its derivative translates into CUDA that nvcc compiles."""
    fns = []
    for k, (src, _) in enumerate(SCORE_MODS.values()):
        m = score_mod(src, _tensors_used(src))
        fns += [m.cuda(f"sm{k}"), m.derivative().cuda(f"dsm{k}")]
    for k, (src, _) in enumerate(MASK_MODS.values()):
        fns.append(mask_mod(src, _tensors_used(src)).cuda(f"mm{k}"))
    fns.append(score_mod("(i - j) // 3 + (i - j) % 3").cuda("ints"))
    calls = " + ".join(f"(float)sm{k}(s, 0, 1, 2, 3, mods) + dsm{k}(s, 0, 1, 2, 3, mods)"
                       for k in range(len(SCORE_MODS)))
    masks = " + ".join(f"(int)mm{k}(s, 0, 1, 2, 3, mods)" for k in range(len(MASK_MODS)))
    src = (CUDA_PRELUDE + "\n".join(fns) +
           "\nextern \"C\" __global__ void probe(float *out, ModTensors mods) {\n"
           f"    const float s = out[threadIdx.x];\n    out[threadIdx.x] = {calls} + {masks} + ints(s, 0, 0, 5, 1, mods);\n}}\n")
    cu = tmp_path / "mods.cu"
    cu.write_text(src)
    r = subprocess.run(["nvcc", "--ptx", "-arch", "sm_80", str(cu), "-o", str(tmp_path / "mods.ptx")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("score_src, mask_src, members, loads_left", [
    ("score - slope[h] * abs(i - j)", None, ["float v0"], 0),
    (None, "(j <= i) | (j < prefix[b])", ["int v0"], 0),
    (None, "doc[b, i] == doc[b, j]", [], 2),
    ("score + table[h, 2] * table[b % 3, 1] - table[h, i % 9]", None, ["float v0"], 1),
    ("score - slope[h]", "j < prefix[b] + h", ["float v0", "long long v1"], 0),
])
def test_kernel_code_reads_what_depends_on_b_and_h_alone_once_a_job(score_src, mask_src, members,
                                                                    loads_left) -> None:
    """The largest subexpressions that read a tensor and depend on b and h alone become ModHead
    members (filled by mod_head once a job); the modifiers read them from hv, not from memory."""
    from pycudaflash.mods import kernel_code

    sm = score_mod(score_src, _tensors_used(score_src)) if score_src else None
    mm = mask_mod(mask_src, _tensors_used(mask_src)) if mask_src else None
    code = kernel_code(sm, mm)[1]
    head = code[code.index("struct ModHead {"):]
    assert head[:head.index("}")] == "struct ModHead {" + "".join(f" {m};" for m in members) + " "
    fns = code[code.index("score_mod(" if sm else "mask_mod("):]
    assert fns.count("mod_load") == loads_left
    assert all(f"hv.v{k}" in fns for k in range(len(members)))


def test_tanh_of_a_score_modifier_is_the_kernels_mod_tanh_and_of_a_mask_modifier_tanhf() -> None:
    """A score modifier's tanh goes through mod_tanh (the hardware approximation in the 16-bit
    kernels); a mask modifier decides with tanhf, as does a value hoisted into ModHead."""
    from pycudaflash.mods import kernel_code

    code = kernel_code(score_mod("30 * tanh(score / 30) + tanh(slope[h])", _tensors_used("slope[")),
                       mask_mod("tanh(i * 0.01) < 0.5"))[1]
    score_fn = code[code.index("float score_mod("):code.index("float score_mod_slope(")]
    assert "mod_tanh(" in score_fn and "tanhf(" not in score_fn
    assert "mod_tanh(" in code[code.index("float score_mod_slope("):code.index("bool mask_mod(")]
    assert "tanhf(" in code[code.index("bool mask_mod("):] and "mod_tanh(" not in code[code.index("bool mask_mod("):]
    assert "tanhf(" in code[code.index("ModHead mod_head("):code.index("float score_mod(")]


# ------------------------------------------------- the reference with modifiers

def _torch_attention(q, k, v, scale, score_fn, allowed):
    """Plain float64 attention in torch with a score function, for autograd."""
    import torch

    s = score_fn(torch.einsum("bhid,bhjd->bhij", q, k) * scale)
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("name", ["softcap", "alibi", "mixed"])
def test_reference_with_a_score_mod_matches_torch_autograd(name: str) -> None:
    torch = pytest.importorskip("torch")
    from pycudaflash.reference import reference_backward, reference_forward

    g = np.random.default_rng(11)
    D = 8
    q, k, v, dout = (g.standard_normal((B, H, n, D)) for n in (NQ, NK, NK, NQ))
    src = SCORE_MODS[name][0]
    tensors = _tensors_used(src)
    hh = torch.arange(H).view(1, H, 1, 1)
    ii, jj = torch.arange(NQ).view(1, 1, NQ, 1), torch.arange(NK).view(1, 1, 1, NK)
    fns = {
        "softcap": lambda s: 30 * torch.tanh(s / 30),
        "alibi": lambda s: s - torch.from_numpy(SLOPE.astype(np.float64))[hh] * (ii - jj).abs(),
        "mixed": lambda s: (torch.where(s > 0, torch.exp(-s) * 2, torch.log(1 + s * s))
                            + torch.minimum(s, torch.tensor(1.5, dtype=torch.float64)) / hh.clamp(min=1)),
    }
    causal = torch.ones(NQ, NK, dtype=torch.bool).tril().view(1, 1, NQ, NK)  # top-left causal
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    out_t = _torch_attention(tq, tk, tv, D ** -0.5, fns[name], causal)
    out_t.backward(torch.from_numpy(dout))
    out, lse = reference_forward(q, k, v, causal=True, score_mod=src, mod_tensors=tensors)
    dq, dk, dv = reference_backward(dout, q, k, v, causal=True, score_mod=src, mod_tensors=tensors)
    for got, want in ((out, out_t.detach()), (dq, tq.grad), (dk, tk.grad), (dv, tv.grad)):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-12)
    assert np.isfinite(lse).all()


def test_reference_mask_mod_equals_the_same_bool_mask() -> None:
    from pycudaflash.reference import reference_backward, reference_forward

    g = np.random.default_rng(12)
    q, k, v, dout = (g.standard_normal((B, H, n, 16)) for n in (NQ, NK, NK, NQ))
    src, allowed = MASK_MODS["document"]
    mask = np.broadcast_to(allowed, (B, H, NQ, NK))
    a = reference_forward(q, k, v, mask_mod=src, mod_tensors={"doc": DOC})
    b = reference_forward(q, k, v, mask=mask)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(reference_backward(dout, q, k, v, mask_mod=src, mod_tensors={"doc": DOC}),
                    reference_backward(dout, q, k, v, mask=mask)):
        np.testing.assert_array_equal(x, y)


def test_a_score_mod_slope_that_is_not_finite_where_nothing_flows_gives_no_nan() -> None:
    """The slope 1000 exp(1000 score) overflows at the masked positions (j > i), where the
    probability is 0: no inf * 0 may reach the gradients."""
    from pycudaflash.reference import reference_backward

    g = np.random.default_rng(13)
    q, k, v, dout = (g.standard_normal((1, 1, n, 4)) for n in (5, 6, 6, 5))
    q *= 40  # (scores of a few hundred)
    dq, dk, dv = reference_backward(dout, q, k, v, score_mod="where(j <= i, score, exp(score * 1000))",
                                    causal=True)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()


@pytest.mark.parametrize("src, reads_b, reads_h", [("doc[b, i] == doc[b, j]", True, False),
                                                   ("(i - j) % 3 != 1", False, False),
                                                   ("table[h, (i + j) % 9] > 0", False, True),
                                                   ("(b + h) % 2 == (i + j) % 2", True, True)])
def test_a_mask_modifier_says_which_positions_its_block_map_has_planes_for(src: str, reads_b: bool,
                                                                           reads_h: bool) -> None:
    """reads() names the positions an expression reads; kernel_code defines MASK_MOD_READS_B and _H
    from it (the planes of the modifier's block map, map_plane in flash_common.cuh)."""
    from pycudaflash.mods import kernel_code

    m = mask_mod(src, _tensors_used(src))
    assert (m.reads("b"), m.reads("h"), m.reads("i"), m.reads("j")) == (reads_b, reads_h, True, True)
    code = kernel_code(None, m)[1]
    assert f"#define MASK_MOD_READS_B {int(reads_b)}\n" in code
    assert f"#define MASK_MOD_READS_H {int(reads_h)}\n" in code
    assert "MASK_MOD_READS" not in kernel_code(score_mod("score * 2"), None)[1]
    with pytest.raises(ValueError, match="none of the positions"):
        m.reads("score")
