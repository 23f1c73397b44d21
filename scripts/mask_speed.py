#!/usr/bin/env python3
"""Speed of masked attention: pycudaflash beside torch SDPA and FlexAttention, each given the same mask.

Problems (``--problems``, default all; B 4, N 4096 unless ``--batch`` / ``--seqlen`` say otherwise):

=============  ========  ==  ==  ==========================================
name           dtype     D   H   what is masked
=============  ========  ==  ==  ==========================================
bf16-mask      bfloat16  128 16  a dense bool mask (``--pattern``)
bf16-fmask     bfloat16  128 16  the same as an additive float mask (0 or -inf, bfloat16)
bf16-causal    bfloat16  128 16  causal
bf16-window    bfloat16  128 16  causal + a window of 256 keys (i - 255 .. i)
f32-mask       float32   64  32  a dense bool mask (``--pattern``)
f32-causal     float32   64  32  causal
f32-window     float32   64  32  causal + a window of 256 keys
=============  ========  ==  ==  ==========================================

Mask patterns of the dense-mask problems (one (B, 1, N, N) bool mask, broadcast over the heads;
``--mask-heads`` gives every head its own):

* ``documents``: block-diagonal documents of 256..1535 tokens, causal inside each (most key tiles
  of a query tile empty, the rest full, few partial);
* ``random``: each key attended with probability 1/2 (every tile partial);
* ``causal-dense``: the causal mask, written out.

How each implementation receives a problem: pycudaflash ``flash_attention(q, k, v, mask=...)``, or
``causal=True`` and ``window=(255, 0)``; SDPA (cuDNN: bfloat16 only; memory-efficient) the dense
mask as ``attn_mask``, or ``is_causal=True``, and the window as a dense mask (SDPA has no band);
FlexAttention (``torch.compile(flex_attention)``) a ``mask_mod`` reading the dense mask, or the
causal / window rule, with its block mask made once by ``create_block_mask`` outside the timing.

Method: before timing, each implementation's output is compared with pycudaflash's (max |diff|),
and pycudaflash's with a float64 reference on the first (batch, head) (its first 512 rows). Timing:
CUDA events around ``--reps`` calls after ``--warmup``; the forward under ``torch.no_grad()``; the
backward is the time of forward + ``backward(dout)`` minus that of the forward, as a training step
pays it. Inputs are standard normal, q, k, v and dout from one generator. An implementation that
raises is reported as n/a with the reason.

    python scripts/mask_speed.py [--problems bf16-mask f32-window] [--pattern documents]
                                 [--json results.json]

On a machine without CUDA, ``--device cpu`` runs pycudaflash's NumPy backend and SDPA's math
backend (for checking this script; the sizes must then be small).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from pycudaflash.torch import flash_attention

WINDOW = 256  # keys a row sees under the window problems: i - WINDOW + 1 .. i


@dataclass(frozen=True)
class Problem:
    name: str
    dtype: torch.dtype
    D: int
    H: int
    kind: str  # "mask", "causal" or "window"


PROBLEMS = {p.name: p for p in (
    Problem("bf16-mask", torch.bfloat16, 128, 16, "mask"),
    Problem("bf16-fmask", torch.bfloat16, 128, 16, "fmask"),
    Problem("bf16-causal", torch.bfloat16, 128, 16, "causal"),
    Problem("bf16-window", torch.bfloat16, 128, 16, "window"),
    Problem("f32-mask", torch.float32, 64, 32, "mask"),
    Problem("f32-causal", torch.float32, 64, 32, "causal"),
    Problem("f32-window", torch.float32, 64, 32, "window"),
)}
PATTERNS = ("documents", "random", "causal-dense")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--problems", nargs="+", choices=sorted(PROBLEMS), default=list(PROBLEMS))
    p.add_argument("--pattern", choices=PATTERNS, default="documents", help="dense mask of the *-mask problems")
    p.add_argument("--mask-heads", action="store_true", help="a mask per head, (B, H, N, N), instead of (B, 1, N, N)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--peers", default="cudnn,mem-efficient,flex",
                   help="comma-separated subset of cudnn, mem-efficient, flex, math")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results to this file")
    a = p.parse_args(argv)
    if a.batch < 1 or a.seqlen < 1 or a.reps < 1 or a.warmup < 0:
        p.error("--batch, --seqlen and --reps must be >= 1 and --warmup >= 0")
    unknown = set(a.peers.split(",")) - {"cudnn", "mem-efficient", "flex", "math", ""}
    if unknown:
        p.error(f"unknown peers: {sorted(unknown)}")
    return a


def dense_mask(pattern: str, B: int, heads: int, N: int, device: str, seed: int) -> torch.Tensor:
    """The (B, heads, N, N) bool mask of ``pattern`` (True: attend); every row attends a key."""
    g = torch.Generator().manual_seed(seed)
    i = torch.arange(N)
    if pattern == "random":
        m = torch.rand(B, heads, N, N, generator=g) < 0.5
        m[..., i, i] = True  # (no row without a key)
        return m.to(device)
    causal = i[:, None] >= i[None, :]
    if pattern == "causal-dense":
        return causal.expand(B, heads, N, N).contiguous().to(device)
    if pattern != "documents":
        raise ValueError(f"unknown pattern {pattern!r}")
    rows = []
    for _ in range(B):
        lengths = torch.randint(256, 1536, (N // 256 + 1,), generator=g)
        doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[:N]
        rows.append((doc[:, None] == doc[None, :]) & causal)
    return torch.stack(rows)[:, None].expand(B, heads, N, N).contiguous().to(device)


def window_mask(N: int, device: str) -> torch.Tensor:
    """The causal + window band as a dense (1, 1, N, N) bool mask."""
    i = torch.arange(N, device=device)
    d = i[:, None] - i[None, :]
    return ((d >= 0) & (d < WINDOW))[None, None]


def implementations(prob: Problem, mask: Optional[torch.Tensor], peers: Sequence[str], B: int, N: int,
                    device: str) -> Dict[str, Callable[..., torch.Tensor]]:
    """name -> attn(q, k, v) for pycudaflash and each requested peer that applies to the problem."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if prob.kind in ("mask", "fmask"):
        dense = mask if prob.kind == "mask" else torch.zeros(mask.shape, dtype=prob.dtype, device=device).masked_fill(
            ~mask, float("-inf"))
        ours: Callable[..., torch.Tensor] = lambda q, k, v: flash_attention(q, k, v, mask=dense)  # noqa: E731
        sdpa_args: Dict[str, Any] = dict(attn_mask=dense)
    elif prob.kind == "causal":
        ours = lambda q, k, v: flash_attention(q, k, v, causal=True)  # noqa: E731
        sdpa_args = dict(is_causal=True)
    else:
        ours = lambda q, k, v: flash_attention(q, k, v, causal=True, window=(WINDOW - 1, 0))  # noqa: E731
        sdpa_args = dict(attn_mask=window_mask(N, device))
    impls = {"pycudaflash": ours}

    def sdpa(backend: Any) -> Callable[..., torch.Tensor]:
        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, **sdpa_args)
        return run

    if "cudnn" in peers and prob.dtype != torch.float32:
        impls["sdpa-cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    if "mem-efficient" in peers:
        impls["sdpa-mem-efficient"] = sdpa(SDPBackend.EFFICIENT_ATTENTION)
    if "math" in peers:
        impls["sdpa-math"] = sdpa(SDPBackend.MATH)
    if "flex" in peers:
        impls["flex-compiled"] = _flex(prob, mask, B, N, device)
    return impls


def _flex(prob: Problem, mask: Optional[torch.Tensor], B: int, N: int, device: str) -> Callable[..., torch.Tensor]:
    """FlexAttention, compiled, with the problem's mask_mod and a block mask made here, once."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if prob.kind in ("mask", "fmask"):
        per_head = mask.shape[1] > 1

        def mask_mod(b: Any, h: Any, i: Any, j: Any) -> Any:
            return mask[b, h if per_head else 0, i, j]
        heads = prob.H if per_head else None
    elif prob.kind == "causal":
        def mask_mod(b: Any, h: Any, i: Any, j: Any) -> Any:
            return i >= j
        heads = None
    else:
        def mask_mod(b: Any, h: Any, i: Any, j: Any) -> Any:
            return (i >= j) & (i - j < WINDOW)
        heads = None
    block = create_block_mask(mask_mod, B if prob.kind in ("mask", "fmask") else None, heads, N, N, device=device)
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, block_mask=block)


def reference_rows(prob: Problem, mask: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, rows: int) -> torch.Tensor:
    """float64 attention of batch 0, head 0, its first ``rows`` query rows."""
    N, D = q.shape[2], q.shape[3]
    qi, kk, vv = (t[0, 0].detach().double() for t in (q[:, :, :rows], k, v))
    s = (qi @ kk.T) / math.sqrt(D)
    i = torch.arange(qi.shape[0], device=q.device)[:, None]
    j = torch.arange(N, device=q.device)[None, :]
    if prob.kind in ("mask", "fmask"):
        keep = mask[0, 0, :rows]
    elif prob.kind == "causal":
        keep = i >= j
    else:
        keep = (i >= j) & (i - j < WINDOW)
    s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ vv


def elapsed_ms(fn: Callable[[], Any], warmup: int, reps: int, device: str) -> float:
    """Mean ms of one ``fn()`` over ``reps`` calls after ``warmup`` (CUDA events; the wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    if device == "cpu":
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) * 1e3 / reps
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def run_problem(prob: Problem, a: argparse.Namespace) -> List[Dict[str, Any]]:
    """Rows of the table for one problem: per implementation fwd / bwd ms and its difference from ours."""
    B, N = a.batch, a.seqlen
    g = torch.Generator(device=a.device).manual_seed(a.seed)
    q, k, v, dout = (torch.randn(B, prob.H, N, prob.D, device=a.device, dtype=prob.dtype, generator=g)
                     for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    mask = (dense_mask(a.pattern, B, prob.H if a.mask_heads else 1, N, a.device, a.seed)
            if prob.kind in ("mask", "fmask") else None)
    rows: List[Dict[str, Any]] = []
    base: Optional[torch.Tensor] = None
    try:
        impls = implementations(prob, mask, a.peers.split(","), B, N, a.device)
    except Exception as exc:  # (e.g. no FlexAttention in this torch)
        impls = implementations(prob, mask, [p for p in a.peers.split(",") if p != "flex"], B, N, a.device)
        rows.append(dict(problem=prob.name, impl="flex-compiled", error=_reason(exc)))
    for name, attn in impls.items():
        row: Dict[str, Any] = dict(problem=prob.name, impl=name)
        try:
            with torch.no_grad():
                out = attn(q, k, v)
            if base is None:
                base = out.float()
                ref = reference_rows(prob, mask, q, k, v, min(N, 512))
                row["ref_max_abs_err"] = float((out[0, 0, :ref.shape[0]].double() - ref).abs().max())
            else:
                row["max_abs_diff_vs_ours"] = float((out.float() - base).abs().max())

            def fwd() -> None:
                with torch.no_grad():
                    attn(q, k, v)

            def fwd_bwd() -> None:
                q.grad = k.grad = v.grad = None
                attn(q, k, v).backward(dout)

            f = elapsed_ms(fwd, a.warmup, a.reps, a.device)
            row.update(fwd_ms=f, bwd_ms=elapsed_ms(fwd_bwd, a.warmup, a.reps, a.device) - f)
        except Exception as exc:  # (a backend without support for this problem)
            row["error"] = _reason(exc)
        rows.append(row)
    return rows


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]


def print_table(rows: Sequence[Dict[str, Any]]) -> None:
    """Markdown table: ms forward / backward, ours over each implementation, the checks."""
    ours = {r["problem"]: r for r in rows if r["impl"] == "pycudaflash" and "fwd_ms" in r}
    print("| problem | implementation | fwd ms | bwd ms | ours/it fwd | ours/it bwd | check |")
    print("|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['problem']} | {r['impl']} | n/a | n/a | | | {r['error']} |")
            continue
        o = ours.get(r["problem"])
        rf = f"{o['fwd_ms'] / r['fwd_ms']:.2f}" if o else ""
        rb = f"{o['bwd_ms'] / r['bwd_ms']:.2f}" if o and r["bwd_ms"] > 0 else ""
        check = (f"max err vs float64 {r['ref_max_abs_err']:.2e}" if "ref_max_abs_err" in r
                 else f"max diff vs ours {r['max_abs_diff_vs_ours']:.2e}")
        print(f"| {r['problem']} | {r['impl']} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | {rf} | {rb} | {check} |")


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    if a.device != "cpu" and not torch.cuda.is_available():
        print("CUDA is not available (use --device cpu for a small check)", file=sys.stderr)
        return 2
    print(f"B {a.batch}, N {a.seqlen}, pattern {a.pattern}, mask {'per head' if a.mask_heads else 'per batch'}, "
          f"torch {torch.__version__}, {torch.cuda.get_device_name() if a.device != 'cpu' else 'cpu'}")
    rows: List[Dict[str, Any]] = []
    for name in a.problems:
        rows += run_problem(PROBLEMS[name], a)
    print_table(rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
