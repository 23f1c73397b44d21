"""Score and mask modifiers: small expressions over the score and the positions.

A modifier is written in a subset of Python's expression syntax and is
translated once into CUDA C (for the kernels) and evaluated with numpy (for the
float64 reference and the NumPy backend), so that both read the same text:

* ``score_mod``: a float expression that replaces each scaled score,
  e.g. ``30 * tanh(score / 30)`` (soft-capping) or ``score - slope[h] * abs(i - j)``
  (ALiBi).  The backward multiplies by its derivative with respect to
  ``score``, derived here from the expression (:meth:`Modifier.derivative`).
* ``mask_mod``: a bool expression, True where query ``i`` may attend key
  ``j``, e.g. ``doc[b, i] == doc[b, j]`` (document masking) or
  ``(j <= i) | (j < prefix[b])`` (prefix-LM).  It may not use ``score``.

The language
------------
Names: ``score`` (the scaled score ``scale * q.k``, float), ``b``, ``h``,
``i``, ``j`` (batch, head, query position, key position; int), and the named
tensors of ``mod_tensors``, read with ``[]`` and one index per dimension (an
index outside a dimension is clamped to its nearest end, in every backend).
Numbers (int, float), ``True``, ``False``.  Operators: ``+ - * /`` (``/``
always divides as floats), ``//`` and ``%`` (ints, rounding down as Python
does; a zero divisor gives 0), unary ``-``; comparisons ``< <= > >= == !=``
(chains allowed); ``&``, ``|``, ``~`` on bools.  Functions: ``where(c, x,
y)``, ``exp``, ``log``, ``tanh``, ``abs``, ``min(x, y)``, ``max(x, y)``.
Ints are 64-bit, floats are float32 in the kernels and float64 in numpy;
``tanh`` in a score modifier of the float16 and bfloat16 kernels is the
hardware's approximation (relative error about 2^-11).
Anything else (attributes, other calls, ``and``/``or``, ``if`` expressions,
lambdas, ...) is refused with a ``ValueError`` that names it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import numpy as np

__all__ = ["Modifier", "as_modifier", "positions", "score_mod", "mask_mod", "tensor_kind", "tensor_signature",
           "kernel_code", "POSITIONS"]

#: The position names and the score.
POSITIONS = ("b", "h", "i", "j")
SCORE = "score"
#: Functions of the language and their arity.
FUNCTIONS = {"exp": 1, "log": 1, "tanh": 1, "abs": 1, "min": 2, "max": 2, "where": 3}

Kind = str  # 'bool', 'int' or 'float'


# ----------------------------------------------------------------- the tree


@dataclass(frozen=True)
class Num:
    value: Union[bool, int, float]
    kind: Kind


@dataclass(frozen=True)
class Var:
    name: str  # score, b, h, i, j
    kind: Kind


@dataclass(frozen=True)
class Load:
    tensor: str
    index: Tuple["Node", ...]
    kind: Kind


@dataclass(frozen=True)
class Unary:
    op: str  # '-' or '~'
    x: "Node"
    kind: Kind


@dataclass(frozen=True)
class Bin:
    op: str  # + - * / // % & |
    a: "Node"
    b: "Node"
    kind: Kind


@dataclass(frozen=True)
class Cmp:
    op: str  # < <= > >= == !=
    a: "Node"
    b: "Node"
    kind: Kind = "bool"


@dataclass(frozen=True)
class Call:
    fn: str
    args: Tuple["Node", ...]
    kind: Kind


Node = Union[Num, Var, Load, Unary, Bin, Cmp, Call]

_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
           ast.BitAnd: "&", ast.BitOr: "|"}
_CMPOPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}


def tensor_kind(dtype: Any) -> Kind:
    """The kind of a tensor's elements in expressions: 'bool', 'int' or 'float'."""
    kind = np.dtype(dtype).kind
    if kind == "b":
        return "bool"
    if kind in "iu":
        return "int"
    if kind == "f":
        return "float"
    raise TypeError(f"mod_tensors: elements must be bool, int or float, got {np.dtype(dtype)}")


def _numeric(kind: Kind, what: str) -> None:
    if kind == "bool":
        raise ValueError(f"{what} takes numbers, got a bool (compare it, or use where())")


def _promote(a: Kind, b: Kind) -> Kind:
    return "float" if "float" in (a, b) else "int"


