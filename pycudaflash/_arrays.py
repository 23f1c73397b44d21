"""Uniform descriptions (:class:`~pycudaflash._problem.Operand`) of array arguments.

Two kinds of arrays are understood, without importing torch or cupy:

* ``numpy.ndarray``: a *host* operand; its numpy view is kept in ``array``.
* any object exposing ``__cuda_array_interface__`` (pycuda ``GPUArray``,
  torch and cupy CUDA tensors): a *device* operand described by its pointer,
  shape, strides and dtype.  Nothing is read from device memory here.
  A CUDA torch tensor (when torch is already imported) is read through its
  own accessors instead (``data_ptr``, ``stride``, ``dtype``): the same facts
  at a fraction of the cost of building its array interface, which matters
  when a call's kernels take only a few hundred microseconds.

Strides are always given in elements; a byte stride that is not a multiple
of the item size is rejected.

Opaque element types
--------------------
``__cuda_array_interface__`` has no type string for bfloat16: torch exports
it as ``'<V2'``, an opaque 2-byte type that could just as well be float16 or
int16.  Such an element type is never guessed.  It is identified, in this
order, by

1. the object's ``__dlpack__`` capsule (torch and cupy have one), whose
   ``DLDataType`` names the type (:func:`dlpack_dtype`);
2. the object's own numpy ``dtype`` attribute, where it names a type of that
   item size (a PyCUDA ``GPUArray`` of ``ml_dtypes.bfloat16``, such as the
   outputs this library returns);
3. an explicit dtype given by the caller (the ``dtype=`` keyword of the
   public API), which must have the same item size.

Without either, the operand is rejected with a ``TypeError`` that says how
to name the type.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import replace
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from ._problem import Operand

__all__ = [
    "as_operand",
    "broadcast_operand",
    "describe_kind",
    "dlpack_dtype",
    "is_device_array",
    "is_read_only",
]


def _detached_view(obj: Any) -> Any:
    """``obj.detach()`` when that view exposes ``__cuda_array_interface__`` (torch
    tensors that require grad refuse to export themselves), else None."""
    detach = getattr(obj, "detach", None)
    if not callable(detach):
        return None
    try:
        view = detach()
    except Exception:
        return None
    return view if view is not obj and is_device_array(view) else None


def is_device_array(obj: Any) -> bool:
    """Whether ``obj`` exposes a usable ``__cuda_array_interface__``.

    Parameters
    ----------
    obj : object
        Any object.

    Returns
    -------
    bool
        True when reading the attribute succeeds (a torch CPU tensor, for
        example, raises on access and therefore counts as not a device array).
    """
    return _interface(obj) is not None


def _interface(obj: Any) -> Any:
    """``obj.__cuda_array_interface__``, or None where reading it fails or it is absent."""
    try:
        return getattr(obj, "__cuda_array_interface__", None)
    except Exception:
        return None


def as_operand(obj: Any, name: str, opaque_dtype: Optional[np.dtype] = None) -> Operand:
    """Describe a numpy array or a CUDA array-interface object as an :class:`Operand`.

    Parameters
    ----------
    obj : numpy.ndarray or object with ``__cuda_array_interface__``
        The caller's array.
    name : str
        Argument name, used in error messages.
    opaque_dtype : numpy.dtype, optional
        Element type of a device array whose ``__cuda_array_interface__``
        type string is opaque (``'<V2'``) and that has no ``__dlpack__`` to
        identify it; it must have the opaque type's item size.  Ignored for
        every other array.

    Returns
    -------
    Operand
        ``kind='host'`` with ``array`` set for numpy arrays, ``kind='device'``
        with ``ptr`` set for device arrays; strides in elements.

    Raises
    ------
    TypeError
        If ``obj`` is neither kind of array, or its element type cannot be
        identified (see the module docstring).
    ValueError
        If a byte stride is not a multiple of the item size.
    """
    if isinstance(obj, np.ndarray):
        return _host_operand(obj, name)
    op = _torch_operand(obj, name)
    if op is not None:
        return op
    iface = _interface(obj)
    if iface is not None:
        return _device_operand(obj, iface, name, opaque_dtype)
    view = _detached_view(obj)
    if view is not None:
        # A tensor that requires grad exports nothing; its detached view is the same memory.
        return replace(_device_operand(view, _interface(view), name, opaque_dtype), obj=obj)
    raise TypeError(
        f"{name} must be a numpy.ndarray or an object exposing __cuda_array_interface__ "
        f"(pycuda GPUArray, torch or cupy CUDA tensor), got {type(obj).__name__}"
    )


def is_read_only(op: Operand) -> bool:
    """Whether the caller's array is marked read-only.

    Parameters
    ----------
    op : Operand
        A host or device operand made by :func:`as_operand`.

    Returns
    -------
    bool
        ``not array.flags.writeable`` for host operands; the read-only flag
        of ``__cuda_array_interface__['data']`` for device operands.
    """
    if op.kind == "host":
        return not op.array.flags.writeable
    return op.read_only


def broadcast_operand(op: Operand, shape4: Sequence[int]) -> Operand:
    """Broadcast an operand (a mask) to ``shape4`` with numpy's rules.

    Dimensions are right-aligned; missing dimensions and size-1 dimensions
    that must grow get stride 0.

    Parameters
    ----------
    op : Operand
        Operand with at most ``len(shape4)`` dimensions.
    shape4 : sequence of int
        Target shape, normally ``(B, H, Nq, Nk)``.

    Returns
    -------
    Operand
        Same pointer and dtype, the target shape and the broadcast strides;
        for host operands ``array`` is the ``np.broadcast_to`` view.

    Raises
    ------
    ValueError
        If the shapes are not broadcast-compatible.
    """
    target = tuple(int(n) for n in shape4)
    strides = _broadcast_strides(op.shape, op.strides, target, op.name)
    array = None
    if op.kind == "host":
        array = np.broadcast_to(op.array, target)
        strides = _element_strides(array.strides, array.dtype.itemsize, array.shape, op.name)
    return Operand(
        name=op.name, kind=op.kind, obj=op.obj, shape=target, strides=strides,
        dtype=op.dtype, ptr=op.ptr, array=array,
    )


def _broadcast_strides(
    shape: Tuple[int, ...], strides: Tuple[int, ...], target: Tuple[int, ...], name: str
) -> Tuple[int, ...]:
    """Element strides of ``shape``/``strides`` broadcast to ``target``."""
    lead = len(target) - len(shape)
    if lead < 0:
        raise _not_broadcastable(name, shape, target)
    out = []
    for axis, size in enumerate(target):
        src = axis - lead
        if src < 0:
            out.append(0)
        elif shape[src] == size:
            out.append(strides[src])
        elif shape[src] == 1:
            out.append(0)
        else:
            raise _not_broadcastable(name, shape, target)
    return tuple(out)


def _not_broadcastable(name: str, shape: Tuple[int, ...], target: Tuple[int, ...]) -> ValueError:
    """The error for a shape that cannot be broadcast to ``target``."""
    return ValueError(
        f"{name} of shape {tuple(shape)} is not broadcastable to (B, H, Nq, Nk) = {tuple(target)}"
    )


def _host_operand(arr: np.ndarray, name: str) -> Operand:
    """Operand for a numpy array (the array itself, no copy)."""
    strides = _element_strides(arr.strides, arr.dtype.itemsize, arr.shape, name)
    return Operand(
        name=name, kind="host", obj=arr, shape=tuple(arr.shape), strides=strides,
        dtype=arr.dtype, ptr=0, array=arr,
    )


def _device_operand(obj: Any, iface: Any, name: str, opaque_dtype: Optional[np.dtype] = None) -> Operand:
    """Operand for an object whose ``__cuda_array_interface__`` is ``iface``."""
    if not isinstance(iface, Mapping):
        raise TypeError(
            f"{name}.__cuda_array_interface__ must be a dict, got {type(iface).__name__}"
        )
    if iface.get("mask") is not None:
        raise TypeError(
            f"{name} is a masked device array (its __cuda_array_interface__ has a mask); "
            "masked arrays are not supported"
        )
    shape = _interface_shape(iface, name)
    dtype = _dtype_from_typestr(iface.get("typestr"), name)
    if _is_opaque(dtype):
        dtype = _identify_opaque(obj, dtype, iface["typestr"], name, opaque_dtype)
    ptr = _interface_pointer(iface, name)
    byte_strides = iface.get("strides")
    if byte_strides is None:
        strides = _c_contiguous_strides(shape)
    else:
        byte_strides = _int_tuple(byte_strides, name, "strides")
        if len(byte_strides) != len(shape):
            raise TypeError(
                f"{name}.__cuda_array_interface__ has {len(byte_strides)} strides "
                f"for {len(shape)} dimensions"
            )
        strides = _element_strides(byte_strides, dtype.itemsize, shape, name)
    return Operand(
        name=name, kind="device", obj=obj, shape=shape, strides=strides,
        dtype=dtype, ptr=ptr, array=None, read_only=bool(iface["data"][1]),
    )


#: torch dtype names and the numpy dtypes their array interface would give
#: (bfloat16, which it exports as opaque '<V2', by name through ml_dtypes).
_TORCH_DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "bool", "int8", "uint8", "int16",
                      "int32", "int64")
_torch_dtypes: Dict[Any, Dict[Any, np.dtype]] = {}


def _torch_dtype_table(torch: Any) -> Dict[Any, np.dtype]:
    """{torch dtype: numpy dtype} for the names above (memoised per torch module)."""
    table = _torch_dtypes.get(id(torch))
    if table is None:
        table = {}
        for tname in _TORCH_DTYPE_NAMES:
            tdtype = getattr(torch, tname, None)
            if tdtype is None:
                continue
            if tname == "bfloat16":
                try:
                    import ml_dtypes
                except ImportError:
                    continue  # the generic path then says how to get it
                table[tdtype] = np.dtype(ml_dtypes.bfloat16)
            else:
                table[tdtype] = np.dtype(tname)
        _torch_dtypes[id(torch)] = table
    return table


def _torch_operand(obj: Any, name: str) -> Optional[Operand]:
    """Operand of a CUDA torch tensor through its own accessors, or None.

    None for anything that is not a strided CUDA ``torch.Tensor`` of a dtype
    in the table (and when torch has not been imported): the generic array
    interface path then describes it, or words the error.
    """
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None) if torch is not None else None
    if tensor is None or not isinstance(obj, tensor):
        return None
    try:
        if not obj.is_cuda or obj.layout != torch.strided:
            return None
        dtype = _torch_dtype_table(torch).get(obj.dtype)
        if dtype is None:
            return None
        # (torch.Size and stride() are tuples of Python ints already.)
        return Operand(
            name=name, kind="device", obj=obj, shape=tuple(obj.shape), strides=tuple(obj.stride()),
            dtype=dtype, ptr=int(obj.data_ptr()), array=None,
        )
    except Exception:
        return None


def _interface_shape(iface: Mapping, name: str) -> Tuple[int, ...]:
    """The ``shape`` entry of an array interface as a tuple of ints."""
    if "shape" not in iface:
        raise TypeError(f"{name}.__cuda_array_interface__ has no 'shape'")
    return _int_tuple(iface["shape"], name, "shape")


def _interface_pointer(iface: Mapping, name: str) -> int:
    """The device address from the ``data`` entry of an array interface."""
    data = iface.get("data")
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise TypeError(
            f"{name}.__cuda_array_interface__['data'] must be a pair (pointer, read_only), "
            f"got {data!r}"
        )
    ptr = data[0]
    if ptr is None:
        return 0
    if isinstance(ptr, bool) or not isinstance(ptr, (int, np.integer)):
        raise TypeError(
            f"{name}.__cuda_array_interface__ device pointer must be an int, "
            f"got {type(ptr).__name__}"
        )
    return int(ptr)


def _int_tuple(values: Any, name: str, what: str) -> Tuple[int, ...]:
    """``values`` as a tuple of Python ints, or a TypeError naming the entry."""
    if not isinstance(values, (tuple, list)):
        raise TypeError(
            f"{name}.__cuda_array_interface__['{what}'] must be a tuple of ints, got {values!r}"
        )
    out = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(
                f"{name}.__cuda_array_interface__['{what}'] must be a tuple of ints, got {values!r}"
            )
        out.append(int(value))
    return tuple(out)


def _dtype_from_typestr(typestr: Any, name: str) -> np.dtype:
    """numpy dtype of an array-interface ``typestr``.

    An opaque (void) type of non-zero size comes back as the plain void dtype
    (``'<V2'``) for :func:`_identify_opaque`; object, structured and
    zero-size types and unknown strings raise TypeError.
    """
    if not isinstance(typestr, str):
        raise TypeError(
            f"{name}.__cuda_array_interface__['typestr'] must be a string, got {typestr!r}"
        )
    try:
        dtype = np.dtype(typestr)
    except TypeError:
        raise TypeError(
            f"{name} has element type {typestr!r} in __cuda_array_interface__, "
            "which numpy does not understand"
        ) from None
    if dtype.kind == "O" or dtype.itemsize == 0 or dtype.fields is not None:
        raise TypeError(
            f"{name} has element type {typestr!r} in __cuda_array_interface__, "
            "which is not a numeric type"
        )
    return dtype


def _identify_opaque(
    obj: Any, void: np.dtype, typestr: str, name: str, opaque_dtype: Optional[np.dtype]
) -> np.dtype:
    """The element type of a device array whose array interface says only ``'<Vn'``.

    ``__dlpack__`` decides when the object has one; otherwise the object's
    numpy ``dtype`` (of the same item size, not itself opaque); otherwise the
    caller's explicit ``opaque_dtype`` (of the same item size); otherwise
    TypeError.
    ``typestr`` is the interface's own spelling, for messages.
    """
    if _has_dlpack(obj):
        dtype = dlpack_dtype(obj, name)
        if dtype.itemsize != void.itemsize:
            raise TypeError(
                f"{name} has the {void.itemsize}-byte element type {typestr!r} in "
                f"__cuda_array_interface__ but __dlpack__ reports {_dtype_label(dtype)} "
                f"({dtype.itemsize} bytes)"
            )
        return dtype
    own = getattr(obj, "dtype", None)
    if isinstance(own, np.dtype) and not _is_opaque(own) and own.itemsize == void.itemsize:
        return own
    if opaque_dtype is not None:
        if opaque_dtype.itemsize != void.itemsize:
            raise TypeError(
                f"{name} has the opaque {void.itemsize}-byte element type {typestr!r} in "
                f"__cuda_array_interface__, which dtype={_dtype_label(opaque_dtype)!r} "
                f"({opaque_dtype.itemsize} bytes) cannot name"
            )
        return opaque_dtype
    hint = (
        "pass dtype='bfloat16' (or dtype='float16') to name it"
        if void.itemsize == 2
        else "pass dtype= to name it"
    )
    raise TypeError(
        f"{name} has the opaque element type {typestr!r}: the {void.itemsize}-byte type cannot "
        "be identified from __cuda_array_interface__ (torch exports bfloat16 this way) and "
        f"{name} has no __dlpack__ that would identify it; {hint}, or pass a tensor that "
        "supports __dlpack__ (torch, cupy)"
    )


def _is_opaque(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is a plain void type (``'<V2'``), not a named 2-byte type."""
    return dtype.type is np.void


