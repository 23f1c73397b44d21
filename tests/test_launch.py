"""The launch path on a GPU: streams of every kind, prepared calls, graphs, memory.

All tests here need a CUDA device and PyCUDA; they skip with the reason
elsewhere.  Results are compared bit for bit with the same call made the
plain way (deterministic backward), whose accuracy the property suite
checks.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import numpy as np
import pytest

import pycudaflash as pf
from pycudaflash.testing import AttentionProblem, attention_kwargs, make_inputs, to_host

pytestmark = pytest.mark.gpu

_P = AttentionProblem(B=2, H=3, Nq=257, Nk=300, D=64, dtype="float16", causal="bottom_right",
                      key_lengths=(300, 190), seed=51)


def _inputs(cuda: None, problem: AttentionProblem = _P) -> Tuple[Dict[str, Any], Dict[str, Any], Dict[str, Any]]:
    """Host inputs, GPUArray copies, and the call's keywords."""
    import pycuda.gpuarray as gpuarray

    x = make_inputs(problem)
    dev = {n: gpuarray.to_gpu(np.ascontiguousarray(x[n])) for n in ("q", "k", "v", "dout")}
    return x, dev, attention_kwargs(problem, x)


def _same(a: Any, b: Any, what: str) -> None:
    assert np.array_equal(to_host(a), to_host(b), equal_nan=True), f"{what} differs"


def test_gpuarray_in_gpuarray_out(cuda: None) -> None:
    import pycuda.gpuarray as gpuarray

    x, d, kw = _inputs(cuda)
    out, lse = pf.flash_attn_forward(d["q"], d["k"], d["v"], **kw)
    assert isinstance(out, gpuarray.GPUArray) and isinstance(lse, gpuarray.GPUArray)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    host_out, host_lse = pf.flash_attn_forward(x["q"], x["k"], x["v"], **kw)
    _same(out, host_out, "out (GPUArray vs numpy)")
    _same(lse, host_lse, "lse (GPUArray vs numpy)")
    grads = pf.flash_attn_backward(d["dout"], d["q"], d["k"], d["v"], out, lse, deterministic=True, **kw)
    assert all(isinstance(g, gpuarray.GPUArray) for g in grads)


def test_every_kind_of_stream_gives_the_same_bits(cuda: None) -> None:
    import pycuda.driver as drv

    x, d, kw = _inputs(cuda)
    ref = pf.flash_attn_forward(d["q"], d["k"], d["v"], **kw)
    s = drv.Stream()
    streams = [s, int(s.handle), 0]
    try:
        import torch

        streams.append(torch.cuda.Stream())
    except ImportError:
        pass
    try:
        import cupy

        streams.append(cupy.cuda.Stream(non_blocking=True))
    except ImportError:
        pass
    for st in streams:
        out, lse = pf.flash_attn_forward(d["q"], d["k"], d["v"], stream=st, **kw)
        drv.Context.synchronize()
        _same(out, ref[0], f"out on a {type(st).__name__} stream")
        _same(lse, ref[1], f"lse on a {type(st).__name__} stream")
    with pytest.raises(TypeError, match="stream must be"):
        pf.flash_attn_forward(d["q"], d["k"], d["v"], stream="default", **kw)


def test_prepared_calls_captured_into_a_graph_replay_bit_identically(cuda: None) -> None:
    """Forward and deterministic backward prepared once, captured on a pycuda stream,
    replayed: the bits of plain calls, also after new inputs are copied in."""
    import pycuda.driver as drv

    x, d, kw = _inputs(cuda)
    fwd = pf.prepare_forward(d["q"], d["k"], d["v"], **kw)
    out, lse = fwd.outputs
    bwd = pf.prepare_backward(d["dout"], d["q"], d["k"], d["v"], out, lse, deterministic=True, **kw)
    stream = drv.Stream()
    fwd(stream)
    bwd(stream)  # (one launch on the stream before capturing: its job counter exists)
    with pf.capture(stream) as graph:
        fwd(stream)
        bwd(stream)
    for round_ in range(2):
        if round_:
            x2 = make_inputs(AttentionProblem(**{**_P.__dict__, "seed": 52}))
            for n in ("q", "k", "v", "dout"):
                d[n].set(np.ascontiguousarray(x2[n]))
        for a in (out, lse) + bwd.outputs:  # poisoned (pycuda's fill has no float16 kernel)
            a.set(np.full(a.shape, np.nan, dtype=a.dtype))
        graph.replay()
        stream.synchronize()
        ref_out, ref_lse = pf.flash_attn_forward(d["q"], d["k"], d["v"], **kw)
        ref_grads = pf.flash_attn_backward(d["dout"], d["q"], d["k"], d["v"], ref_out, ref_lse,
                                           deterministic=True, **kw)
        drv.Context.synchronize()
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse) + bwd.outputs,
                              (ref_out, ref_lse) + tuple(ref_grads)):
            _same(a, b, f"replay {round_}: {name}")


def test_capture_refuses_calls_that_would_allocate_their_outputs(cuda: None) -> None:
    import pycuda.driver as drv

    x, d, kw = _inputs(cuda)
    stream = drv.Stream()
    pf.flash_attn_forward(d["q"], d["k"], d["v"], stream=stream, **kw)
    with pytest.raises(ValueError, match="must be given its output buffers"):
        with pf.capture(stream):
            pf.flash_attn_forward(d["q"], d["k"], d["v"], stream=stream, **kw)
    with pytest.raises(ValueError, match="non-default stream"):
        pf.capture(0)


def test_repeated_calls_check_their_key_lengths_every_time(cuda: None) -> None:
    """The fast path keeps no key lengths: each call's own are checked and used."""
    x, d, kw = _inputs(cuda)
    outs = {}
    for kl in ((300, 190), (5, 0), (300, 190)):
        out, _ = pf.flash_attn_forward(d["q"], d["k"], d["v"], **{**kw, "key_lengths": kl})
        host, _ = pf.flash_attn_forward(x["q"], x["k"], x["v"], backend="numpy", **{**kw, "key_lengths": kl})
        rel = np.linalg.norm(to_host(out).astype(np.float64) - host) / max(np.linalg.norm(host), 1e-30)
        assert rel < 2e-3, f"key lengths {kl}: relative error {rel:.2e} against the NumPy backend"
        outs[kl] = to_host(out)
    _same(outs[(300, 190)], pf.flash_attn_forward(d["q"], d["k"], d["v"], **kw)[0], "repeat")
    with pytest.raises(ValueError, match=r"key_lengths values must lie in \[0, Nk\]"):
        pf.flash_attn_forward(d["q"], d["k"], d["v"], **{**kw, "key_lengths": (301, 0)})


def test_no_context_is_left_pushed_by_plain_calls_on_a_fresh_thread(cuda: None) -> None:
    import threading

    from cuda.bindings import driver

    x, d, kw = _inputs(cuda)
    found = []

    def worker() -> None:
        try:
            before = int(driver.cuCtxGetCurrent()[1])
            pf.flash_attn_forward(x["q"], x["k"], x["v"], **kw)  # numpy in: upload, launch, copy back
            found.append((before, int(driver.cuCtxGetCurrent()[1])))
        except Exception as exc:  # reported below
            found.append(repr(exc))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert found == [(0, 0)], f"context before/after a call on a fresh thread: {found}"
