"""Property test: every backend with drawn score and mask modifiers and K/V head groupings,
against the float64 reference, over the sizes and options the main property suite draws (the
CUDA runs skip, with the reason, without PyCUDA or a GPU; on a GPU the 'gpu' profile draws 300)."""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pycudaflash import flash_attn_backward, flash_attn_forward
from pycudaflash.reference import reference_backward, reference_forward
from pycudaflash.testing import attention_kwargs, attention_problems, check, make_inputs, noise_floors
from test_properties import BOUNDS

MAX_HEAD_DIM = 96
PROBLEMS = attention_problems(max_batch=2, max_heads=4, max_seqlen=130, max_head_dim=MAX_HEAD_DIM, dtypes=("float32",))

# Templates: {c} is a drawn constant; slope[h], table[...], doc[b, .], prefix[b] are drawn tensors.
# Each score modifier is smooth in the score (branches and kinks are on positions): at a jump or
# a kink in the score, a float32 score and its float64 reference may fall on different sides, and
# the results (or gradients) then differ by the jump, not by rounding.
SCORE_MODS = [None, "{c} * tanh(score / {c})", "score - slope[h] * abs(i - j)", "score + table[h, min(max(j - i, -8), 8) + 8]",
              "where(i >= j, score, score * 0.5)", "score + min(max(j - i, -{c}), {c}) / 10",
              "score * exp(-abs(i - j) / ({c} + 1))"]
MASK_MODS = [None, "doc[b, i] == doc[b, j]", "(j <= i) | (j < prefix[b])", "(i - j) % 3 != 1", "~(j == i // 2)"]

# The CUDA runs draw one of these pairs (constants fixed): each distinct expression compiles its own
# kernels, so the variants they can need are few enough to build in parallel before the first example
# (_warm_cuda_variants); the NumPy runs draw from the templates above.
CUDA_PAIRS = [("30.0 * tanh(score / 30.0)", "doc[b, i] == doc[b, j]"),
              ("score - slope[h] * abs(i - j)", "(j <= i) | (j < prefix[b])"),
              ("score + table[h, min(max(j - i, -8), 8) + 8]", "(i - j) % 3 != 1"),
              (None, "~(j == i // 2)"),
              ("score * exp(-abs(i - j) / 6.0)", None)]

# Bound of check() (relative norm, and the same fraction of the noise floors), float32 tiles
# against float64: the smallest that passed the worst of 600 drawn examples was 6.8e-7 (dk),
# 4.9e-7 (dq), 3.6e-7 (dv), 2.5e-7 (out); the bound is twice the worst.
BOUND = 1.4e-6
# The CUDA kernels (split-TF32 products): the property suite's float32 bounds (tests/test_properties.py).
CUDA_BOUNDS = BOUNDS[("cuda", "float32")]


@given(data=st.data())
def test_backends_with_modifiers_match_the_reference(backend: str, data: Any) -> None:
    problem = data.draw(PROBLEMS, label="problem")
    H = problem.H
    hkv = data.draw(st.sampled_from([d for d in range(1, H + 1) if H % d == 0]), label="hkv")
    if backend == "numpy":
        c = data.draw(st.sampled_from([1.5, 5.0, 30.0]), label="c")
        smod = data.draw(st.sampled_from(SCORE_MODS), label="score_mod")
        mmod = data.draw(st.sampled_from(MASK_MODS), label="mask_mod")
        smod = smod.format(c=c) if smod else None
    else:
        _warm_cuda_variants()
        smod, mmod = data.draw(st.sampled_from(CUDA_PAIRS), label="modifiers")
    x = make_inputs(problem)
    g = np.random.default_rng(problem.seed + 1)
    q, k, v, dout = x["q"], x["k"][:, :hkv], x["v"][:, :hkv], x["dout"]
    n = max(problem.Nq, problem.Nk)
    tensors = _tensors(g, problem.B, H, n)
    used = {name: t for name, t in tensors.items() if any(m and name + "[" in m for m in (smod, mmod))}
    mods = dict(score_mod=smod, mask_mod=mmod, mod_tensors=used or None) if (smod or mmod) else {}
    kw = attention_kwargs(problem, x)
    out, lse = flash_attn_forward(q, k, v, **kw, **mods, backend=backend)
    dq, dk, dv = flash_attn_backward(dout, q, k, v, out, lse, **kw, **mods, backend=backend)
    r_out, r_lse = reference_forward(q, k, v, **kw, **mods)
    r_dq, r_dk, r_dv = reference_backward(dout, q, k, v, **kw, **mods)
    # Noise floors of results that cancel (a row with one key has dq = its rounding noise), from the
    # probabilities of the modified scores.
    floors = noise_floors(q, k, v, dout, **kw, **mods)
    for name, got, want in (("out", out, r_out), ("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dv, r_dv)):
        assert got.shape == want.shape, name
        bound = BOUND if backend == "numpy" else CUDA_BOUNDS[name]
        res = check(name, got, want, rtol_norm=bound, atol=bound * floors[name])
        assert res.ok, str(res)
    finite = np.isfinite(r_lse)
    assert np.array_equal(np.isfinite(lse), finite), "lse: rows that see no key differ"
    if finite.any():
        tol = 2e-6 if backend == "numpy" else 6e-6
        np.testing.assert_allclose(lse[finite], r_lse[finite], rtol=tol, atol=tol)


def _tensors(g: np.random.Generator, B: int, H: int, n: int) -> Dict[str, np.ndarray]:
    """The named tensors the modifiers read."""
    return dict(slope=g.uniform(0, 0.5, H).astype(np.float32), table=g.standard_normal((H, 17)).astype(np.float32),
                doc=np.sort(g.integers(0, 3, (B, n)), axis=1).astype(np.int32),
                prefix=g.integers(0, n + 1, B))


_warmed: List[str] = []


def _warm_cuda_variants() -> None:
    """Compile, in parallel and once a process, every kernel variant the CUDA runs can draw: each
    pair of CUDA_PAIRS x the float32 head-dim buckets of PROBLEMS x dense mask kinds x K/V
    groupings x forward and backward, for the current device."""
    from pycudaflash import compiler
    from pycudaflash.mods import as_modifier

    arch = compiler.arch_of_current_device()
    if arch in _warmed:
        return
    tensors = _tensors(np.random.default_rng(0), 2, 4, 8)
    buckets = {compiler.head_dim_bucket(d) for d in range(1, MAX_HEAD_DIM + 1)}
    todo = [(p, d) for smod, mmod in CUDA_PAIRS
            for p, d in compiler.all_variants(("float32",), arch,
                                              mods=(as_modifier(smod, tensors, "score"),
                                                    as_modifier(mmod, tensors, "mask")))
            if d["HEAD_DIM"] in buckets]
    compiler.warm_cache(arch, jobs=16, variants=todo)
    _warmed.append(arch)