def _dtype_label(dtype: np.dtype) -> str:
    """'bfloat16', 'float16', ... ('<V2' for a plain opaque type)."""
    return dtype.str if _is_opaque(dtype) else dtype.name


# --------------------------------------------------------------------------
# DLPack: reading the element type from a capsule
# --------------------------------------------------------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


#: Capsule names of a legacy and of a versioned (DLPack >= 1.0) tensor.  A
#: consumed capsule is renamed ``used_dltensor``; it is never consumed here.
_CAPSULE_NAMES = (b"dltensor", b"dltensor_versioned")

#: ``(DLDataType code, bits) -> dtype name`` of the element types understood
#: here (code 2 is kDLFloat, 4 is kDLBfloat; one lane).
_DLPACK_TYPES: Dict[Tuple[int, int], str] = {
    (2, 16): "float16",
    (2, 32): "float32",
    (4, 16): "bfloat16",
}

_DLPACK_CODE_NAMES = {0: "int", 1: "uint", 2: "float", 3: "opaque handle", 4: "bfloat",
                      5: "complex", 6: "bool"}

# Private prototypes, so that the shared ctypes.pythonapi functions keep the
# signatures other code may have given them.
_CAPSULE_IS_VALID = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi)
)
_CAPSULE_GET_POINTER = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)


