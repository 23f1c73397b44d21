"""Argument checking for the public API.

:func:`validate_forward` and :func:`validate_backward` turn the caller's
arguments into a :class:`~pycudaflash._problem.Problem`, raising ``TypeError``
(wrong kind of object or dtype) or ``ValueError`` (wrong shape, layout or
value) before any work starts.  Validation reads only array metadata and
addresses (an output buffer that overlaps an input or another output is
refused); the one exception is a ``key_lengths`` array that lives on the
device, which is copied to the host (:func:`_device_to_host`).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from . import blockmap, semantics
from ._arrays import (as_operand, broadcast_operand, byte_span, describe_kind, is_device_array, is_read_only,
                      overlaps, shares_memory)
from ._problem import Operand, Problem

__all__ = [
    "LSE_DTYPE",
    "MAX_HEAD_DIM",
    "SUPPORTED_DTYPES",
    "SUPPORTED_DTYPE_NAMES",
    "validate_backward",
    "validate_forward",
]


def _named_dtype(name: str) -> Optional[np.dtype]:
    """numpy dtype for a dtype name; ``None`` for bfloat16 when ml_dtypes is missing."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            return None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _build_dtype_table(names: Iterable[str]) -> Dict[np.dtype, str]:
    """Map each usable dtype in ``names`` to its name."""
    table: Dict[np.dtype, str] = {}
    for name in names:
        dtype = _named_dtype(name)
        if dtype is not None:
            table[dtype] = name
    return table


#: Names of the input dtypes (q, k, v, out, dout, dq, dk, dv) the kernels
#: accept.  bfloat16 host arrays are ``ml_dtypes.bfloat16`` numpy arrays (it is
#: only available when ml_dtypes is installed, a dependency of the package).
SUPPORTED_DTYPE_NAMES: Tuple[str, ...] = ("float32", "float16", "bfloat16")

#: ``numpy.dtype -> name`` for every supported input dtype.
SUPPORTED_DTYPES: Dict[np.dtype, str] = _build_dtype_table(SUPPORTED_DTYPE_NAMES)

#: dtype of the log-sum-exp array.
LSE_DTYPE = np.dtype(np.float32)

#: Largest supported head dimension D.
MAX_HEAD_DIM = 256

#: Mask dtypes accepted besides the input dtype itself (a float16 or bfloat16
#: bias is accepted with inputs of that dtype).
_MASK_DTYPES = (np.dtype(np.bool_), np.dtype(np.float32))


class _Dims(NamedTuple):
    """Problem sizes read from q and k."""

    B: int
    H: int
    Nq: int
    Nk: int
    D: int
    Hkv: int = 0  # heads of k and v (0: H)


# --------------------------------------------------------------------------
# public entry points
# --------------------------------------------------------------------------


