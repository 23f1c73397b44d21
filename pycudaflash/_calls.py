"""The fast path of repeated calls: plans cached per call signature.

A call on device arrays is described by its *signature*: for every array its
kind, shape, strides, dtype and the low four bits of its address (which
decide alignment and the 16-byte loads), plus the options, whether host key
lengths are given, the modifiers and their tensors' layouts
(:func:`mods_key`), and the context.  The first call of a signature is validated in
full (``pycudaflash._validate``) and leaves its plan
(:class:`pycudaflash.cuda_backend.ForwardPlan`/``BackwardPlan``) here; a
later call of the same signature only reads its pointers, checks that no
output buffer overlaps another array, and launches.

Nothing here holds on to the caller's arrays: a cache entry keeps the plan,
its context and device, and the byte spans of its arrays.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _driver, _validate, cuda_backend
from ._arrays import byte_span
from ._backends import cuda_status
from ._problem import Problem

#: Most plans kept; the oldest goes first beyond this.
MAX_PLANS = 1024

_plans: Dict[Any, Tuple[Any, int, int, Tuple[int, ...]]] = {}

_OPAQUE = ("<V2", "|V2")


def describe(obj: Any) -> Optional[Tuple[Any, int]]:
    """``(metadata, pointer)`` of a device array, or None for anything else (host arrays included)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if not obj.is_cuda:
            return None
        return (obj.shape, obj.stride(), obj.dtype, obj.device.index), obj.data_ptr()
    try:
        iface = obj.__cuda_array_interface__
    except Exception:
        return None
    typestr = iface.get("typestr")
    own = getattr(obj, "dtype", None) if typestr in _OPAQUE else None
    data = iface["data"]
    return (type(obj), tuple(iface["shape"]), iface.get("strides"), typestr, own, bool(data[1])), data[0] or 0


def _key_lengths_key(key_lengths: Any) -> Any:
    """The key lengths in a signature: ``'host'`` (values checked on every call), None, or
    ``False`` (no fast path) for device ones."""
    if key_lengths is None:
        return None
    if isinstance(key_lengths, (list, tuple, np.ndarray)):
        return "host"
    return False


def host_key_lengths(key_lengths: Any, plan: Any) -> Optional[np.ndarray]:
    """A repeated call's host key lengths, checked against its plan's (B, Nk)."""
    if key_lengths is None:
        return None
    return _validate.host_key_lengths(key_lengths, plan.dims[0], plan.dims[3])


def mods_key(score_mod: Any = None, mask_mod: Any = None, mod_tensors: Any = None, block_map: Any = None) -> Any:
    """The modifiers of a call in a signature: their text (a Modifier's text, role and tensor
    signature, which decide its translation), each tensor's layout (a device tensor's
    metadata, or a host one's shape and dtype) and whether a BlockMap holds the block maps
    (its mask and modifier already merged into the others); None without any, and a key that no
    other call shares where they are of other kinds (validation then words the error)."""
    if score_mod is None and mask_mod is None and mod_tensors is None and block_map is None:
        return None
    from .mods import Modifier

    texts = []
    for m in (score_mod, mask_mod):
        if m is None or isinstance(m, str):
            texts.append(m)
        elif isinstance(m, Modifier):
            texts.append((m.src, m.role, tuple(sorted(m.signature.items()))))
        else:
            return object()
    if mod_tensors is not None and not isinstance(mod_tensors, dict):
        return object()
    tensors = []
    for name, t in sorted((mod_tensors or {}).items(), key=lambda item: str(item[0])):
        d = describe(t)
        tensors.append((name, d[0] if d is not None else ("host", tuple(np.shape(t)), str(getattr(t, "dtype", "")))))
    key = (*texts, tuple(tensors), block_map is not None)
    try:
        hash(key)
    except TypeError:
        return object()
    return key


def mod_values(plan: Any, mod_tensors: Any) -> List[Any]:
    """A repeated call's modifier tensors in its plan's slots: device addresses, or host arrays in
    the kernels' element types (:func:`pycudaflash.cuda_backend.mod_values`)."""
    out: List[Any] = []
    for name in plan.mod_names:
        t = mod_tensors[name]
        d = describe(t)
        out.append(d[1] if d is not None else _validate.kernel_array(name, t))
    return out


def signature(kind: str, arrays: Sequence[Any], options: Tuple[Any, ...], key_lengths: Any
              ) -> Optional[Tuple[Any, List[int], int, bool]]:
    """``(key, pointers, context, pushed)`` of a call on device arrays, or None where there is no fast path.

    The context is entered (:func:`pycudaflash._driver.enter`); the caller
    leaves it.  ``arrays`` holds None for absent optional arrays.
    """
    if not cuda_status()[0]:
        return None
    metas = []
    ptrs = []
    for a in arrays:
        if a is None:
            metas.append(None)
            ptrs.append(0)
            continue
        d = describe(a)
        if d is None:
            return None
        metas.append(d[0])
        ptrs.append(d[1])
    klk = _key_lengths_key(key_lengths)
    if klk is False:
        return None
    ctx, pushed = _driver.enter(cuda_backend._device_hint(arrays[0]))
    low = tuple(p & 15 for p in ptrs)
    key = (kind, ctx, tuple(metas), low, options, klk)
    try:
        hash(key)
    except TypeError:
        _driver.leave(pushed)
        return None
    return key, ptrs, ctx, pushed


def keeper(key: Any, prob: Problem, names: Sequence[str]):
    """The ``keep`` callback of the backend's ``run_*``: files ``key``'s plan with its arrays' byte spans.

    ``names``: the problem's operands in the order of the call's pointers.
    """
    spans = tuple(
        byte_span(op.shape, op.strides, op.dtype.itemsize) if op is not None else 0
        for op in (getattr(prob, n) for n in names)
    )

    def keep(plan: Any, ctx: int, device: int) -> None:
        remember(key, (plan, ctx, device), spans)

    return keep


def remember(key: Any, entry: Tuple[Any, int, int], spans: Optional[Tuple[int, ...]] = None
             ) -> Tuple[Any, int, int, Optional[Tuple[int, ...]]]:
    """File ``(plan, context, device)`` under ``key`` (with its arrays' byte spans, where the fast
    path checks outputs for overlap); the oldest entry goes beyond :data:`MAX_PLANS`."""
    if len(_plans) >= MAX_PLANS:
        _plans.pop(next(iter(_plans)))
    hit = _plans[key] = (*entry, spans)
    return hit


def lookup(key: Any) -> Optional[Tuple[Any, int, int, Optional[Tuple[int, ...]]]]:
    return _plans.get(key)


def outputs_disjoint(ptrs: Sequence[int], spans: Sequence[int], outputs: Sequence[int]) -> bool:
    """Whether each given output's address range misses every other array's.

    ``outputs``: indices of the outputs in ``ptrs``.  False means "maybe
    overlapping": the full validation then decides.
    """
    for i in outputs:
        p, s = ptrs[i], spans[i]
        if not p or not s:
            continue
        end = p + s
        for j, (q, t) in enumerate(zip(ptrs, spans)):
            if j != i and q and t and q < end and p < q + t:
                return False
    return True


def clear() -> None:
    """Forget every cached plan (of the plain API and of :mod:`pycudaflash.torch`).

    The tuning variables (``$PYCUDAFLASH_TILES``, ``$PYCUDAFLASH_WGMMA``) are
    read when a signature is planned: after changing them in a running
    process, call this so that repeated signatures are planned again.
    """
    _plans.clear()
    fast = sys.modules.get("pycudaflash._fastpath")  # (the C++ host path of the torch operators)
    if fast is not None:
        fast.clear()