class _Parser:
    """Python's own expression parser, then a walk that admits the language only, with kinds."""

    def __init__(self, src: str, tensors: Mapping[str, Tuple[Kind, int]], allow_score: bool) -> None:
        self.src, self.tensors, self.allow_score = src, tensors, allow_score

    def parse(self) -> Node:
        if not isinstance(self.src, str):
            raise TypeError(f"a modifier is a string expression, got {type(self.src).__name__}")
        try:
            tree = ast.parse(self.src.strip(), mode="eval")
        except SyntaxError as exc:
            raise ValueError(f"modifier {self.src!r} is not a Python expression: {exc.msg}") from None
        return self.node(tree.body)

    def fail(self, node: ast.AST, why: str) -> ValueError:
        col = getattr(node, "col_offset", None)
        where = f" at column {col}" if col is not None else ""
        return ValueError(f"modifier {self.src!r}{where}: {why}")

    def node(self, n: ast.AST) -> Node:
        if isinstance(n, ast.Constant):
            v = n.value
            if isinstance(v, bool):
                return Num(v, "bool")
            if isinstance(v, int):
                return Num(v, "int")
            if isinstance(v, float):
                return Num(v, "float")
            raise self.fail(n, f"constant {v!r} is not a number or bool")
        if isinstance(n, ast.Name):
            if n.id == SCORE:
                if not self.allow_score:
                    raise self.fail(n, "a mask_mod may not use 'score'")
                return Var(SCORE, "float")
            if n.id in POSITIONS:
                return Var(n.id, "int")
            if n.id in self.tensors:
                raise self.fail(n, f"tensor {n.id!r} must be indexed, e.g. {n.id}[h]")
            raise self.fail(n, f"unknown name {n.id!r} (names: score, b, h, i, j and the mod_tensors "
                               f"{sorted(self.tensors)})")
        if isinstance(n, ast.Subscript):
            if not isinstance(n.value, ast.Name):
                raise self.fail(n, "only the mod_tensors can be indexed")
            if n.value.id not in self.tensors:
                raise self.fail(n, f"unknown tensor {n.value.id!r} (mod_tensors: {sorted(self.tensors)})")
            name = n.value.id
            idx = n.slice.elts if isinstance(n.slice, ast.Tuple) else [n.slice]
            kind, ndim = self.tensors[name]
            if len(idx) != ndim:
                raise self.fail(n, f"{name} has {ndim} dimensions, indexed with {len(idx)}")
            index = tuple(self.node(x) for x in idx)
            for x in index:
                if x.kind != "int":
                    raise self.fail(n, f"indices of {name} must be ints, got a {x.kind}")
            return Load(name, index, kind)
        if isinstance(n, ast.UnaryOp):
            x = self.node(n.operand)
            if isinstance(n.op, ast.USub):
                _numeric(x.kind, "unary -")
                return Unary("-", x, x.kind)
            if isinstance(n.op, ast.UAdd):
                _numeric(x.kind, "unary +")
                return x
            if isinstance(n.op, ast.Invert):
                if x.kind != "bool":
                    raise self.fail(n, "~ takes a bool")
                return Unary("~", x, "bool")
            raise self.fail(n, "'not' is not part of the language (use ~)")
        if isinstance(n, ast.BinOp):
            op = _BINOPS.get(type(n.op))
            if op is None:
                raise self.fail(n, f"operator {type(n.op).__name__} is not part of the language")
            a, b = self.node(n.left), self.node(n.right)
            if op in "&|":
                if a.kind != "bool" or b.kind != "bool":
                    raise self.fail(n, f"{op} combines bools (conditions)")
                return Bin(op, a, b, "bool")
            try:
                _numeric(a.kind, op)
                _numeric(b.kind, op)
            except ValueError as exc:
                raise self.fail(n, str(exc)) from None
            if op in ("//", "%"):
                if a.kind != "int" or b.kind != "int":
                    raise self.fail(n, f"{op} takes ints")
                return Bin(op, a, b, "int")
            return Bin(op, a, b, "float" if op == "/" else _promote(a.kind, b.kind))
        if isinstance(n, ast.Compare):
            parts = [self.node(n.left)] + [self.node(c) for c in n.comparators]
            out: Optional[Node] = None
            for op_node, a, b in zip(n.ops, parts, parts[1:]):
                op = _CMPOPS.get(type(op_node))
                if op is None:
                    raise self.fail(n, f"comparison {type(op_node).__name__} is not part of the language")
                if (a.kind == "bool") != (b.kind == "bool") or (a.kind == "bool" and op not in ("==", "!=")):
                    raise self.fail(n, f"{op} compares two numbers (or two bools with == and !=)")
                c = Cmp(op, a, b)
                out = c if out is None else Bin("&", out, c, "bool")
            assert out is not None
            return out
        if isinstance(n, ast.Call):
            if not isinstance(n.func, ast.Name) or n.func.id not in FUNCTIONS:
                what = n.func.id if isinstance(n.func, ast.Name) else ast.dump(n.func)[:40]
                raise self.fail(n, f"function {what!r} is not part of the language ({', '.join(FUNCTIONS)})")
            fn = n.func.id
            if n.keywords or len(n.args) != FUNCTIONS[fn]:
                raise self.fail(n, f"{fn}() takes {FUNCTIONS[fn]} positional arguments")
            args = tuple(self.node(x) for x in n.args)
            if fn == "where":
                c, a, b = args
                if c.kind != "bool":
                    raise self.fail(n, "where()'s condition must be a bool")
                if (a.kind == "bool") != (b.kind == "bool"):
                    raise self.fail(n, "where()'s two values must both be bools or both numbers")
                return Call(fn, args, "bool" if a.kind == "bool" else _promote(a.kind, b.kind))
            for a in args:
                if a.kind == "bool":
                    raise self.fail(n, f"{fn}() takes numbers")
            if fn in ("min", "max"):
                return Call(fn, args, _promote(args[0].kind, args[1].kind))
            if fn == "abs":
                return Call(fn, args, args[0].kind)
            return Call(fn, args, "float")
        if isinstance(n, ast.BoolOp):
            raise self.fail(n, "'and'/'or' are not part of the language (use & and | on conditions)")
        raise self.fail(n, f"{type(n).__name__} is not part of the language")