def validate_forward(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: Any = False,
    window: Any = None,
    mask: Any = None,
    key_lengths: Any = None,
    scale: Any = None,
    out: Any = None,
    lse: Any = None,
    dtype: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
    mod_tensors: Any = None,
    block_map: Any = None,
) -> Problem:
    """Check the arguments of a forward call and describe it as a :class:`Problem`.

    Parameters
    ----------
    q, k, v : arrays
        Shapes (B, H, Nq, D) and (B, H, Nk, D); all numpy or all device arrays.
    causal, window, mask, key_lengths, scale
        As in :func:`pycudaflash.flash_attn_forward`.
    out, lse : arrays, optional
        Output buffers, (B, H, Nq, D) with q's dtype and (B, H, Nq) float32.
    dtype : str or dtype, optional
        As in :func:`pycudaflash.flash_attn_forward`: names the element type
        of opaque 2-byte device inputs, and must match q, k, v and out.

    Returns
    -------
    Problem
        With ``out``/``lse`` set to the buffers' operands (or None).

    Raises
    ------
    TypeError
        Unsupported objects or dtypes, mixed host and device arrays, an
        element type that cannot be identified or that contradicts ``dtype``.
    ValueError
        Bad shapes, layouts, alignments or argument values.
    """
    mask, mask_mod, mod_tensors = blockmap.call_args(block_map, mask, mask_mod, mod_tensors)
    explicit = _explicit_dtype(dtype)
    ops = _operands(q=q, k=k, v=v, out=out, lse=lse, mask=mask, opaque_dtype=explicit)
    _check_same_kind(ops)
    _check_ndim(ops, ("q", "k", "v", "out"))
    dims = _check_qkv_dims(ops["q"], ops["k"], ops["v"])
    dtype = _check_dtypes(ops, ("q", "k", "v", "out"), explicit)
    _check_shape(ops["out"], (dims.B, dims.H, dims.Nq, dims.D), "(B, H, Nq, D)", "q")
    _check_lse(ops["lse"], dims)
    _check_layouts(ops, ("q", "k", "v", "out", "lse"))
    _check_outputs(ops, ("out", "lse"))
    _check_no_aliasing(ops, ("out", "lse"), ("q", "k", "v", "mask"))
    return _make_problem(
        ops, dims, dtype, causal=causal, window=window, scale=scale,
        key_lengths=key_lengths, deterministic=False, opaque_dtype=explicit,
        mods=(score_mod, mask_mod, mod_tensors), outputs=("out", "lse"), block_map=block_map,
    )


