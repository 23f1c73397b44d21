"""Attention as a torch operator: :func:`flash_attention`.

::

    from pycudaflash.torch import flash_attention

    out = flash_attention(q, k, v, causal=True)      # (B, H, N, D) tensors
    out.sum().backward()                             # dq, dk, dv by the backward kernels

The forward and backward passes are registered as torch custom operators
(``torch.ops.pycudaflash.flash_fwd`` and ``flash_bwd``) with fake
implementations and registered autograd, so :func:`flash_attention` works
eagerly, under ``torch.compile(fullgraph=True)`` and inside a
``torch.cuda.CUDAGraph`` capture.  CUDA tensors run the CUDA kernels on
torch's *current* stream, with outputs and workspaces from torch's caching
allocator, and never synchronise; CPU tensors run the NumPy backend, so the
operator and its gradients work (slowly) without a GPU.

For CUDA tensors the operators' kernels and the forward's autograd are C++
(``csrc/torch_ops.cpp``, built and loaded by :mod:`pycudaflash._fastpath` on
the first CUDA call): a repeated call runs no Python past
:func:`flash_attention` itself, and the backward none at all.  Each call
signature (shapes, strides, dtypes, devices, options, stream) is planned once
by the Python operator ``_fast_plan`` (validation, kernel variant, grid,
packed parameters); a repeated call only allocates its outputs and launches.
Where the C++ path is off (``$PYCUDAFLASH_TORCH_CPP=0``) or could not be
built, an eager call on plain tensors runs the same Python implementation
the operators' Python kernels run, through one ``torch.autograd.Function``,
with plans cached per signature in :mod:`pycudaflash._calls`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from . import _calls, _driver, _fastpath, _validate, blockmap, cuda_backend
from .blockmap import BlockMap
from .semantics import normalize_causal, normalize_scale, normalize_window

__all__ = ["flash_attention"]

Tensor = torch.Tensor


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: Union[bool, str] = False,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    mask: Optional[Tensor] = None,
    key_lengths: Optional[Union[Tensor, List[int], Tuple[int, ...]]] = None,
    scale: Optional[float] = None,
    deterministic: bool = False,
    return_lse: bool = False,
    score_mod: Any = None,
    mask_mod: Any = None,
    mod_tensors: Optional[Dict[str, Any]] = None,
    block_map: Optional[BlockMap] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention ``softmax(scale * q k^T + bias) v``, differentiable in q, k and v.

    Parameters
    ----------
    q : Tensor, shape (B, H, Nq, D)
        Queries: float32, float16 or bfloat16, on a CUDA device or the CPU.
        Any strides; a last dimension that is not contiguous is copied.
    k, v : Tensor, shape (B, Hkv, Nk, D)
        Keys and values, same dtype and device as ``q``; ``Hkv`` divides
        ``H`` (grouped-query attention, as torch SDPA's ``enable_gqa``).
    causal : bool or {'top_left', 'bottom_right'}, optional
        As in :func:`pycudaflash.flash_attn_forward`.
    window : (left, right), optional
        Sliding window; ``None`` or ``-1`` leaves a side unbounded.
    mask : Tensor, optional
        Broadcastable to (B, H, Nq, Nk): bool (True = attend) or float (added
        to the scaled scores), on the device of ``q``.  Not differentiated.
    key_lengths : Tensor or sequence of int, optional
        Shape (B,): keys at or past ``key_lengths[b]`` are padding.  A CPU
        tensor or a list is checked to lie in [0, Nk]; a CUDA tensor is read
        by the kernels in place (no copy, no synchronisation), values outside
        [0, Nk] then count as the nearest end.
    scale : float, optional
        Score scale, default ``1/sqrt(D)``.
    deterministic : bool, optional
        Bit-identical gradients run to run (no atomics in the dQ reduction).
    return_lse : bool, optional
        Also return the natural-log log-sum-exp of each row, (B, H, Nq)
        float32 (``-inf`` for a row that sees no key).  It is not
        differentiable.
    score_mod, mask_mod, mod_tensors : optional
        Modifier expressions and the tensors they read, as in
        :func:`pycudaflash.flash_attn_forward`: with CUDA inputs the tensors
        are CUDA tensors of the same device (float32, int32 or bool, read in
        place) or CPU tensors (copied on every call); eagerly only, not under
        ``torch.compile``.
    block_map : pycudaflash.BlockMap, optional
        A bool mask and/or mask modifier whose block maps are kept on the
        GPU and reused by every call that passes it (each layer, each step):
        the call takes its mask, mask_mod and their tensors from it, as in
        :func:`pycudaflash.flash_attn_forward`.  Eagerly only.

    Returns
    -------
    out : Tensor, shape (B, H, Nq, D)
        In the dtype of ``q``; contiguous when ``q`` is, else a (B, Nq, H, D)
        tensor viewed as (B, H, Nq, D) (as torch SDPA's flash backend does),
        so that merging the heads back (``out.transpose(1, 2).reshape(...)``)
        is free.  The gradients follow the same rule for q, k and v.
    lse : Tensor, shape (B, H, Nq)
        Only with ``return_lse=True``.
    """
    try:
        opts = _options_memo[(causal, window, scale, q.shape[-1])]
    except (KeyError, TypeError, AttributeError, IndexError):
        opts = _options(q, causal, window, scale)
    if deterministic is not True and deterministic is not False:
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    # The common case first: plain tensors with rows of D contiguous elements, no mask or key
    # lengths, eagerly (each check here costs host time on every call); on CUDA with the C++
    # host path loaded, straight to the operator.
    if (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor and mask is None
            and key_lengths is None and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1):
        if (_cpp_serves and score_mod is None and mask_mod is None and mod_tensors is None and block_map is None
                and q.is_cuda and not _is_compiling()):
            out, lse = _flash_fwd_op(q, k, v, None, None, *opts, deterministic)
            return (out, lse) if return_lse else out
    else:
        q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    kl = None if key_lengths is None else _key_lengths_tensor(key_lengths)
    if score_mod is not None or mask_mod is not None or mod_tensors is not None or block_map is not None:
        mask, mask_mod, mod_tensors = blockmap.call_args(block_map, mask, mask_mod, mod_tensors)
        return _with_mods(q, k, v, mask, kl, opts, deterministic, return_lse,
                          dict(score_mod=score_mod, mask_mod=mask_mod, mod_tensors=mod_tensors, block_map=block_map))
    if _is_compiling() or not _plain(q, k, v, mask, kl) or (q.is_cuda and _cpp_loaded()):
        # (the operator: its autograd and CUDA kernels are C++ where the C++ host path is loaded)
        out, lse = torch.ops.pycudaflash.flash_fwd(q, k, v, mask, kl, *opts, deterministic)
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        if not return_lse:
            return _Attention.apply(q, k, v, mask, kl, opts, deterministic, False)
        out, lse = _Attention.apply(q, k, v, mask, kl, opts, deterministic, True)
    else:
        out, lse, _ = _forward_impl(q, k, v, mask, kl, opts, return_lse)
    return (out, lse) if return_lse else out