# ------------------------------------------------------------ the modifier


def _children(node: Node) -> Tuple[Node, ...]:
    """The operands of a node (none for numbers and names)."""
    if isinstance(node, (Var, Num)):
        return ()
    if isinstance(node, Load):
        return node.index
    if isinstance(node, Unary):
        return (node.x,)
    if isinstance(node, (Bin, Cmp)):
        return (node.a, node.b)
    return node.args


def _uses(node: Node, name: str) -> bool:
    if isinstance(node, Var):
        return node.name == name
    return any(_uses(x, name) for x in _children(node))


def _loads(node: Node) -> set:
    """Names of the tensors ``node`` reads."""
    own = {node.tensor} if isinstance(node, Load) else set()
    return own.union(*(_loads(x) for x in _children(node)))


class Modifier:
    """A parsed, typed modifier expression.

    Parameters
    ----------
    src : str
        The expression (see the module documentation).
    tensors : mapping of name to array, optional
        The named tensors it reads (anything numpy can convert: the dtype
        kind and number of dimensions are what matter here).
    role : {'score', 'mask'}
        A score modifier is float-valued and may use ``score``; a mask
        modifier is bool-valued and may not.
    """

    def __init__(self, src: str, tensors: Optional[Mapping[str, Any]] = None, role: str = "score") -> None:
        if role not in ("score", "mask"):
            raise ValueError(f"role must be 'score' or 'mask', got {role!r}")
        tensors = dict(tensors or {})
        for name in tensors:
            if not name.isidentifier() or name in POSITIONS or name == SCORE or name in FUNCTIONS:
                raise ValueError(f"mod_tensors: {name!r} cannot name a tensor")
        self.src, self.role = src, role
        self.signature: Dict[str, Tuple[Kind, int]] = {name: tensor_signature(name, t) for name, t in tensors.items()}
        self.node: Node = _Parser(src, self.signature, role == "score").parse()
        self._derivative: Optional["Modifier"] = None
        want = "float" if role == "score" else "bool"
        if self.node.kind == "int" and want == "float":
            self.node = Call("float", (self.node,), "float")
        if self.node.kind != want:
            raise ValueError(f"a {role}_mod must give a {want}, {src!r} gives a {self.node.kind}")

    def __repr__(self) -> str:
        return f"Modifier({self.src!r}, role={self.role!r})"

    @property
    def uses_score(self) -> bool:
        return _uses(self.node, SCORE)

    def reads(self, position: str) -> bool:
        """Whether the expression reads ``position`` ('b', 'h', 'i' or 'j')."""
        if position not in POSITIONS:
            raise ValueError(f"{position!r} is none of the positions {POSITIONS}")
        return _uses(self.node, position)

    # --------------------------------------------------------------- numpy

    def evaluate(self, score: Any = None, *, b: Any = 0, h: Any = 0, i: Any = 0, j: Any = 0,
                 tensors: Optional[Mapping[str, Any]] = None) -> np.ndarray:
        """The expression's value with numpy, broadcasting ``score`` and the positions.

        Floats are computed in float64.  For the reference, pass positions
        shaped to broadcast over (B, H, Nq, Nk), e.g. ``i = arange(Nq)[:, None]``.
        """
        env = {"b": b, "h": h, "i": i, "j": j, SCORE: score}
        arrays = {k: np.asarray(v) for k, v in (tensors or {}).items()}
        missing = set(self.signature) - set(arrays)
        if missing:
            raise ValueError(f"mod_tensors missing: {sorted(missing)}")
        with np.errstate(all="ignore"):
            return np.asarray(_eval(self.node, env, arrays))

    # ------------------------------------------------------------ backward

    def derivative(self) -> "Modifier":
        """d(score_mod)/d(score) as a modifier of its own (same tensors), derived once."""
        if self.role != "score":
            raise ValueError("only a score_mod has a derivative")
        if self._derivative is None:
            m = Modifier.__new__(Modifier)
            m.src, m.role, m.signature = f"d/dscore({self.src})", "score", dict(self.signature)
            m.node, m._derivative = _simplify(_deriv(self.node)), None
            self._derivative = m
        return self._derivative

    # ------------------------------------------------------------------ CUDA

    def cuda(self, name: str, slots: Optional[Mapping[str, int]] = None,
             hoisted: Optional[Mapping[Node, str]] = None) -> str:
        """A CUDA device function ``name(score, b, h, i, j, mods)`` returning the expression
        (``float`` for a score modifier, ``bool`` for a mask modifier).  ``mods`` is a
        ``ModTensors`` (see :data:`CUDA_PRELUDE`) whose slot ``slots[t]`` holds tensor ``t``
        (default: the ``k``-th tensor of :attr:`signature` in name order).  With ``hoisted``
        (subexpression -> ``ModHead`` member, see :func:`kernel_code`) the function takes a
        last argument ``const ModHead &hv`` and reads those subexpressions from it."""
        if slots is None:
            slots = {t: k for k, t in enumerate(sorted(self.signature))}
        ret = "float" if self.role == "score" else "bool"
        body = _cuda(self.node, _Emit(dict(slots), dict(hoisted or {}), self.role == "score"))
        head = ", const ModHead &hv" if hoisted is not None else ""
        void = " (void)hv;" if hoisted is not None else ""
        return (f"__device__ __forceinline__ {ret} {name}(float score, int b, int h, int i, int j, "
                f"const ModTensors &mods{head}) {{\n    (void)score; (void)b; (void)h; (void)i; (void)j; "
                f"(void)mods;{void}\n    return {body};\n}}\n")

    @property
    def tensors_read(self) -> Tuple[str, ...]:
        """The names of the tensors the expression reads, sorted."""
        return tuple(sorted(_loads(self.node)))