def validate_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    *,
    causal: Any = False,
    window: Any = None,
    mask: Any = None,
    key_lengths: Any = None,
    scale: Any = None,
    deterministic: Any = False,
    dq: Any = None,
    dk: Any = None,
    dv: Any = None,
    dtype: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
    mod_tensors: Any = None,
    block_map: Any = None,
) -> Problem:
    """Check the arguments of a backward call and describe it as a :class:`Problem`.

    Parameters
    ----------
    dout : array, shape (B, H, Nq, D)
        Gradient with respect to the forward output.
    q, k, v : arrays
        The forward inputs.
    out, lse : arrays
        The forward results (required inputs here), (B, H, Nq, D) and
        (B, H, Nq) float32.
    causal, window, mask, key_lengths, scale
        As in :func:`pycudaflash.flash_attn_backward`.
    deterministic : bool
        Passed through to the problem.
    dq, dk, dv : arrays, optional
        Output buffers shaped like q, k and v.
    dtype : str or dtype, optional
        As in :func:`pycudaflash.flash_attn_backward`: names the element type
        of opaque 2-byte device inputs, and must match dout, q, k, v, out, dq,
        dk and dv.

    Returns
    -------
    Problem
        With ``out``/``lse`` the saved forward results, ``dout`` set and
        ``dq``/``dk``/``dv`` the buffers' operands (or None).

    Raises
    ------
    TypeError
        Unsupported objects or dtypes, mixed host and device arrays, a
        non-bool ``deterministic``, an element type that cannot be identified
        or that contradicts ``dtype``.
    ValueError
        Bad shapes, layouts, alignments or argument values.
    """
    mask, mask_mod, mod_tensors = blockmap.call_args(block_map, mask, mask_mod, mod_tensors)
    explicit = _explicit_dtype(dtype)
    ops = _operands(
        dout=dout, q=q, k=k, v=v, out=out, lse=lse, dq=dq, dk=dk, dv=dv, mask=mask,
        required=("dout", "q", "k", "v", "out", "lse"), opaque_dtype=explicit,
    )
    _check_same_kind(ops)
    _check_ndim(ops, ("q", "k", "v", "dout", "out", "dq", "dk", "dv"))
    dims = _check_qkv_dims(ops["q"], ops["k"], ops["v"])
    dtype = _check_dtypes(ops, ("q", "k", "v", "out", "dout", "dq", "dk", "dv"), explicit)
    q_shape = (dims.B, dims.H, dims.Nq, dims.D)
    k_shape = (dims.B, dims.Hkv, dims.Nk, dims.D)
    for name in ("dout", "out", "dq"):
        _check_shape(ops[name], q_shape, "(B, H, Nq, D)", "q")
    for name in ("dk", "dv"):
        _check_shape(ops[name], k_shape, "(B, Hkv, Nk, D)", "k")
    _check_lse(ops["lse"], dims)
    _check_layouts(ops, ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv"))
    _check_outputs(ops, ("dq", "dk", "dv"))
    _check_no_aliasing(ops, ("dq", "dk", "dv"), ("dout", "q", "k", "v", "out", "lse", "mask"))
    return _make_problem(
        ops, dims, dtype, causal=causal, window=window, scale=scale,
        key_lengths=key_lengths, deterministic=deterministic, opaque_dtype=explicit,
        mods=(score_mod, mask_mod, mod_tensors), outputs=("dq", "dk", "dv"), block_map=block_map,
    )


# --------------------------------------------------------------------------
# operands: kinds, shapes, dtypes, layouts
# --------------------------------------------------------------------------


def _explicit_dtype(dtype: Any) -> Optional[np.dtype]:
    """The supported numpy dtype named by the ``dtype=`` keyword (None when absent).

    Accepts a name (``'bfloat16'``), a numpy dtype or scalar type
    (``np.float16``, ``ml_dtypes.bfloat16``) or a torch dtype
    (``torch.bfloat16``, recognised by its name without importing torch).
    """
    if dtype is None:
        return None
    supported = ", ".join(repr(name) for name in SUPPORTED_DTYPE_NAMES)
    name: Optional[str] = None
    if isinstance(dtype, str):
        name = dtype[len("torch."):] if dtype.startswith("torch.") else dtype
    elif type(dtype).__module__.startswith("torch"):
        name = str(dtype).rpartition(".")[2]
    if name is not None and name in SUPPORTED_DTYPE_NAMES:
        resolved = _named_dtype(name)
    else:
        try:
            resolved = np.dtype(dtype if name is None else name)
        except (TypeError, ValueError):
            resolved = None
    if resolved is None or resolved not in SUPPORTED_DTYPES:
        if name == "bfloat16":
            raise TypeError("dtype='bfloat16' needs ml_dtypes: pip install ml_dtypes")
        raise TypeError(f"dtype must be None or one of {supported}, got {dtype!r}")
    return resolved


def _operands(
    required: Sequence[str] = ("q", "k", "v"),
    opaque_dtype: Optional[np.dtype] = None,
    **arrays: Any,
) -> Dict[str, Optional[Operand]]:
    """Operands for the given arrays (``None`` stays ``None`` unless required)."""
    ops: Dict[str, Optional[Operand]] = {}
    for name, obj in arrays.items():
        if obj is None and name not in required:
            ops[name] = None
            continue
        ops[name] = as_operand(obj, name, opaque_dtype)
    return ops


def _present(ops: Dict[str, Optional[Operand]], names: Iterable[str]) -> Iterable[Operand]:
    """The operands among ``names`` that were given."""
    return [ops[name] for name in names if ops.get(name) is not None]


def _check_same_kind(ops: Dict[str, Optional[Operand]]) -> None:
    """All array operands (inputs, outputs, mask) must be host, or all device."""
    ref = ops["q"]
    for op in _present(ops, ops):
        if op.kind != ref.kind:
            names = ", ".join(name for name in ops)
            raise TypeError(
                f"{op.name} is {describe_kind(op)} but q is {describe_kind(ref)}; "
                f"{names} must all be numpy arrays or all device arrays "
                "(output buffers must be the same kind as the inputs)"
            )


def _check_ndim(ops: Dict[str, Optional[Operand]], names: Sequence[str]) -> None:
    """The 4-D tensors must have exactly 4 dimensions."""
    for op in _present(ops, names):
        if len(op.shape) != 4:
            layout = "(B, H, Nk, D)" if op.name in ("k", "v", "dk", "dv") else "(B, H, Nq, D)"
            raise ValueError(
                f"{op.name} must have 4 dimensions {layout}, got {len(op.shape)} "
                f"(shape {op.shape})"
            )


def _check_qkv_dims(q: Operand, k: Operand, v: Operand) -> _Dims:
    """Read (B, H, Nq, Nk, D, Hkv) and check that q, k and v agree."""
    B, H, Nq, D = q.shape
    for op in (k, v):
        for axis, label in ((0, "batch size B"), (3, "head dimension D")):
            if op.shape[axis] != q.shape[axis]:
                raise ValueError(
                    f"{op.name} has {label} = {op.shape[axis]} but q has {q.shape[axis]} "
                    f"(q shape {q.shape}, {op.name} shape {op.shape})"
                )
    Nk = k.shape[2]
    if v.shape[2] != Nk:
        raise ValueError(
            f"k and v must have the same number of keys Nk, got {Nk} and {v.shape[2]} "
            f"(k shape {k.shape}, v shape {v.shape})"
        )
    dims = _Dims(B=B, H=H, Nq=Nq, Nk=Nk, D=D, Hkv=k.shape[1])
    for label, size in dims._asdict().items():
        if size == 0:
            raise ValueError(
                f"{label} must be at least 1, got 0 (q shape {q.shape}, k shape {k.shape})"
            )
    for op in (k, v):
        if op.shape[1] < 1 or H % op.shape[1]:
            raise ValueError(
                f"{op.name} has {op.shape[1]} heads, which must divide the {H} heads of q "
                f"(q shape {q.shape}, {op.name} shape {op.shape})"
            )
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same number of heads, got {k.shape[1]} and {v.shape[1]}")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head dimension D must be at most {MAX_HEAD_DIM}, got {D}")
    return dims