def _has_dlpack(obj: Any) -> bool:
    """Whether ``obj`` has a callable ``__dlpack__``."""
    try:
        return callable(getattr(obj, "__dlpack__", None))
    except Exception:
        return False


def _export_capsule(obj: Any, name: str) -> Any:
    """``obj.__dlpack__()``, asking a device producer not to synchronise any stream.

    For a producer on a CUDA or ROCm device (``__dlpack_device__``), or one
    that does not say, ``stream=-1`` tells it (torch, cupy) to enqueue no
    synchronisation, so that validation stays free of device work.  A host
    producer, or one whose ``__dlpack__`` takes no ``stream``, is called
    without it.
    """
    try:
        device_type = _dlpack_device_type(obj)
        if device_type is not None and device_type not in _STREAM_DEVICES:
            return obj.__dlpack__()
        try:
            return obj.__dlpack__(stream=-1)
        except TypeError:
            return obj.__dlpack__()
    except Exception as exc:
        raise TypeError(
            f"{name} has an opaque element type in __cuda_array_interface__ and its __dlpack__ "
            f"failed ({type(exc).__name__}: {exc}); pass dtype= to name the type"
        ) from exc


#: DLPack device types whose producers take a stream: kDLCUDA, kDLCUDAHost,
#: kDLROCM, kDLROCMHost, kDLCUDAManaged.
_STREAM_DEVICES = (2, 3, 10, 11, 13)