def kernel_code(score: Optional[Modifier], mask: Optional[Modifier]) -> Tuple[Tuple[str, ...], str]:
    """The device code of a kernel variant with these modifiers: ``(names, code)``.

    ``code`` is :data:`CUDA_PRELUDE`, ``struct ModHead`` with ``mod_head(b,
    h, mods)`` (the subexpressions that depend on ``b`` and ``h`` alone,
    which a kernel evaluates once a job) and the device functions
    ``score_mod``, ``score_mod_slope`` (its derivative) and ``mask_mod`` of
    those given, ``(score, b, h, i, j, mods, hv)``, the latter with
    ``MASK_MOD_READS_B`` and ``MASK_MOD_READS_H`` (1 where it reads that
    position: the planes of its block map);
    ``names`` are the tensors they read, ``names[k]`` in slot ``k`` of
    ``ModTensors``.  The same expressions over tensors of the same kinds and
    dimensions give the same text.
    """
    if score is not None and score.role != "score" or mask is not None and mask.role != "mask":
        raise ValueError("kernel_code takes a score modifier and a mask modifier")
    names = tuple(sorted(set(score.tensors_read if score else ()) | set(mask.tensors_read if mask else ())))
    if len(names) > MAX_TENSORS:
        raise ValueError(f"the modifiers read {len(names)} mod_tensors, at most {MAX_TENSORS} on the GPU")
    slots = {t: k for k, t in enumerate(names)}
    exprs = ((score, "score_mod"), (score.derivative() if score else None, "score_mod_slope"), (mask, "mask_mod"))
    hoisted = _head_values(tuple(m.node for m, _ in exprs if m is not None))
    parts = [CUDA_PRELUDE, _head_code(hoisted, slots)]
    parts += [m.cuda(name, slots, hoisted) for m, name in exprs if m is not None]
    if mask is not None:
        parts.append("".join(f"#define MASK_MOD_READS_{p.upper()} {int(mask.reads(p))}\n" for p in ("b", "h")))
    return names, "".join(parts)


def tensor_signature(name: str, t: Any) -> Tuple[Kind, int]:
    """(element kind, dimensions) of a numpy, torch or cupy array, a device operand
    (``pycudaflash._problem.Operand``), or anything numpy converts."""
    dtype = getattr(t, "dtype", None)
    if dtype is not None and str(dtype).startswith("torch."):
        dtype = {"torch.bool": np.bool_, "torch.bfloat16": np.float32}.get(str(dtype), str(dtype)[6:])
    elif dtype is None:
        t = np.asarray(t)
        dtype = t.dtype
    ndim = getattr(t, "ndim", None)
    if ndim is None and isinstance(getattr(t, "shape", None), tuple):
        ndim = len(t.shape)
    if ndim is None or not 1 <= int(ndim) <= 4:
        raise ValueError(f"mod_tensors: {name!r} must have 1 to 4 dimensions")
    return tensor_kind(dtype), int(ndim)


