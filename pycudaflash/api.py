"""Public entry points: :func:`flash_attn_forward` and :func:`flash_attn_backward`.

Validation (``pycudaflash._validate``) is separate from launching: every bad
argument raises ``TypeError``/``ValueError`` before any device work.  The
validated :class:`~pycudaflash._problem.Problem` then goes to one backend:

* ``'cuda'``: the PyCUDA kernels in ``cuda_src/`` (``pycudaflash.cuda_backend``);
* ``'numpy'``: the same tiled algorithm in NumPy (``pycudaflash.cpu``).

Results come back as the inputs' kind: torch tensors for torch tensors (CPU
tensors run on the NumPy backend), cupy arrays for cupy arrays, pycuda
``GPUArray``s for ``GPUArray``s and other device arrays, numpy arrays for
numpy arrays.  A repeated call on device arrays with the same signature
(shapes, strides, dtypes, options) skips validation and planning
(``pycudaflash._calls``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import numpy as np

from . import _calls, _driver, _validate, blockmap, cpu
from ._arrays import is_torch_cpu, torch_cpu_call
from ._backends import choose_backend
from .blockmap import BlockMap

ArrayLike = Any
#: A dtype name ('float32', 'float16', 'bfloat16'), a numpy dtype or scalar
#: type (``ml_dtypes.bfloat16``), or a torch dtype.
DTypeLike = Any


def flash_attn_forward(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    causal: Any = False,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    mask: Optional[ArrayLike] = None,
    key_lengths: Optional[ArrayLike] = None,
    scale: Optional[float] = None,
    stream: Any = None,
    out: Optional[ArrayLike] = None,
    lse: Optional[ArrayLike] = None,
    backend: Optional[str] = None,
    dtype: Optional[DTypeLike] = None,
    score_mod: Any = None,
    mask_mod: Any = None,
    mod_tensors: Optional[Mapping[str, Any]] = None,
    block_map: Optional[BlockMap] = None,
) -> Tuple[ArrayLike, ArrayLike]:
    """Attention forward pass, ``out = softmax(scale * q k^T + bias) v``.

    Parameters
    ----------
    q : array, shape (B, H, Nq, D)
        Queries: a pycuda ``GPUArray``, any object exposing
        ``__cuda_array_interface__`` (torch, cupy), or a numpy array.  Any
        strides with the last dimension contiguous.  dtype float32, float16
        or bfloat16 (``ml_dtypes.bfloat16`` for numpy arrays).
    k, v : array, shape (B, Hkv, Nk, D)
        Keys and values, same kind and dtype as ``q``.  ``Hkv`` (usually
        ``H``) divides ``H``: query head ``h`` reads K/V head
        ``h // (H // Hkv)`` (grouped-query and multi-query attention; the
        backward sums dk, dv over each group in a fixed order).
    causal : bool or {'top_left', 'bottom_right'}, optional
        ``True``/``'top_left'``: query i sees keys j <= i.  ``'bottom_right'``:
        query i sees keys j <= i + Nk - Nq.
    window : (left, right), optional
        Query i sees keys from ``i + off - left`` to ``i + off + right``
        (``off = Nk - Nq`` for bottom-right alignment, else 0); ``None`` or
        ``-1`` leaves a side unbounded.
    mask : array, optional
        Broadcastable to (B, H, Nq, Nk).  bool: True = attend.  float32 (or
        the dtype of ``q``): added to the scaled scores (``-inf`` allowed).
    key_lengths : int array of shape (B,), optional
        Keys at or past ``key_lengths[b]`` are masked (padding).
    scale : float, optional
        Score scale, default ``1/sqrt(D)``.
    stream : stream, optional
        Stream for all work and temporaries: a pycuda ``Stream``, a torch or
        cupy stream, an object with ``__cuda_stream__``, or a ``CUstream``
        handle (int).  None: torch's current stream for torch tensors,
        cupy's for cupy arrays, else the default stream.
    out, lse : arrays, optional
        Output buffers, (B, H, Nq, D) like ``q`` and (B, H, Nq) float32;
        they must not overlap any input or each other.
    backend : {'cuda', 'numpy'}, optional
        Force a backend; by default device inputs run on CUDA and numpy inputs
        on CUDA when a GPU is usable, else on the NumPy backend.
    dtype : str or dtype, optional
        Names the element type of opaque 2-byte device inputs, e.g.
        ``'bfloat16'``: ``__cuda_array_interface__`` exports bfloat16 as
        ``'<V2'``, which does not say which 2-byte type it is.  Objects with
        ``__dlpack__`` (torch, cupy) need no ``dtype``; their type is read
        from DLPack.  When given, it must equal the dtype of q, k, v and out,
        else ``TypeError``.
    score_mod, mask_mod : str or pycudaflash.mods.Modifier, optional
        Modifier expressions (:mod:`pycudaflash.mods`), e.g.
        ``score_mod="30 * tanh(score / 30)"`` or
        ``mask_mod="doc[b, i] == doc[b, j]"``: the score modifier replaces
        each scaled (and biased) score, the mask modifier excludes where it
        is False.
    mod_tensors : mapping of str to array, optional
        The arrays the modifiers read by name.
    block_map : pycudaflash.BlockMap, optional
        A bool mask and/or mask modifier with block maps kept on the GPU
        (:class:`pycudaflash.BlockMap`): the call takes its mask, mask_mod
        and their tensors from it (and none of its own) and builds no block
        map where the BlockMap holds one of its tile shape.

    Returns
    -------
    out : array, shape (B, H, Nq, D)
        In the dtype of ``q``.
    lse : array, shape (B, H, Nq), float32
        Natural-log log-sum-exp of each row's scores; ``-inf`` for a row that
        sees no key (its ``out`` row is 0).
    """
    mask, mask_mod, mod_tensors = blockmap.call_args(block_map, mask, mask_mod, mod_tensors)
    mods = dict(score_mod=score_mod, mask_mod=mask_mod, mod_tensors=mod_tensors)
    if is_torch_cpu(q):
        return torch_cpu_call(
            flash_attn_forward, (q, k, v), dict(out=out, lse=lse, mask=mask), ("out", "lse"),
            dict(causal=causal, window=window, key_lengths=key_lengths, scale=scale, stream=stream,
                 backend=backend or "numpy", dtype=dtype, **mods),
        )
    return _run("fwd", (q, k, v, out, lse, mask), (causal, window, scale, backend, dtype), key_lengths, stream,
                backend, lambda: _validate.validate_forward(
                    q, k, v, causal=causal, window=window, mask=mask, key_lengths=key_lengths,
                    scale=scale, out=out, lse=lse, dtype=dtype, block_map=block_map, **mods), mods, block_map)


def flash_attn_backward(
    dout: ArrayLike,
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    out: ArrayLike,
    lse: ArrayLike,
    *,
    causal: Any = False,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    mask: Optional[ArrayLike] = None,
    key_lengths: Optional[ArrayLike] = None,
    scale: Optional[float] = None,
    deterministic: bool = False,
    stream: Any = None,
    dq: Optional[ArrayLike] = None,
    dk: Optional[ArrayLike] = None,
    dv: Optional[ArrayLike] = None,
    backend: Optional[str] = None,
    dtype: Optional[DTypeLike] = None,
    score_mod: Any = None,
    mask_mod: Any = None,
    mod_tensors: Optional[Mapping[str, Any]] = None,
    block_map: Optional[BlockMap] = None,
) -> Tuple[ArrayLike, ArrayLike, ArrayLike]:
    """Attention backward pass from the forward's ``out`` and ``lse``.

    Parameters
    ----------
    dout : array, shape (B, H, Nq, D)
        Gradient of the loss with respect to ``out``.
    q, k, v, out, lse
        The forward pass's inputs and results (``lse`` float32, natural log).
    causal, window, mask, key_lengths, scale, score_mod, mask_mod, mod_tensors, block_map
        As in :func:`flash_attn_forward`; they must match the forward call.
        The gradient through ``score_mod`` is its derivative with respect to
        the score, derived from the expression.
    deterministic : bool, optional
        If True, results are bit-identical run to run (no floating-point
        atomics in the dQ reduction).
    stream : stream, optional
        As in :func:`flash_attn_forward`.
    dq, dk, dv : arrays, optional
        Output buffers shaped like q, k and v; they must not overlap any
        input or each other.
    backend : {'cuda', 'numpy'}, optional
        As in :func:`flash_attn_forward`.
    dtype : str or dtype, optional
        As in :func:`flash_attn_forward`; when given it must equal the dtype
        of dout, q, k, v, out, dq, dk and dv.

    Returns
    -------
    dq, dk, dv : arrays shaped like q, k, v
        Gradients of the loss, in the dtype of ``q``; rows that saw no key
        give zero gradients; with fewer K/V heads than query heads, dk and
        dv sum the gradients of each group.
    """
    mask, mask_mod, mod_tensors = blockmap.call_args(block_map, mask, mask_mod, mod_tensors)
    mods = dict(score_mod=score_mod, mask_mod=mask_mod, mod_tensors=mod_tensors)
    if is_torch_cpu(q):
        return torch_cpu_call(
            _backward_positional, (dout, q, k, v, out, lse), dict(dq=dq, dk=dk, dv=dv, mask=mask),
            ("dq", "dk", "dv"),
            dict(causal=causal, window=window, key_lengths=key_lengths, scale=scale,
                 deterministic=deterministic, stream=stream, backend=backend or "numpy", dtype=dtype, **mods),
        )
    return _run("bwd", (q, k, v, out, dout, lse, dq, dk, dv, mask),
                (causal, window, scale, deterministic, backend, dtype), key_lengths, stream, backend,
                lambda: _validate.validate_backward(
                    dout, q, k, v, out, lse, causal=causal, window=window, mask=mask,
                    key_lengths=key_lengths, scale=scale, deterministic=deterministic,
                    dq=dq, dk=dk, dv=dv, dtype=dtype, block_map=block_map, **mods), mods, block_map)


def _run(kind: str, arrays: Tuple[Any, ...], options: Tuple[Any, ...], key_lengths: Any, stream: Any,
         backend: Optional[str], validate: Callable[[], Any], mods: Dict[str, Any],
         block_map: Optional[BlockMap] = None) -> Tuple[Any, ...]:
    """A pass of the plain API: a repeated call of a planned signature launches at once (outputs
    allocated or checked for overlap by address range); any other is validated, then run.

    ``arrays``: the pass's operands in the order of ``cuda_backend.OPERANDS[kind]`` (None where
    absent); ``validate()`` returns the call's Problem; ``mods``: the modifier arguments (with
    those of ``block_map``).
    """
    sig = None if backend == "numpy" else _calls.signature(
        kind, arrays, options + (_calls.mods_key(**mods, block_map=block_map),), key_lengths)
    if sig is not None:
        key, ptrs, ctx, pushed = sig
        try:
            hit = _calls.lookup(key)
            if hit is not None:
                from . import cuda_backend

                plan, _, device, spans = hit
                if (all(arrays[i] is None for i in plan.OUTPUTS)
                        or _calls.outputs_disjoint(ptrs, spans, plan.OUTPUTS)):
                    return cuda_backend.launch(plan, ctx, device, cuda_backend.stream_for(stream, arrays[0]), ptrs,
                                               arrays, kl_host=_calls.host_key_lengths(key_lengths, plan),
                                               mods=_calls.mod_values(plan, mods["mod_tensors"]),
                                               block_map=block_map)
        finally:
            _driver.leave(pushed)
    prob = validate()
    if choose_backend(prob, backend, stream) == "numpy":
        return cpu.run_forward(prob) if kind == "fwd" else cpu.run_backward(prob)
    from . import cuda_backend

    keep = _calls.keeper(sig[0], prob, cuda_backend.OPERANDS[kind]) if sig is not None else None
    return cuda_backend.run(prob, kind, stream, keep)


def _backward_positional(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, out: ArrayLike,
                         lse: ArrayLike, **kwargs: Any) -> Tuple[ArrayLike, ArrayLike, ArrayLike]:
    return flash_attn_backward(dout, q, k, v, out, lse, **kwargs)


class PreparedCall:
    """One validated, planned call on device arrays, to launch again and again.

    Made by :func:`prepare_forward` or :func:`prepare_backward`.  Calling it
    launches the kernels on the arrays it was prepared with (their contents
    may change between calls; their memory must stay allocated), with no
    validation, planning or allocation: the cheapest launch this library
    has, for research loops over fixed shapes and for graph capture
    (:class:`pycudaflash.capture`).  It owns its workspace: run one prepared
    call on one stream at a time.

    Attributes
    ----------
    outputs : tuple
        The output arrays every call writes: ``(out, lse)`` or
        ``(dq, dk, dv)``, the buffers given or ones allocated once.
    """

    def __init__(self, kind: str, prob: Any) -> None:
        from . import cuda_backend

        plan, _, device = cuda_backend.plan(prob, kind)
        ops = [getattr(prob, n) for n in cuda_backend.OPERANDS[kind]]
        ptrs = [op.ptr if op is not None else 0 for op in ops]
        objs = [op.obj if op is not None else None for op in ops]
        kl_host = prob.key_lengths
        ctx, pushed = _driver.enter(cuda_backend._device_hint(objs[0]))
        try:
            like, stream = objs[0], cuda_backend.stream_for(None, objs[0])
            for i, shape, dt in zip(plan.OUTPUTS, plan.shapes, plan.out_dtypes):  # outputs not given:
                if objs[i] is None:                                                # allocated once
                    objs[i] = cuda_backend.empty_like_input(like, shape, dt, device, stream)
                    ptrs[i] = cuda_backend._ptr(objs[i])
            # Key lengths copied to the device once, and a workspace of its own, so that a call
            # allocates nothing and can be captured into a graph.
            self._kl = (None if kl_host is None
                        else cuda_backend.device_copy_like(like, np.ascontiguousarray(kl_host), device))
            self._ws = (None if plan.ws_bytes == 0
                        else cuda_backend.empty_like_input(like, (plan.ws_bytes,), np.dtype(np.uint8), device, stream))
        finally:
            _driver.leave(pushed)
        self._kind, self._plan, self._device = kind, plan, device
        self._ptrs, self._objs = tuple(ptrs), tuple(objs)
        # (the modifiers' tensors as the plan reads them, and the BlockMap whose maps it reads)
        self._mods, self._block_map = cuda_backend.mod_values(plan, prob.mod_tensors), prob.block_map
        self._kl_ptr = 0 if self._kl is None else cuda_backend._ptr(self._kl)
        self._ws_ptr = 0 if self._ws is None else cuda_backend._ptr(self._ws)
        self.outputs: Tuple[Any, ...] = tuple(objs[i] for i in plan.OUTPUTS)

    def __call__(self, stream: Any = None) -> Tuple[ArrayLike, ...]:
        """Launch on ``stream`` (see :func:`flash_attn_forward`); return :attr:`outputs`."""
        from . import cuda_backend

        ctx, pushed = _driver.enter(cuda_backend._device_hint(self._objs[0]))
        try:
            handle = cuda_backend.stream_for(stream, self._objs[0])
            return cuda_backend.launch(self._plan, ctx, self._device, handle, self._ptrs, self._objs,
                                       device_kl=self._kl_ptr, workspace=self._ws_ptr, mods=self._mods,
                                       block_map=self._block_map)
        finally:
            _driver.leave(pushed)


def prepare_forward(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, out: Optional[ArrayLike] = None,
                    lse: Optional[ArrayLike] = None, **options: Any) -> PreparedCall:
    """Validate and plan a forward call on device arrays once; return it as a :class:`PreparedCall`.

    Parameters
    ----------
    q, k, v, out, lse
        Device arrays as in :func:`flash_attn_forward`; outputs not given
        are allocated here, once.
    **options
        ``causal``, ``window``, ``mask``, ``key_lengths``, ``scale``,
        ``dtype``, ``score_mod``, ``mask_mod``, ``mod_tensors`` and
        ``block_map`` as in :func:`flash_attn_forward` (device modifier
        tensors are read in place at every call, host ones copied; a
        BlockMap's maps are built by the first call that needs them).
    """
    prob = _validate.validate_forward(q, k, v, out=out, lse=lse, **options)
    if not prob.on_device:
        raise TypeError("prepare_forward needs device arrays; numpy arrays run through flash_attn_forward")
    return PreparedCall("fwd", prob)


def prepare_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, out: ArrayLike, lse: ArrayLike,
                     *, dq: Optional[ArrayLike] = None, dk: Optional[ArrayLike] = None,
                     dv: Optional[ArrayLike] = None, **options: Any) -> PreparedCall:
    """Validate and plan a backward call on device arrays once (see :func:`prepare_forward`).

    ``**options``: ``causal``, ``window``, ``mask``, ``key_lengths``,
    ``scale``, ``deterministic``, ``dtype``, ``score_mod``, ``mask_mod``,
    ``mod_tensors`` and ``block_map`` as in :func:`flash_attn_backward`.
    """
    prob = _validate.validate_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **options)
    if not prob.on_device:
        raise TypeError("prepare_backward needs device arrays; numpy arrays run through flash_attn_backward")
    return PreparedCall("bwd", prob)