def _dlpack_device_type(obj: Any) -> Optional[int]:
    """The device type from ``obj.__dlpack_device__()``, or None when it is unavailable."""
    get = getattr(obj, "__dlpack_device__", None)
    if not callable(get):
        return None
    try:
        return int(get()[0])
    except Exception:
        return None


def _capsule_type(capsule: Any) -> Tuple[int, int, int]:
    """``(code, bits, lanes)`` of the ``DLDataType`` in a DLPack capsule.

    The capsule is only read: it is neither renamed nor consumed, so its own
    destructor releases the tensor when it is garbage collected.

    Parameters
    ----------
    capsule : PyCapsule
        Named ``'dltensor'`` (a ``DLManagedTensor``) or
        ``'dltensor_versioned'`` (a ``DLManagedTensorVersioned``).

    Returns
    -------
    tuple of int

    Raises
    ------
    TypeError
        If ``capsule`` is not an unconsumed DLPack capsule.
    """
    for cname in _CAPSULE_NAMES:
        if _CAPSULE_IS_VALID(capsule, cname):
            ptr = _CAPSULE_GET_POINTER(capsule, cname)
            break
    else:
        raise TypeError(
            f"__dlpack__ returned {type(capsule).__name__!s}, not an unconsumed DLPack capsule "
            "named 'dltensor' or 'dltensor_versioned'"
        )
    if not ptr:
        raise TypeError("__dlpack__ returned a capsule with a null pointer")
    if cname == b"dltensor":
        dt = _DLManagedTensor.from_address(ptr).dl_tensor.dtype
    else:
        dt = _DLManagedTensorVersioned.from_address(ptr).dl_tensor.dtype
    return int(dt.code), int(dt.bits), int(dt.lanes)