def as_modifier(m: Any, tensors: Optional[Mapping[str, Any]], role: str) -> Optional[Modifier]:
    """A :class:`Modifier` of ``role`` ('score' or 'mask') from a Modifier or its source text
    (None stays None); a Modifier of the other role raises ``ValueError``."""
    if m is None:
        return None
    if isinstance(m, Modifier):
        if m.role != role:
            raise ValueError(f"a {m.role}_mod was given as {role}_mod")
        return m
    return Modifier(m, tensors, role)


def positions(B: int, H: int, rows: Any, cols: Any) -> Dict[str, np.ndarray]:
    """The positions a modifier reads, as grids that broadcast to (B, H, len(rows), len(cols)):
    ``b``, ``h``, ``i`` (the query positions ``rows``) and ``j`` (the key positions ``cols``)."""
    return dict(b=np.arange(B)[:, None, None, None], h=np.arange(H)[None, :, None, None],
                i=np.asarray(rows)[None, None, :, None], j=np.asarray(cols)[None, None, None, :])


def score_mod(src: str, tensors: Optional[Mapping[str, Any]] = None) -> Modifier:
    """A :class:`Modifier` with the score role."""
    return Modifier(src, tensors, "score")


def mask_mod(src: str, tensors: Optional[Mapping[str, Any]] = None) -> Modifier:
    """A :class:`Modifier` with the mask role."""
    return Modifier(src, tensors, "mask")


# ------------------------------------------------------------- evaluation


def _eval(n: Node, env: Dict[str, Any], arrays: Dict[str, np.ndarray]) -> Any:
    if isinstance(n, Num):
        return {"bool": np.bool_, "int": np.int64, "float": np.float64}[n.kind](n.value)
    if isinstance(n, Var):
        v = env[n.name]
        if v is None:
            raise ValueError("this modifier needs score=")
        return np.asarray(v, dtype=np.float64 if n.kind == "float" else np.int64)
    if isinstance(n, Load):
        t = arrays[n.tensor]
        idx = tuple(np.clip(np.asarray(_eval(x, env, arrays), dtype=np.int64), 0, t.shape[d] - 1)
                    for d, x in enumerate(n.index))
        v = t[idx]
        return v.astype({"bool": np.bool_, "int": np.int64, "float": np.float64}[n.kind])
    if isinstance(n, Unary):
        x = _eval(n.x, env, arrays)
        return np.negative(x) if n.op == "-" else np.logical_not(x)
    if isinstance(n, Bin):
        a, b = _eval(n.a, env, arrays), _eval(n.b, env, arrays)
        if n.op == "+":
            return np.add(a, b)
        if n.op == "-":
            return np.subtract(a, b)
        if n.op == "*":
            return np.multiply(a, b)
        if n.op == "/":
            return np.true_divide(np.asarray(a, np.float64), np.asarray(b, np.float64))
        if n.op in ("//", "%"):
            a, b = np.broadcast_arrays(np.asarray(a, np.int64), np.asarray(b, np.int64))
            safe = np.where(b == 0, 1, b)
            r = np.floor_divide(a, safe) if n.op == "//" else np.mod(a, safe)
            return np.where(b == 0, np.int64(0), r)
        if n.op == "&":
            return np.logical_and(a, b)
        return np.logical_or(a, b)
    if isinstance(n, Cmp):
        a, b = _eval(n.a, env, arrays), _eval(n.b, env, arrays)
        return {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal, "==": np.equal,
                "!=": np.not_equal}[n.op](a, b)
    args = [_eval(x, env, arrays) for x in n.args]
    if n.fn == "where":
        out = np.where(args[0], args[1], args[2])
        return out.astype(np.float64) if n.kind == "float" else out
    if n.fn == "exp":
        return np.exp(np.asarray(args[0], np.float64))
    if n.fn == "log":
        return np.log(np.asarray(args[0], np.float64))
    if n.fn == "tanh":
        return np.tanh(np.asarray(args[0], np.float64))
    if n.fn == "float":
        return np.asarray(args[0], np.float64)
    if n.fn == "abs":
        return np.abs(args[0])
    if n.kind == "float":  # (a NaN loses to a number, as fminf/fmaxf)
        return (np.fmin if n.fn == "min" else np.fmax)(args[0], args[1]).astype(np.float64)
    return (np.minimum if n.fn == "min" else np.maximum)(args[0], args[1])


# ------------------------------------------------------------- derivative

_ZERO, _ONE = Num(0.0, "float"), Num(1.0, "float")