def _dtype_name(dtype: np.dtype) -> str:
    """Readable dtype name ('float32', 'bfloat16', or '>f4' for a non-native byte order)."""
    if dtype in SUPPORTED_DTYPES:
        return SUPPORTED_DTYPES[dtype]
    return dtype.name if dtype.isnative and dtype.type is not np.void else dtype.str


def _check_dtypes(
    ops: Dict[str, Optional[Operand]], names: Sequence[str], explicit: Optional[np.dtype] = None
) -> np.dtype:
    """q's dtype must be supported and shared by every operand in ``names``.

    With an ``explicit`` dtype (the ``dtype=`` keyword) every operand in
    ``names`` must have exactly that dtype.
    """
    q = ops["q"]
    if explicit is not None:
        label = SUPPORTED_DTYPES[explicit]
        for op in _present(ops, names):
            if op.dtype != explicit:
                raise TypeError(
                    f"{op.name} has dtype {_dtype_name(op.dtype)} but dtype={label!r} was "
                    f"given; {', '.join(names)} must all have the dtype that dtype= names"
                )
    if q.dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(SUPPORTED_DTYPES.values())
        raise TypeError(
            f"q has dtype {_dtype_name(q.dtype)}, which is not supported; "
            f"supported dtypes: {supported}"
        )
    for op in _present(ops, names):
        if op.dtype != q.dtype:
            raise TypeError(
                f"{op.name} has dtype {_dtype_name(op.dtype)} but q has {_dtype_name(q.dtype)}; "
                f"{', '.join(names)} must all have the same dtype"
            )
    return q.dtype


def _check_shape(op: Optional[Operand], shape: Tuple[int, ...], layout: str, like: str) -> None:
    """``op`` (if given) must have exactly ``shape``."""
    if op is not None and op.shape != shape:
        raise ValueError(
            f"{op.name} must have shape {layout} = {shape} like {like}, got {op.shape}"
        )


def _check_lse(op: Optional[Operand], dims: _Dims) -> None:
    """``lse`` (if given) must be float32 of shape (B, H, Nq)."""
    if op is None:
        return
    shape = (dims.B, dims.H, dims.Nq)
    if op.shape != shape:
        raise ValueError(f"lse must have shape (B, H, Nq) = {shape}, got {op.shape}")
    if op.dtype != LSE_DTYPE:
        raise TypeError(f"lse must have dtype float32, got {_dtype_name(op.dtype)}")