def dlpack_dtype(obj: Any, name: str = "array") -> np.dtype:
    """The element type that ``obj.__dlpack__()`` declares, as a numpy dtype.

    Only the metadata of the exported capsule is read, with no device work;
    the capsule is then released as if it had never been requested.

    Parameters
    ----------
    obj : object with ``__dlpack__``
        A torch or cupy tensor, for instance.
    name : str, optional
        Argument name, used in error messages.

    Returns
    -------
    numpy.dtype
        float16, float32 or bfloat16 (``ml_dtypes.bfloat16``).

    Raises
    ------
    TypeError
        If ``__dlpack__`` fails or returns no DLPack capsule, if the element
        type is any other (integers, vector lanes, float64, ...), or if it is
        bfloat16 and ml_dtypes is not installed.
    """
    capsule = _export_capsule(obj, name)
    try:
        code, bits, lanes = _capsule_type(capsule)
    except TypeError as exc:
        raise TypeError(f"{name}: {exc}") from None
    finally:
        del capsule
    type_name = _DLPACK_TYPES.get((code, bits)) if lanes == 1 else None
    if type_name is None:
        kind = _DLPACK_CODE_NAMES.get(code, f"code {code}")
        lane_text = f" x {lanes} lanes" if lanes != 1 else ""
        raise TypeError(
            f"{name} has element type {kind}{bits}{lane_text} according to __dlpack__; "
            f"expected one of {', '.join(sorted(set(_DLPACK_TYPES.values())))}"
        )
    if type_name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(
                f"{name} is a bfloat16 tensor, which needs ml_dtypes: pip install ml_dtypes"
            ) from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(type_name)