def _deriv(n: Node) -> Node:
    """d n / d score (float-valued; 0 for anything that does not depend on score)."""
    if not _uses(n, SCORE) or n.kind == "bool":
        return _ZERO
    if isinstance(n, Var):
        return _ONE
    assert not isinstance(n, Load)  # (indices are ints, and no int depends on the score)
    if isinstance(n, Unary):
        return Unary("-", _deriv(n.x), "float")
    if isinstance(n, Bin):
        da, db = _deriv(n.a), _deriv(n.b)
        if n.op == "+":
            return Bin("+", da, db, "float")
        if n.op == "-":
            return Bin("-", da, db, "float")
        if n.op == "*":
            return Bin("+", Bin("*", da, n.b, "float"), Bin("*", n.a, db, "float"), "float")
        if n.op == "/":  # (da b - a db) / b^2
            return Bin("/", Bin("-", Bin("*", da, n.b, "float"), Bin("*", n.a, db, "float"), "float"),
                       Bin("*", n.b, n.b, "float"), "float")
        raise ValueError(f"{n.op} of the score has no derivative")  # (// and % take ints only)
    assert isinstance(n, Call)
    args = n.args
    if n.fn == "where":
        return Call("where", (args[0], _deriv(args[1]), _deriv(args[2])), "float")
    x, dx = args[0], _deriv(args[0])
    if n.fn == "float":
        return dx
    if n.fn == "exp":
        return Bin("*", n, dx, "float")
    if n.fn == "log":
        return Bin("/", dx, x, "float")
    if n.fn == "tanh":
        return Bin("*", Bin("-", _ONE, Bin("*", n, n, "float"), "float"), dx, "float")
    if n.fn == "abs":  # sign(x) dx, 0 at x = 0 (as torch)
        return Call("where", (Cmp(">", x, _ZERO), dx,
                              Call("where", (Cmp("<", x, _ZERO), Unary("-", dx, "float"), _ZERO), "float")),
                    "float")
    # min/max: the derivative of the argument chosen; ties go to the first.
    y, dy = args[1], _deriv(args[1])
    return Call("where", (Cmp("<=" if n.fn == "min" else ">=", x, y), dx, dy), "float")


def _is(n: Node, v: float) -> bool:
    return isinstance(n, Num) and n.kind != "bool" and float(n.value) == v


def _simplify(n: Node) -> Node:
    """Fold the zeros and ones the derivative rules leave."""
    if isinstance(n, Unary):
        x = _simplify(n.x)
        return _ZERO if _is(x, 0.0) else Unary(n.op, x, n.kind)
    if isinstance(n, Bin) and n.kind == "float":
        a, b = _simplify(n.a), _simplify(n.b)
        if n.op == "+":
            if _is(a, 0.0):
                return b
            if _is(b, 0.0):
                return a
        if n.op == "-" and _is(b, 0.0):
            return a
        if n.op == "-" and _is(a, 0.0):
            return Unary("-", b, "float")
        if n.op == "*":
            if _is(a, 0.0) or _is(b, 0.0):
                return _ZERO
            if _is(a, 1.0):
                return b
            if _is(b, 1.0):
                return a
        if n.op == "/" and _is(a, 0.0):
            return _ZERO
        return Bin(n.op, a, b, n.kind)
    if isinstance(n, Call) and n.fn == "where":
        c, a, b = n.args[0], _simplify(n.args[1]), _simplify(n.args[2])
        if _is(a, 0.0) and _is(b, 0.0):
            return _ZERO
        return Call("where", (c, a, b), n.kind)
    return n


# ------------------------------------------------------------------- CUDA

#: Tensors a kernel's modifiers may read, and their dimensions at most.
MAX_TENSORS = 8
MAX_DIMS = 4

#: Device code every translated modifier relies on: the tensors' descriptors
#: and the integer helpers with the language's semantics.
CUDA_PRELUDE = f"""\
// The named tensors of a modifier: data (device addresses), sizes and element
// strides (slot k: the k-th name in sorted order), float32, int32 or bool (one
// byte) data.
struct ModTensors {{
    unsigned long long data[{MAX_TENSORS}];
    long long size[{MAX_TENSORS}][{MAX_DIMS}], stride[{MAX_TENSORS}][{MAX_DIMS}];
}};
// An index clamped into [0, n) times its stride: an element offset, in 32
// bits (a tensor spans fewer than 2^31 elements, which the launch code checks).
__device__ __forceinline__ int mod_at(int x, long long n, long long stride) {{
    return min(max(x, 0), (int)n - 1) * (int)stride;
}}
__device__ __forceinline__ int mod_at(long long x, long long n, long long stride) {{
    return (int)(x < 0 ? 0 : (x >= n ? n - 1 : x)) * (int)stride;
}}
// A tensor element through the read-only data cache (no kernel writes them).
template <typename T>
__device__ __forceinline__ T mod_load(unsigned long long data, int off) {{
    return __ldg((const T *)data + off);
}}
// tanh in a score modifier: in the 16-bit kernels (ELEM_BF16 defined) the
// hardware approximation (relative error about 2^-11, below the rounding of
// a float16 or bfloat16 score), one MUFU operation where tanhf takes an
// exp2 and a reciprocal beside the softmax's exp2; tanhf in float32.
__device__ __forceinline__ float mod_tanh(float x) {{
#ifdef ELEM_BF16
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return tanhf(x);
#endif
}}
// Python's // and % on ints (rounding down); a zero divisor gives 0.
__device__ __forceinline__ long long mod_floordiv(long long a, long long b) {{
    if (b == 0) return 0;
    const long long q = a / b;
    return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}}
__device__ __forceinline__ long long mod_floormod(long long a, long long b) {{
    return b == 0 ? 0 : a - mod_floordiv(a, b) * b;
}}
"""

