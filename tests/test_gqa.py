"""Grouped-query and multi-query attention in the float64 reference (K/V with fewer heads than
q), against torch SDPA's enable_gqa; the backends are held to the reference by the property
suite, which draws K/V groupings."""

from __future__ import annotations

import numpy as np
import pytest

NQ, NK = 7, 11


@pytest.mark.parametrize("hkv", [1, 2, 6])
def test_reference_grouped_queries_match_torch_sdpa(hkv: int) -> None:
    """Query head h reads K/V head h // (H / Hkv), as torch SDPA's enable_gqa; dK, dV sum each group."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from pycudaflash.reference import reference_backward, reference_forward

    g = np.random.default_rng(31)
    Bq, Hq, D = 2, 6, 8
    q, dout = g.standard_normal((Bq, Hq, NQ, D)), g.standard_normal((Bq, Hq, NQ, D))
    k, v = g.standard_normal((Bq, hkv, NK, D)), g.standard_normal((Bq, hkv, NK, D))
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    out_t = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)
    out_t.backward(torch.from_numpy(dout))
    out, _ = reference_forward(q, k, v, causal=True)
    dq, dk, dv = reference_backward(dout, q, k, v, causal=True)
    assert dk.shape == k.shape and dv.shape == v.shape
    for got, want in ((out, out_t.detach()), (dq, tq.grad), (dk, tk.grad), (dv, tv.grad)):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-12)


def test_reference_refuses_head_counts_that_do_not_divide() -> None:
    from pycudaflash.reference import reference_forward

    q, k = np.zeros((1, 6, 4, 8)), np.zeros((1, 4, 4, 8))
    with pytest.raises(ValueError, match="k has 4 heads, which must divide the 6 heads of q"):
        reference_forward(q, k, k)