_is_compiling = torch.compiler.is_compiling
#: Whether the C++ host path has loaded (pycudaflash._fastpath), known once a CUDA call asked.
_cpp_serves = False


def _cpp_loaded() -> bool:
    """Whether the C++ host path serves CUDA calls (loading it on the first call)."""
    global _cpp_serves
    _cpp_serves = _fastpath.loaded()
    return _cpp_serves


def _with_mods(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], kl: Optional[Tensor],
               opts: Tuple[Any, ...], deterministic: bool, return_lse: bool, mods: Dict[str, Any]) -> Any:
    """A call with modifiers: eagerly through the autograd function (CUDA kernels or NumPy backend)."""
    if _is_compiling():
        raise ValueError("score_mod, mask_mod, mod_tensors and block_map do not run under torch.compile yet")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attention.apply(q, k, v, mask, kl, opts, deterministic, return_lse, mods)
    out, lse, _ = _forward_impl(q, k, v, mask, kl, opts, mods=mods)
    return (out, lse) if return_lse else out


# (causal, window, scale, head dim) -> normalised options (causal mode, left, right, scale)
_options_memo: Dict[Any, Tuple[str, int, int, float]] = {}


def _options(q: Any, causal: Any, window: Any, scale: Any) -> Tuple[str, int, int, float]:
    """The normalised options of a call (remembered when its arguments are hashable)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must have 4 dimensions (B, H, Nq, D), got shape {tuple(q.shape)}")
    causal_mode = normalize_causal(causal)
    left, right = normalize_window(window)
    opts = (causal_mode, left, right, normalize_scale(scale, q.shape[-1]))
    try:
        if len(_options_memo) < 4096:
            _options_memo[(causal, window, scale, q.shape[-1])] = opts
    except TypeError:  # (a window given as a list)
        pass
    return opts


def _last_dim_contiguous(t: Any) -> Any:
    """``t``, copied where its last dimension is strided (the kernels read rows of D elements)."""
    try:
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            return t.contiguous()
    except (AttributeError, IndexError, RuntimeError, TypeError):
        pass  # (not a tensor, or no dimensions: validation words the error)
    return t


def _key_lengths_tensor(key_lengths: Any) -> Optional[Tensor]:
    """Key lengths as an int32 tensor: CPU values as given (checked later), CUDA ones as int32."""
    if isinstance(key_lengths, (list, tuple)):
        key_lengths = torch.tensor(key_lengths)
    if not isinstance(key_lengths, torch.Tensor):
        raise TypeError(f"key_lengths must be a tensor, list or tuple of ints, got {type(key_lengths).__name__}")
    if key_lengths.is_floating_point() or key_lengths.is_complex() or key_lengths.dtype == torch.bool:
        raise TypeError(f"key_lengths must have an integer dtype, got {key_lengths.dtype}")
    if key_lengths.is_cuda and key_lengths.dtype != torch.int32:
        key_lengths = key_lengths.to(torch.int32)
    return key_lengths


_PLAIN = (torch.Tensor, torch.nn.Parameter, type(None))


def _plain(*tensors: Any) -> bool:
    """Plain tensors (no subclass such as fake tensors), or None."""
    for t in tensors:
        if type(t) not in _PLAIN:
            return False
    return True


# --------------------------------------------------------------- the passes


def _kl_key(kl: Optional[Tensor]) -> Any:
    """Key lengths in a signature: the CUDA tensor's layout, or ``'host'`` (values checked every call)."""
    if kl is None:
        return None
    return ("device", kl.shape, kl.stride()) if kl.is_cuda else "host"