def _check_layouts(ops: Dict[str, Optional[Operand]], names: Sequence[str]) -> None:
    """Non-negative strides, contiguous last dimension, aligned device pointer."""
    for op in _present(ops, names):
        _check_nonnegative_strides(op)
        _check_last_dim_contiguous(op)
        _check_aligned(op)


def _check_nonnegative_strides(op: Operand) -> None:
    """Strides of dimensions longer than 1 must not be negative."""
    for axis, (size, stride) in enumerate(zip(op.shape, op.strides)):
        if size > 1 and stride < 0:
            raise ValueError(
                f"{op.name} has a negative stride ({stride} elements) along dimension {axis}; "
                f"negative strides are not supported (strides {op.strides}), pass a copy"
            )


def _check_last_dim_contiguous(op: Operand) -> None:
    """The last dimension must have stride 1 (trivially true when its size is 1)."""
    if op.shape and op.shape[-1] > 1 and op.strides[-1] != 1:
        raise ValueError(
            f"{op.name} must be contiguous in its last dimension (stride 1), got stride "
            f"{op.strides[-1]} elements (shape {op.shape}, strides {op.strides})"
        )


def _check_aligned(op: Operand) -> None:
    """A device pointer must be a multiple of the element size."""
    itemsize = op.dtype.itemsize
    if op.on_device and itemsize > 0 and op.ptr % itemsize != 0:
        raise ValueError(
            f"{op.name} device pointer {op.ptr:#x} is not aligned to its element size "
            f"of {itemsize} bytes"
        )


def _check_outputs(ops: Dict[str, Optional[Operand]], names: Sequence[str]) -> None:
    """Output buffers must be writable and must not repeat elements (stride 0)."""
    for op in _present(ops, names):
        if is_read_only(op):
            raise ValueError(f"output buffer {op.name} is read-only")
        for axis, (size, stride) in enumerate(zip(op.shape, op.strides)):
            if size > 1 and stride == 0:
                raise ValueError(
                    f"output buffer {op.name} has stride 0 along dimension {axis}, so its "
                    f"elements overlap (shape {op.shape}, strides {op.strides})"
                )


def _check_no_aliasing(
    ops: Dict[str, Optional[Operand]], outputs: Sequence[str], inputs: Sequence[str]
) -> None:
    """No output buffer may share memory with an input or with another output."""
    outs = list(_present(ops, outputs))
    others = list(_present(ops, inputs))
    for i, op in enumerate(outs):
        for other in outs[:i] + others:
            if overlaps(op, other):
                raise ValueError(
                    f"output buffer {op.name} overlaps {other.name}: outputs must not share memory "
                    "with the inputs or with each other"
                )


# --------------------------------------------------------------------------
# options, mask, key lengths, and the Problem itself
# --------------------------------------------------------------------------


def _make_problem(
    ops: Dict[str, Optional[Operand]],
    dims: _Dims,
    dtype: np.dtype,
    *,
    causal: Any,
    window: Any,
    scale: Any,
    key_lengths: Any,
    deterministic: Any,
    opaque_dtype: Optional[np.dtype] = None,
    mods: Tuple[Any, Any, Any] = (None, None, None),
    outputs: Sequence[str] = (),
    block_map: Any = None,
) -> Problem:
    """Check the non-array options and assemble the :class:`Problem` (``outputs``: the
    call's output buffers, which no modifier tensor may overlap)."""
    causal_mode = semantics.normalize_causal(causal)
    left, right = semantics.normalize_window(window)
    scale_value = _normalize_scale(scale, dims.D)
    deterministic = _check_deterministic(deterministic)
    mask_op, mask_kind = _check_mask(ops["mask"], dims, dtype)
    lengths = _check_key_lengths(key_lengths, dims, opaque_dtype)
    q = ops["q"]
    score_mod, mask_mod, tensors = _check_mods(*mods, on_device=q.on_device)
    _check_mod_tensors_apart(ops, outputs, tensors)
    return Problem(
        B=dims.B, H=dims.H, Nq=dims.Nq, Nk=dims.Nk, D=dims.D, dtype=dtype,
        scale=scale_value, causal=causal_mode, window_left=left, window_right=right,
        band=semantics.band(dims.Nq, dims.Nk, causal_mode, left, right),
        on_device=q.on_device, q=q, k=ops["k"], v=ops["v"],
        out=ops.get("out"), lse=ops.get("lse"), mask=mask_op, mask_kind=mask_kind,
        key_lengths=lengths, dout=ops.get("dout"), dq=ops.get("dq"), dk=ops.get("dk"),
        dv=ops.get("dv"), deterministic=deterministic, Hkv=dims.Hkv, score_mod=score_mod,
        mask_mod=mask_mod, mod_tensors=tensors, block_map=block_map if q.on_device else None,
    )