_I32 = (-(2 ** 31), 2 ** 31 - 1)


def _int_range(n: Node) -> Optional[Tuple[int, int]]:
    """Bounds of an int expression's exact value, None where unknown.  Positions
    are kernel ints (0 .. 2**31 - 1), int tensors int32."""
    if isinstance(n, Num):
        return (int(n.value), int(n.value))
    if isinstance(n, Var):
        return (0, _I32[1])
    if isinstance(n, Load):
        return _I32
    if isinstance(n, Unary):
        r = _int_range(n.x)
        return None if r is None else (-r[1], -r[0])
    if isinstance(n, Call) and n.fn in ("abs", "min", "max", "where"):
        rs = [_int_range(x) for x in (n.args[1:] if n.fn == "where" else n.args)]
        if any(r is None for r in rs):
            return None
        if n.fn == "abs":
            lo, hi = rs[0]
            return (0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi)))
        if n.fn == "min":
            return (min(rs[0][0], rs[1][0]), min(rs[0][1], rs[1][1]))
        if n.fn == "max":
            return (max(rs[0][0], rs[1][0]), max(rs[0][1], rs[1][1]))
        return (min(rs[0][0], rs[1][0]), max(rs[0][1], rs[1][1]))
    if isinstance(n, Bin):
        a, b = _int_range(n.a), _int_range(n.b)
        if a is None or b is None:
            return None
        if n.op == "+":
            return (a[0] + b[0], a[1] + b[1])
        if n.op == "-":
            return (a[0] - b[1], a[1] - b[0])
        if n.op == "*":
            c = [x * y for x in a for y in b]
            return (min(c), max(c))
        m = max(abs(a[0]), abs(a[1])) + 1 if n.op == "//" else max(abs(b[0]), abs(b[1]))
        return (-m, m)  # (// : |a // b| <= |a| + 1; % : |a % b| < |b|; 0 for b = 0)
    return None


def _ctype(n: Node) -> str:
    """The C type of a node's value: int expressions in 32 bits where their
    exact value always fits, else 64 (the language's ints are 64-bit: a 32-bit
    int only holds values that the 64-bit one would have)."""
    if n.kind != "int":
        return n.kind
    r = _int_range(n)
    return "int" if r is not None and _I32[0] <= r[0] and r[1] <= _I32[1] else "long long"


@dataclass(frozen=True)
class _Emit:
    """What the translation of an expression refers to: the tensors' ``ModTensors`` slots, the
    subexpressions a kernel reads from its ``ModHead`` (node -> member), and its role."""
    slots: Mapping[str, int]
    hoisted: Mapping[Node, str]
    score: bool = False  # a score modifier (mod_tanh; a mask modifier's decisions take tanhf)


def _head_values(nodes: Tuple[Node, ...]) -> Dict[Node, str]:
    """The largest subexpressions of ``nodes`` that read a tensor and depend on ``b`` and ``h``
    alone (not on ``score``, ``i`` or ``j``), as ``ModHead`` members ``v0, v1, ...``: a kernel
    evaluates them once a job instead of once a score (an ALiBi slope ``slope[h]``).  Loads
    clamp their indices, so reading one outside its ``where`` branch is safe."""
    out: Dict[Node, str] = {}

    def walk(n: Node) -> None:
        if isinstance(n, (Num, Var)):
            return
        if _loads(n) and not any(_uses(n, p) for p in (SCORE, "i", "j")):
            out.setdefault(n, f"v{len(out)}")
            return
        for x in _children(n):
            walk(x)

    for n in nodes:
        walk(n)
    return out