def empty_like_layout(t: Tensor) -> Tensor:
    """A new tensor shaped like the (B, H, N, D) tensor ``t``: contiguous when ``t`` is, else
    (B, N, H, D) storage viewed as (B, H, N, D), the layout of q, k, v sliced from one
    projection, so that ``out.transpose(1, 2).reshape(B, N, H * D)`` needs no copy."""
    if t.is_contiguous():
        return torch.empty_like(t)  # (preserves the contiguous layout)
    B, H, N, D = t.shape
    return torch.empty_strided((B, H, N, D), (N * H * D, D, H * D, 1), dtype=t.dtype, device=t.device)


def _signature(kind: str, tensors: Tuple[Tensor, ...], mask: Optional[Tensor], kl: Optional[Tensor],
               opts: Tuple[Any, ...], ptrs: Tuple[int, ...], mods: Optional[Dict[str, Any]] = None) -> Tuple[Any, ...]:
    """The plan-cache key of a call on CUDA tensors (``pycudaflash._calls``).

    ``tensors`` are the inputs whose layout and device the caller chose (a
    tensor moved to another device is another signature, validated again); the outputs
    (:func:`empty_like_layout` of them) and the saved ``out`` and ``lse``
    follow from those.  Whether every pointer is 16-byte aligned is part of it,
    and so are the modifiers and their tensors' layouts (:func:`pycudaflash._calls.mods_key`).
    """
    low = 0
    for p in ptrs:
        low |= p
    q, k, v = tensors[0], tensors[1], tensors[2]
    key: Tuple[Any, ...] = (
        "torch", kind, opts, None if kl is None else _kl_key(kl), low & 15 == 0,
        q.get_device(), q.shape, q.stride(), q.dtype, k.get_device(), k.shape, k.stride(), k.dtype,
        v.get_device(), v.shape, v.stride(), v.dtype,
        None if mask is None else (mask.get_device(), mask.shape, mask.stride(), mask.dtype))
    for t in tensors[3:]:
        key += (t.get_device(), t.shape, t.stride(), t.dtype)
    if mods is not None:
        key += (_calls.mods_key(**mods),)
    return key


def _host_key_lengths(kl: Optional[Tensor]) -> Any:
    """What validation receives as key lengths: CPU values; None for CUDA ones (checked for shape only)."""
    if kl is None or kl.is_cuda:
        return None
    return kl.numpy()


