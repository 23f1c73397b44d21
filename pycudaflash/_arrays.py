"""Uniform descriptions (:class:`~pycudaflash._problem.Operand`) of array arguments.

Two kinds of arrays are understood, without importing torch or cupy:

* ``numpy.ndarray``: a *host* operand; its numpy view is kept in ``array``.
* any object exposing ``__cuda_array_interface__`` (pycuda ``GPUArray``,
  torch and cupy CUDA tensors): a *device* operand described by its pointer,
  shape, strides and dtype.  Nothing is read from device memory here.

Strides are always given in elements; a byte stride that is not a multiple
of the item size is rejected.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Optional, Sequence, Tuple

import numpy as np

from ._problem import Operand

__all__ = ["as_operand", "broadcast_operand", "describe_kind", "is_device_array", "is_read_only"]


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
    try:
        return getattr(obj, "__cuda_array_interface__", None) is not None
    except Exception:
        return False


def as_operand(obj: Any, name: str) -> Operand:
    """Describe a numpy array or a CUDA array-interface object as an :class:`Operand`.

    Parameters
    ----------
    obj : numpy.ndarray or object with ``__cuda_array_interface__``
        The caller's array.
    name : str
        Argument name, used in error messages.

    Returns
    -------
    Operand
        ``kind='host'`` with ``array`` set for numpy arrays, ``kind='device'``
        with ``ptr`` set for device arrays; strides in elements.

    Raises
    ------
    TypeError
        If ``obj`` is neither kind of array, or its element type cannot be
        identified from ``__cuda_array_interface__``.
    ValueError
        If a byte stride is not a multiple of the item size.
    """
    if isinstance(obj, np.ndarray):
        return _host_operand(obj, name)
    if is_device_array(obj):
        return _device_operand(obj, name)
    view = _detached_view(obj)
    if view is not None:
        # A tensor that requires grad exports nothing; its detached view is the same memory.
        return replace(_device_operand(view, name), obj=obj)
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
    data = op.obj.__cuda_array_interface__["data"]
    return bool(data[1])


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


def _device_operand(obj: Any, name: str) -> Operand:
    """Operand for an object exposing ``__cuda_array_interface__``."""
    iface = obj.__cuda_array_interface__
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
        dtype=dtype, ptr=ptr, array=None,
    )


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
    """numpy dtype of an array-interface ``typestr``; void/unknown types raise TypeError."""
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
    if dtype.kind in ("V", "O") or dtype.itemsize == 0:
        raise TypeError(
            f"{name} has element type {typestr!r}: the {dtype.itemsize}-byte type cannot be "
            "identified from __cuda_array_interface__ (torch exports bfloat16 this way); "
            "bfloat16 device tensors need __dlpack__ support or an explicit dtype, "
            "which will come with float16/bfloat16 support"
        )
    return dtype


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