def _check_mods(score_mod: Any, mask_mod: Any, mod_tensors: Any, on_device: bool = False
                ) -> Tuple[Any, Any, Optional[dict]]:
    """The modifiers as :class:`pycudaflash.mods.Modifier` objects and their tensors: host arrays as
    given for a host call; for a device call, device arrays (float32, int32 or bool, on the
    call's device) as :class:`Operand` and host arrays in those types (:func:`kernel_array`)."""
    if mod_tensors is not None and not isinstance(mod_tensors, Mapping):
        raise TypeError(f"mod_tensors must be a mapping of names to arrays, got {type(mod_tensors).__name__}")
    if score_mod is None and mask_mod is None:
        if mod_tensors:
            raise ValueError("mod_tensors given without a score_mod or mask_mod")
        return None, None, None
    from .mods import Modifier, tensor_signature

    described, tensors = {}, {}
    for name, t in (mod_tensors or {}).items():
        if getattr(t, "__cuda_array_interface__", None) is not None or getattr(t, "is_cuda", False):
            if not on_device:
                raise TypeError(f"mod_tensors[{name!r}] is a device array but q, k and v are host arrays")
            described[name] = tensors[name] = _device_mod_tensor(name, t)
        else:
            described[name] = np.asarray(t)
        shape = described[name].shape
        if any(int(n) < 1 for n in shape):
            raise ValueError(f"mod_tensors[{name!r}] has an empty dimension: shape {tuple(shape)}")
        if on_device:
            # (a host tensor is copied contiguous: it spans all its elements; checked before the copy)
            t = described[name]
            span = byte_span(shape, t.strides, 1) if isinstance(t, Operand) else int(np.prod(shape, dtype=object))
            if span > MOD_SPAN_MAX:
                raise ValueError(f"mod_tensors[{name!r}] spans {span} elements; the kernels address a modifier "
                                 f"tensor with 32-bit offsets (at most {MOD_SPAN_MAX} elements)")
        if name not in tensors:
            tensors[name] = kernel_array(name, described[name]) if on_device else described[name]
    out = []
    for m, role in ((score_mod, "score"), (mask_mod, "mask")):
        if m is None:
            out.append(None)
        elif isinstance(m, Modifier):
            if m.role != role:
                raise ValueError(f"a {m.role}_mod was given as {role}_mod")
            missing = set(m.signature) - set(tensors)
            if missing:
                raise ValueError(f"{role}_mod reads mod_tensors {sorted(missing)}, which were not given")
            for name, want in m.signature.items():
                got = tensor_signature(name, described[name])
                if got != want:
                    raise ValueError(f"{role}_mod was made for mod_tensors[{name!r}] of kind and dimensions {want}, "
                                     f"given {got}")
            out.append(m)
        elif isinstance(m, str):
            out.append(Modifier(m, described, role))
        else:
            raise TypeError(f"{role}_mod must be a string expression or a Modifier, got {type(m).__name__}")
    return out[0], out[1], tensors


#: Elements a device modifier tensor may span (the kernels' offsets are 32-bit ints).
MOD_SPAN_MAX = 2**31 - 1