def _pass_args(opts: Tuple[Any, ...], mask: Optional[Tensor], key_lengths: Any,
               mods: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The keyword arguments of the plain API (and of its validation) for a call's normalised
    options ``(causal, left, right, scale)``, mask, key lengths and modifiers."""
    causal, left, right, scale = opts
    return dict(causal=causal if causal != "none" else False, window=(left, right), mask=mask,
                key_lengths=key_lengths, scale=scale, **(mods or {}))


def _validated(kind: str, tensors: Tuple[Any, ...], mask: Optional[Tensor], kl: Optional[Tensor],
               opts: Tuple[Any, ...], deterministic: bool = False, mods: Optional[Dict[str, Any]] = None) -> Any:
    """The validated Problem of a CUDA call of pass ``kind``: ``tensors`` are the pass's inputs
    and outputs, for the forward ``(q, k, v, out, lse)``, for the backward ``(dout, q, k, v, out,
    lse, dq, dk, dv)``; key lengths on the device are checked for shape and device only."""
    if kind not in ("fwd", "bwd"):
        raise ValueError(f"kind must be 'fwd' or 'bwd', got {kind!r}")
    kw = _pass_args(opts, mask, _host_key_lengths(kl), mods)
    _check_device_key_lengths(kl, tensors[0 if kind == "fwd" else 1])  # (q)
    if kind == "fwd":
        q, k, v, out, lse = tensors
        return _validate.validate_forward(q, k, v, out=out, lse=lse, **kw)
    dout, q, k, v, out, lse, dq, dk, dv = tensors
    return _validate.validate_backward(dout, q, k, v, out, lse, deterministic=deterministic, dq=dq, dk=dk, dv=dv,
                                       **kw)


def _check_device_key_lengths(kl: Optional[Tensor], q: Tensor) -> None:
    if kl is None or not kl.is_cuda:
        return
    if tuple(kl.shape) != (q.shape[0],):
        raise ValueError(f"key_lengths must have shape (B,) = ({q.shape[0]},), got {tuple(kl.shape)}")
    if kl.device != q.device:
        raise ValueError(f"key_lengths is on {kl.device} but q is on {q.device}")


_raw_alloc = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc", None)
_raw_delete = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_delete", None)


def _launch(kind: str, key: Tuple[Any, ...], validate: Callable[[], Any], ptrs: Tuple[int, ...],
            kl: Optional[Tensor], q: Tensor, mods: Optional[Dict[str, Any]] = None) -> None:
    """Launch pass ``kind`` on torch's current stream: the plan of ``key``, made on first use from
    ``validate()``'s Problem.  ``ptrs``: the pass's operands (``cuda_backend.OPERANDS``), outputs
    included (a forward's lse may be 0: not stored); ``mods``: the modifier arguments (their
    tensors, the BlockMap)."""
    mods = mods or {}
    block_map = mods.get("block_map")
    hit = _calls.lookup(key)
    if hit is None:
        hit = _calls.remember(key, cuda_backend.plan(validate(), kind))
    plan, _, device, _ = hit
    vals = plan.values(ptrs)
    kl_host = None
    if kl is not None:
        if kl.is_cuda:
            vals[plan.KL] = kl.data_ptr()
        else:
            kl_host = _validate.host_key_lengths(kl.numpy(), plan.dims[0], plan.dims[3])
    mod_values = _calls.mod_values(plan, mods.get("mod_tensors"))
    stream = torch._C._cuda_getCurrentRawStream(device)
    ctx, pushed = _driver.enter(device)
    try:
        if not plan.ws_bytes:
            cuda_backend.launch_plan(plan, vals, ctx, stream, kl_host, 0, mod_values, block_map)
        elif torch._C._cuda_getDevice() == device:
            # The workspace comes from torch's caching allocator, ordered on this stream like the
            # launches: freed on return, reused by later work on the stream only (and taken from a
            # graph's private pool while the stream is captured).
            ws = _raw_alloc(plan.ws_bytes, stream)
            try:
                cuda_backend.launch_plan(plan, vals, ctx, stream, kl_host, ws, mod_values, block_map)
            finally:
                _raw_delete(ws)
        else:  # (the raw allocator serves torch's current device only)
            ws_tensor = q.new_empty((plan.ws_bytes,), dtype=torch.uint8)
            cuda_backend.launch_plan(plan, vals, ctx, stream, kl_host, ws_tensor.data_ptr(), mod_values, block_map)
    finally:
        _driver.leave(pushed)


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], kl: Optional[Tensor],
                  opts: Tuple[Any, ...], need_lse: bool = True,
                  mods: Optional[Dict[str, Any]] = None) -> Tuple[Tensor, Optional[Tensor], Any]:
    """Forward pass into new tensors: ``(out, lse, key)`` with ``out`` laid out by
    :func:`empty_like_layout`, ``lse`` contiguous (on CUDA, None and not stored unless
    ``need_lse``) and ``key`` the call's plan-cache key (None on the CPU), from which the eager
    backward derives its own.  ``mods``: the modifier arguments of the plain API."""
    out = empty_like_layout(q)
    if not q.is_cuda:
        from .api import flash_attn_forward

        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
        flash_attn_forward(q, k, v, out=out, lse=lse, backend="numpy", **_pass_args(opts, mask, kl, mods))
        return out, lse, None
    lse = q.new_empty(q.shape[:3], dtype=torch.float32) if need_lse else None
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0 if lse is None else lse.data_ptr(),
            0 if mask is None else mask.data_ptr())
    key = _signature("fwd", (q, k, v), mask, kl, opts, ptrs, mods)
    _launch("fwd", key, lambda: _validated("fwd", (q, k, v, out, lse), mask, kl, opts, mods=mods),
            ptrs, kl, q, mods)
    return out, lse, key


def _backward_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   mask: Optional[Tensor], kl: Optional[Tensor], opts: Tuple[Any, ...],
                   deterministic: bool, mods: Optional[Dict[str, Any]] = None,
                   fwd_key: Any = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward pass into new tensors laid out like q, k and v.

    ``fwd_key``: the plan-cache key of the forward call that made ``out`` and
    ``lse`` from these q, k, v, mask and key lengths (the eager autograd
    path).  It stands for their part of the backward's key, which then only
    adds what autograd leaves open: the strides of ``dout`` (its shape, dtype
    and device are those of ``out``) and the alignment of the new pointers.
    """
    dout = _last_dim_contiguous(dout)
    dq, dk, dv = empty_like_layout(q), empty_like_layout(k), empty_like_layout(v)
    if not q.is_cuda:
        from .api import flash_attn_backward

        flash_attn_backward(dout, q, k, v, out, lse, deterministic=deterministic, dq=dq, dk=dk, dv=dv,
                            backend="numpy", **_pass_args(opts, mask, kl, mods))
        return dq, dk, dv
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), dout.data_ptr(), lse.data_ptr(),
            dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), 0 if mask is None else mask.data_ptr())
    if fwd_key is None:
        key = _signature("bwd", (q, k, v, dout), mask, kl, opts + (deterministic,), ptrs, mods)
    else:
        key = ("torch-bwd-of", fwd_key, dout.stride(), (ptrs[4] | ptrs[6] | ptrs[7] | ptrs[8]) & 15 == 0,
               deterministic)
    _launch("bwd", key,
            lambda: _validated("bwd", (dout, q, k, v, out, lse, dq, dk, dv), mask, kl, opts, deterministic, mods),
            ptrs, kl, q, mods)
    return dq, dk, dv