def _head_code(hoisted: Mapping[Node, str], slots: Mapping[str, int]) -> str:
    """``struct ModHead`` and ``mod_head(b, h, mods)``, which fills it (see :func:`_head_values`)."""
    cx = _Emit(slots, {})
    members = "".join(f" {_ctype(n)} {m};" for n, m in hoisted.items())
    sets = "".join(f"    hv.{m} = {_cuda(n, cx)};\n" for n, m in hoisted.items())
    return ("// The modifiers' values that depend on b and h alone, read once a job.\n"
            f"struct ModHead {{{members} }};\n"
            "__device__ __forceinline__ ModHead mod_head(int b, int h, const ModTensors &mods) {\n"
            f"    (void)b; (void)h; (void)mods;\n    ModHead hv;\n{sets}    return hv;\n}}\n")


def _as(ctype: str, n: Node, cx: "_Emit") -> str:
    """Node n's code as a value of C type ctype."""
    code = _cuda(n, cx)
    return code if _ctype(n) == ctype else f"(({ctype})({code}))"


def _cuda(n: Node, cx: "_Emit") -> str:
    if n in cx.hoisted:
        return f"hv.{cx.hoisted[n]}"
    if isinstance(n, Num):
        if n.kind == "bool":
            return "true" if n.value else "false"
        if n.kind == "int":
            return f"{int(n.value)}" if _ctype(n) == "int" else f"{int(n.value)}LL"
        v = float(n.value)
        if v != v:
            return "__int_as_float(0x7fffffff)"
        if v in (float("inf"), float("-inf")):
            return "__int_as_float(0x7f800000)" if v > 0 else "__int_as_float(0xff800000)"
        return f"{v!r}f"
    if isinstance(n, Var):
        return "score" if n.name == SCORE else n.name
    if isinstance(n, Load):
        k = cx.slots[n.tensor]
        off = " + ".join(f"mod_at({_cuda(x, cx)}, mods.size[{k}][{d}], mods.stride[{k}][{d}])"
                         for d, x in enumerate(n.index))
        ctype = {"float": "float", "int": "int"}.get(n.kind, "unsigned char")
        load = f"mod_load<{ctype}>(mods.data[{k}], {off})"
        return load if n.kind != "bool" else f"({load} != 0)"
    if isinstance(n, Unary):
        return f"(-{_as(_ctype(n), n.x, cx)})" if n.op == "-" else f"(!{_cuda(n.x, cx)})"
    if isinstance(n, Bin):
        if n.op in ("&", "|"):
            return f"({_cuda(n.a, cx)} {'&&' if n.op == '&' else '||'} {_cuda(n.b, cx)})"
        if n.op in ("//", "%"):
            fn = "mod_floordiv" if n.op == "//" else "mod_floormod"
            return _cast(_ctype(n), f"{fn}({_as('long long', n.a, cx)}, {_as('long long', n.b, cx)})",
                         "long long")
        if n.op == "/" and isinstance(n.b, Num) and _reciprocal(float(n.b.value)) is not None:
            # by a constant: times its reciprocal (within an ulp of the quotient)
            return f"({_as('float', n.a, cx)} * {_reciprocal(float(n.b.value))!r}f)"
        c = _ctype(n)
        return f"({_as(c, n.a, cx)} {n.op} {_as(c, n.b, cx)})"
    if isinstance(n, Cmp):
        c = "bool" if n.a.kind == "bool" else _wider(_ctype(n.a), _ctype(n.b))
        return f"({_as(c, n.a, cx)} {n.op} {_as(c, n.b, cx)})"
    c = _ctype(n)
    if n.fn == "where":
        return f"({_cuda(n.args[0], cx)} ? {_as(c, n.args[1], cx)} : {_as(c, n.args[2], cx)})"
    if n.fn == "float":
        return _as("float", n.args[0], cx)
    if n.fn == "tanh" and cx.score:
        return f"mod_tanh({_as('float', n.args[0], cx)})"
    if n.fn in ("exp", "log", "tanh"):
        return f"{n.fn}f({_as('float', n.args[0], cx)})"
    if n.fn == "abs":
        return f"fabsf({_cuda(n.args[0], cx)})" if c == "float" else f"abs({_as(c, n.args[0], cx)})"
    if c == "float":
        return f"{'fminf' if n.fn == 'min' else 'fmaxf'}({_as(c, n.args[0], cx)}, {_as(c, n.args[1], cx)})"
    return f"{n.fn}({_as(c, n.args[0], cx)}, {_as(c, n.args[1], cx)})"


def _cast(ctype: str, code: str, have: str) -> str:
    return code if ctype == have else f"(({ctype})({code}))"


def _wider(a: str, b: str) -> str:
    """The C type two operands are compared in."""
    if "float" in (a, b):
        return "float"
    return "long long" if "long long" in (a, b) else "int"


def _reciprocal(v: float) -> Optional[float]:
    """1 / v as a float32 constant, None where it is not a normal finite number."""
    if v == 0.0 or not np.isfinite(v):
        return None
    r = np.float32(1.0 / v)
    return float(r) if np.isfinite(r) and abs(r) >= np.finfo(np.float32).tiny else None