def _check_mod_tensors_apart(ops: Dict[str, Optional[Operand]], outputs: Sequence[str],
                             tensors: Optional[dict]) -> None:
    """No output buffer may share memory with a modifier tensor (an input like the others)."""
    for name, t in (tensors or {}).items():
        for op in _present(ops, outputs):
            if overlaps(op, t) if isinstance(t, Operand) else (op.kind == "host" and shares_memory(op.array, t)):
                raise ValueError(f"output buffer {op.name} overlaps mod_tensors[{name!r}]: outputs must not share "
                                 "memory with the inputs or with each other")


#: Element type of each kind of modifier tensor in the kernels (pycudaflash.mods.tensor_kind).
_KERNEL_DTYPES = {"float": np.dtype(np.float32), "int": np.dtype(np.int32), "bool": np.dtype(np.bool_)}


def kernel_dtype(dtype: Any) -> np.dtype:
    """The element type the kernels read a modifier tensor of ``dtype`` in: float32, int32 or bool."""
    from .mods import tensor_kind

    return _KERNEL_DTYPES[tensor_kind(dtype)]


def kernel_array(name: str, a: Any) -> np.ndarray:
    """A host modifier tensor as the kernels read it: C-contiguous float32, int32 or bool (ints
    must fit int32)."""
    a = np.asarray(a)
    want = kernel_dtype(a.dtype)
    if want == np.int32 and a.dtype != np.int32 and a.size and (a.min() < -2**31 or a.max() >= 2**31):
        raise ValueError(f"mod_tensors[{name!r}]: the kernels read ints as int32, and its values do not fit")
    return np.ascontiguousarray(a, dtype=want)


def _device_mod_tensor(name: str, t: Any) -> Operand:
    """A device modifier tensor as an :class:`Operand`: float32, int32 or bool, strides >= 0."""
    label = f"mod_tensors[{name!r}]"
    op = as_operand(t, label)
    if op.dtype not in _KERNEL_DTYPES.values():
        raise TypeError(f"{label}: device tensors must be float32, int32 or bool (the kernels read them in place), "
                        f"got {op.dtype}")
    if any(s < 0 for s in op.strides):
        raise ValueError(f"{label} has a negative stride {op.strides}")
    return op


def _normalize_scale(scale: Any, head_dim: int) -> float:
    """:func:`semantics.normalize_scale`, also rejecting strings such as ``'0.5'``."""
    if isinstance(scale, (str, bytes)):
        raise TypeError(f"scale must be a real number, got {scale!r}")
    return semantics.normalize_scale(scale, head_dim)


def _check_deterministic(deterministic: Any) -> bool:
    """``deterministic`` must be a bool."""
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(
            f"deterministic must be a bool, got {type(deterministic).__name__} ({deterministic!r})"
        )
    return bool(deterministic)


def _check_mask(
    op: Optional[Operand], dims: _Dims, dtype: np.dtype
) -> Tuple[Optional[Operand], str]:
    """Mask dtype, broadcastability and layout; returns the broadcast operand and its kind."""
    if op is None:
        return None, "none"
    allowed = _MASK_DTYPES + ((dtype,) if dtype not in _MASK_DTYPES else ())
    if op.dtype not in allowed:
        names = ", ".join(_dtype_name(d) for d in allowed)
        raise TypeError(f"mask must have dtype {names}, got {_dtype_name(op.dtype)}")
    shape4 = (dims.B, dims.H, dims.Nq, dims.Nk)
    broadcast = broadcast_operand(op, shape4)
    _check_nonnegative_strides(op)
    _check_aligned(op)
    kind = "bool" if op.dtype == np.bool_ else "float"
    return broadcast, kind