# ------------------------------------------------------ eager autograd path


class _Attention(torch.autograd.Function):
    """Eager path: forward and backward call the implementations directly.  The forward returns
    ``out``, or ``(out, lse)`` when asked (lse is saved either way, and not differentiable)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], kl: Optional[Tensor],
                opts: Tuple[Any, ...], deterministic: bool, return_lse: bool,
                mods: Optional[Dict[str, Any]] = None) -> Any:
        out, lse, key = _forward_impl(q, k, v, mask, kl, opts, mods=mods)
        ctx.save_for_backward(q, k, v, out, lse, mask, kl)
        ctx.args = (opts, deterministic, mods, key)
        if not return_lse:
            return out
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, *_dlse: Any) -> Tuple[Any, ...]:
        q, k, v, out, lse, mask, kl = ctx.saved_tensors
        dq, dk, dv = _backward_impl(dout, q, k, v, out, lse, mask, kl, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


# ---------------------------------------------------------- custom operators
#
# Defined with torch.library.Library.  The Python kernels below are registered
# for CompositeExplicitAutograd (every device) and the autograd in Python for
# the Autograd alias key; where the C++ host path loads (pycudaflash._fastpath),
# it registers kernels for the CUDA and AutogradCUDA keys, which take
# precedence for CUDA tensors.  _flash_fwd_py / _flash_bwd_py are the Python
# kernels under their own names (the C++ kernels hand them the calls they do
# not serve), _fast_plan plans a signature for the C++ path.

_FWD_ARGS = ("Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? key_lengths, str causal, int window_left, "
             "int window_right, float scale, bool deterministic")
_BWD_ARGS = ("Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? mask, "
             "Tensor? key_lengths, str causal, int window_left, int window_right, float scale, bool deterministic")
_lib = torch.library.Library("pycudaflash", "DEF")
for _name in ("flash_fwd", "_flash_fwd_py"):
    _lib.define(f"{_name}({_FWD_ARGS}) -> (Tensor, Tensor)")
for _name in ("flash_bwd", "_flash_bwd_py"):
    _lib.define(f"{_name}({_BWD_ARGS}) -> (Tensor, Tensor, Tensor)")
_lib.define("_fast_plan(str kind, Tensor[] tensors, Tensor? mask, Tensor? key_lengths, str causal, "
            "int window_left, int window_right, float scale, bool deterministic, int stream) -> Tensor")


def flash_fwd(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], key_lengths: Optional[Tensor],
              causal: str, window_left: int, window_right: int, scale: float,
              deterministic: bool) -> Tuple[Tensor, Tensor]:
    """Forward operator: ``(out, lse)``; ``deterministic`` is kept for the backward."""
    return _forward_impl(q, k, v, mask, key_lengths, (causal, window_left, window_right, scale))[:2]


def flash_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: Optional[Tensor],
              key_lengths: Optional[Tensor], causal: str, window_left: int, window_right: int, scale: float,
              deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward operator: ``(dq, dk, dv)``."""
    return _backward_impl(dout, q, k, v, out, lse, mask, key_lengths, (causal, window_left, window_right, scale),
                          deterministic)