def _element_strides(
    byte_strides: Sequence[int], itemsize: int, shape: Sequence[int], name: str
) -> Tuple[int, ...]:
    """Byte strides converted to element strides; non-multiples raise ValueError."""
    out = []
    for axis, stride in enumerate(byte_strides):
        if stride % itemsize != 0:
            raise ValueError(
                f"{name} has a byte stride of {stride} along dimension {axis} (shape "
                f"{tuple(shape)}), which is not a multiple of its item size {itemsize}"
            )
        out.append(int(stride) // itemsize)
    return tuple(out)


def _c_contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    """Element strides of a C-contiguous array of ``shape``."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def describe_kind(op: Optional[Operand]) -> str:
    """'a numpy (host) array' or 'a device array', for error messages."""
    if op is None:
        return "absent"
    return "a numpy (host) array" if op.kind == "host" else "a device array"


# --------------------------------------------------------------------------
# Overlap of arrays (output buffers must not alias inputs or each other)
# --------------------------------------------------------------------------


def byte_span(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> int:
    """Bytes from an array's first element to the end of its last (strides in elements, >= 0)."""
    if any(int(n) == 0 for n in shape):
        return 0
    return itemsize * (1 + sum((int(n) - 1) * int(s) for n, s in zip(shape, strides)))


class _AddressOnly:
    """An ``__array_interface__`` over a device address, so that numpy can
    reason about overlap; numpy never reads the memory."""

    def __init__(self, ptr: int, shape: Sequence[int], strides: Sequence[int], itemsize: int) -> None:
        self.__array_interface__ = {
            "data": (int(ptr), True), "shape": tuple(int(n) for n in shape),
            "strides": tuple(int(s) * itemsize for s in strides), "typestr": f"|V{itemsize}", "version": 3,
        }


def _address_view(op: Operand) -> np.ndarray:
    if op.kind == "host":
        return op.array
    return np.asarray(_AddressOnly(op.ptr, op.shape, op.strides, op.dtype.itemsize))


def overlaps(a: Operand, b: Operand) -> bool:
    """Whether two operands of the same kind share any element's bytes.

    Address intervals first; where they meet (interleaved layouts such as
    q, k, v slices of one packed tensor), numpy's exact test.  A layout too
    hard to decide counts as overlapping.
    """
    if a.kind != b.kind:
        return False
    if a.kind == "device":
        sa = byte_span(a.shape, a.strides, a.dtype.itemsize)
        sb = byte_span(b.shape, b.strides, b.dtype.itemsize)
        if sa == 0 or sb == 0 or a.ptr + sa <= b.ptr or b.ptr + sb <= a.ptr:
            return False
    return shares_memory(_address_view(a), _address_view(b))


def shares_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """numpy's exact test of two arrays sharing bytes; a layout too hard to decide counts as
    sharing."""
    try:
        return bool(np.shares_memory(a, b, max_work=100_000))
    except np.exceptions.TooHardError if hasattr(np, "exceptions") else np.TooHardError:
        return True


# --------------------------------------------------------------------------
# torch CPU tensors: run as numpy views, answered as torch tensors
# --------------------------------------------------------------------------


def is_torch_cpu(obj: Any) -> bool:
    """Whether ``obj`` is a torch tensor in host memory (torch already imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor) and obj.device.type == "cpu"


def torch_cpu_to_numpy(t: Any, name: str) -> np.ndarray:
    """A numpy view of a CPU tensor's memory (bfloat16 as ``ml_dtypes.bfloat16``)."""
    import torch

    if not is_torch_cpu(t):
        raise TypeError(
            f"{name} must be a torch CPU tensor like q (all arrays of a call are of one kind), "
            f"got {type(t).__name__}" + (f" on {t.device}" if isinstance(t, torch.Tensor) else "")
        )
    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def numpy_to_torch(a: np.ndarray) -> Any:
    """A CPU tensor sharing ``a``'s memory (bfloat16 through its bits)."""
    import torch

    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def torch_cpu_call(fn: Any, positional: Sequence[Any], arrays: Mapping[str, Any], out_names: Sequence[str],
                   kwargs: Mapping[str, Any]) -> Tuple[Any, ...]:
    """Call ``fn`` (a public entry point) on numpy views of torch CPU tensors; return torch tensors.

    Output buffers given as tensors are written through their views and
    returned as given; outputs ``fn`` allocates come back as tensors
    sharing the numpy results' memory.
    """
    names = ("q", "k", "v") if len(positional) == 3 else ("dout", "q", "k", "v", "out", "lse")
    args = [torch_cpu_to_numpy(a, n) for a, n in zip(positional, names)]
    views = {n: (None if a is None else torch_cpu_to_numpy(a, n)) for n, a in arrays.items()}
    kw = dict(kwargs)
    kl = kw.get("key_lengths")
    if is_torch_cpu(kl):
        kw["key_lengths"] = kl.numpy()
    results = fn(*args, **views, **kw)
    return tuple(
        arrays[n] if arrays.get(n) is not None else numpy_to_torch(r) for n, r in zip(out_names, results)
    )