def _check_key_lengths(
    obj: Any, dims: _Dims, opaque_dtype: Optional[np.dtype] = None
) -> Optional[np.ndarray]:
    """Validated host int32 copy of ``key_lengths`` (shape (B,), values in [0, Nk])."""
    if obj is None:
        return None
    if isinstance(obj, (list, tuple)):
        lengths = _sequence_to_array(obj)
    elif isinstance(obj, np.ndarray):
        lengths = obj
    elif is_device_array(obj):
        op = as_operand(obj, "key_lengths", opaque_dtype)
        _check_key_lengths_meta(op.shape, op.dtype, dims)
        _check_nonnegative_strides(op)
        _check_aligned(op)
        lengths = _device_to_host(op)
    else:
        raise TypeError(
            "key_lengths must be a list, tuple, numpy array or device array of integers, "
            f"got {type(obj).__name__}"
        )
    _check_key_lengths_meta(lengths.shape, lengths.dtype, dims)
    _check_key_lengths_values(lengths, dims.Nk)
    return np.ascontiguousarray(lengths, dtype=np.int32)


def host_key_lengths(obj: Any, B: int, Nk: int) -> np.ndarray:
    """Host key lengths (list, tuple or numpy array) checked for a (B, Nk) problem, as int32.

    The per-call check of a repeated call whose plan is already made.
    """
    dims = _Dims(B=B, H=1, Nq=1, Nk=Nk, D=1)
    if isinstance(obj, (list, tuple)):
        obj = _sequence_to_array(obj)
    if not isinstance(obj, np.ndarray):
        raise TypeError(f"key_lengths must be a list, tuple or numpy array here, got {type(obj).__name__}")
    _check_key_lengths_meta(obj.shape, obj.dtype, dims)
    _check_key_lengths_values(obj, Nk)
    return np.ascontiguousarray(obj, dtype=np.int32)


def _sequence_to_array(values: Sequence[Any]) -> np.ndarray:
    """``np.asarray`` of a list/tuple of key lengths; ragged input raises ValueError."""
    try:
        return np.asarray(values)
    except ValueError:
        raise ValueError(
            f"key_lengths must be a flat sequence of integers, got {values!r}"
        ) from None


def _check_key_lengths_meta(shape: Tuple[int, ...], dtype: np.dtype, dims: _Dims) -> None:
    """``key_lengths`` must be an integer array of shape (B,)."""
    if tuple(shape) != (dims.B,):
        raise ValueError(f"key_lengths must have shape (B,) = ({dims.B},), got {tuple(shape)}")
    if dtype.kind not in ("i", "u"):
        raise TypeError(f"key_lengths must have an integer dtype, got {_dtype_name(dtype)}")


def _check_key_lengths_values(lengths: np.ndarray, nk: int) -> None:
    """Every key length must lie in [0, Nk]."""
    bad = np.flatnonzero((lengths < 0) | (lengths > nk))
    if bad.size:
        b = int(bad[0])
        raise ValueError(
            f"key_lengths values must lie in [0, Nk] = [0, {nk}], got key_lengths[{b}] = "
            f"{int(lengths[b])}"
        )


def _device_to_host(op: Operand) -> np.ndarray:
    """Copy a (small) device operand to a new host array.

    The copy runs in the operand's context (see
    :func:`pycudaflash._driver.enter`), which is popped again afterwards.

    Parameters
    ----------
    op : Operand
        Device operand with non-negative strides.

    Returns
    -------
    numpy.ndarray
        C-contiguous copy with ``op.shape`` and ``op.dtype``.

    Raises
    ------
    RuntimeError
        If the CUDA backend is unusable here.
    """
    if any(size == 0 for size in op.shape):
        return np.empty(op.shape, dtype=op.dtype)
    from . import _driver
    from ._backends import cuda_status

    usable, reason = cuda_status()
    if not usable:
        raise RuntimeError(f"copying device {op.name} to the host needs the CUDA backend: {reason}")
    from .cuda_backend import _device_hint

    span = 1 + sum((size - 1) * stride for size, stride in zip(op.shape, op.strides))
    flat = np.empty(span, dtype=op.dtype)
    ctx, pushed = _driver.enter(_device_hint(op.obj))
    try:
        _driver.check("cuMemcpyDtoH", flat.ctypes.data, op.ptr, flat.nbytes)
    finally:
        _driver.leave(pushed)
    itemsize = op.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(
        flat, shape=op.shape, strides=tuple(stride * itemsize for stride in op.strides)
    )
    return np.array(view)