def _fast_plan(kind: str, tensors: List[Tensor], mask: Optional[Tensor], key_lengths: Optional[Tensor],
               causal: str, window_left: int, window_right: int, scale: float, deterministic: bool,
               stream: int) -> Tensor:
    """The plan of a CUDA call of pass ``kind`` for the C++ host path, validated in full on the
    call's tensors (``tensors``: the pass's inputs, then the outputs the C++ kernel allocated):
    the int64 words of :meth:`pycudaflash.cuda_backend._Plan.export`."""
    prob = _validated(kind, tuple(tensors), mask, key_lengths, (causal, window_left, window_right, scale),
                      deterministic)
    plan, ctx, _ = cuda_backend.plan(prob, kind)
    return torch.tensor(plan.export(ctx, stream), dtype=torch.int64)


for _name, _fn in (("flash_fwd", flash_fwd), ("_flash_fwd_py", flash_fwd), ("flash_bwd", flash_bwd),
                   ("_flash_bwd_py", flash_bwd)):
    _lib.impl(_name, _fn, "CompositeExplicitAutograd")
_lib.impl("_fast_plan", _fast_plan, "CUDA")


@torch.library.register_fake("pycudaflash::flash_fwd")
def _flash_fwd_fake(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], key_lengths: Optional[Tensor],
                    causal: str, window_left: int, window_right: int, scale: float,
                    deterministic: bool) -> Tuple[Tensor, Tensor]:
    if q.device.type == "cuda":
        _cpp_loaded()  # (traced for CUDA: the compiled graph's calls then take the C++ path)
    return empty_like_layout(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.register_fake("pycudaflash::flash_bwd")
def _flash_bwd_fake(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    mask: Optional[Tensor], key_lengths: Optional[Tensor], causal: str, window_left: int,
                    window_right: int, scale: float, deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    return empty_like_layout(q), empty_like_layout(k), empty_like_layout(v)


def _setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, Tensor]) -> None:
    q, k, v, mask, kl, causal, left, right, scale, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask, kl)
    ctx.args = (causal, left, right, scale, deterministic)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # (no zero-filled gradient of lse for the backward to ignore)


def _backward(ctx: Any, dout: Optional[Tensor], _dlse: Any) -> Tuple[Any, ...]:
    if dout is None:  # (out did not reach the loss)
        return (None,) * 10
    q, k, v, out, lse, mask, kl = ctx.saved_tensors
    dq, dk, dv = torch.ops.pycudaflash.flash_bwd(dout, q, k, v, out, lse, mask, kl, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


torch.library.register_autograd("pycudaflash::flash_fwd", _backward, setup_context=_setup_context)
_flash_fwd_op = torch.ops.pycudaflash.flash_fwd.default
