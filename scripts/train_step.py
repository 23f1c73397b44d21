#!/usr/bin/env python3
"""Time one GPT training step with pluggable attention: torch SDPA beside pycudaflash.

Method
------
* Model: a GPT-2 style decoder, ``--layers`` pre-LayerNorm blocks of width
  ``--width`` with ``--heads`` heads (head dim = width / heads), causal
  self-attention, an MLP of 4 x width with GELU (tanh form), learned
  position embeddings, a final LayerNorm and an LM head *tied* to the token
  embedding.  Init: normal(0, 0.02), output projections of each block
  scaled by 1/sqrt(2 * layers).  Optimizer: AdamW (lr 3e-4, betas
  (0.9, 0.95), weight decay 0.1 on every parameter; fused on CUDA).
* Precision: float32 weights; on CUDA the forward pass and the loss run under
  ``torch.autocast(device_type="cuda", dtype=torch.bfloat16)``, so the
  attention inputs are bfloat16; on the CPU everything is float32.
* Attention: the qkv projection output (B, N, 3C) is viewed as
  (B, N, 3, H, D) and each of q, k, v is a (B, H, N, D) ``transpose(1, 2)``
  view of it (no copy); the attention output is transposed back and
  reshaped to (B, N, C).  That code is the same for every implementation,
  which only supplies ``attn(q, k, v)`` and a context entered around the
  forward pass:

  - ``sdpa-flash``: ``F.scaled_dot_product_attention(..., is_causal=True)``
    under ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``;
  - ``sdpa-cudnn``: the same under ``SDPBackend.CUDNN_ATTENTION``;
  - ``sdpa-math``: the same under ``SDPBackend.MATH`` (CPU reference);
  - ``pycudaflash``: ``pycudaflash.torch.flash_attention(q, k, v, causal=True)``.
* Per shape (``--shapes``, batch x tokens): the model is built once with
  ``--seed``; every implementation trains a ``copy.deepcopy`` of those
  initial weights with a fresh AdamW on the same batch (random tokens from a
  fixed generator; targets are the inputs shifted by one).  A step is the
  forward pass, the cross-entropy loss, ``backward()``, ``optimizer.step()``
  and ``zero_grad(set_to_none=True)``.  Timing runs in ``--rounds`` rounds
  of every implementation in turn (the step is host-bound at these sizes,
  and the host's speed drifts by 10-20 % within seconds on the H200
  machine, hence many short rounds): each round ``--warmup`` untimed steps,
  then ``--steps`` steps each timed with CUDA events (``time.perf_counter``
  on the CPU); the median and mean ms per step over all rounds are
  reported.
* First-step loss: the loss of each implementation's first step, computed on
  its fresh copy before any update, so every implementation sees identical
  weights and data; ``|dloss|`` is its distance from sdpa-flash's.
* ratio = median ms/step of the implementation / that of sdpa-flash
  (<= 1: no slower than torch's flash backend).
* An implementation that raises (e.g. cuDNN without support for a shape) is
  reported as n/a with the reason.
* ``--profile`` (after the timing): per implementation, ``--profile-steps``
  more steps each with its host time split into the forward pass (with the
  loss), ``backward()`` and the optimizer (``time.perf_counter`` around each
  phase, nothing synchronised in between: on CUDA this is the time the host
  spends issuing work), medians reported; then as many steps under
  ``torch.profiler`` (CUDA activity), reporting the device time a step of
  every kernel, memset and copy ("GPU busy") and of the attention kernels
  (names matching :data:`ATTENTION_KERNELS`).  A step whose ms/step is well
  above its GPU busy time is bound by the host; a step where they are close,
  by the GPU.  On the CPU the GPU columns are n/a.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import math
import re
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: Kernel names counted as attention by ``--profile``: ours (flash_fwd_kernel, flash_bwd_*,
#: flash_convert_mask), FlashAttention-2's in torch (pytorch_flash::..., flash_bwd_dot_do_o_kernel,
#: flash_bwd_convert_dq_kernel), cuDNN's (cudnn_generated_..._sdpa_..., compute_dot_do_o_...,
#: convert_dq_to_16bits) and the memory-efficient backend's (fmha_cutlass...).
ATTENTION_KERNELS = re.compile(r"flash|fmha|sdpa|attention|dot_do_o|convert_dq", re.IGNORECASE)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)); x + mlp(ln2(x))."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.fc_proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, attn: AttnFn) -> torch.Tensor:
        B, N, C = x.shape
        H = self.heads
        qkv = self.qkv(self.ln1(x)).view(B, N, 3, H, C // H)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, N, D) views
        y = attn(q, k, v).transpose(1, 2).reshape(B, N, C)
        x = x + self.proj(y)
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Token + position embeddings, ``layers`` blocks, final LayerNorm, tied LM head."""

    def __init__(self, vocab: int, width: int, heads: int, layers: int, max_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(max_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor, attn: AttnFn) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x, attn)
        return self.head(self.ln_f(x))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@functools.lru_cache(maxsize=None)
def _flash_attention() -> Callable[..., torch.Tensor]:
    """pycudaflash's op, imported on first use (the SDPA rows run without pycudaflash)."""
    from pycudaflash.torch import flash_attention

    return flash_attention


def _ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _flash_attention()(q, k, v, causal=True)


#: name -> (attn function, factory of the context entered around the forward pass)
IMPLS: Dict[str, Tuple[AttnFn, Callable[[], Any]]] = {
    "sdpa-flash": (_sdpa, lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)),
    "sdpa-cudnn": (_sdpa, lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)),
    "sdpa-math": (_sdpa, lambda: sdpa_kernel(SDPBackend.MATH)),
    "pycudaflash": (_ours, contextlib.nullcontext),
}


def parse_args() -> argparse.Namespace:
    """Command-line options; CUDA defaults are the GPT-2 small sizes, CPU ones are tiny."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--layers", type=int, default=None, help="default 12 (CUDA) / 2 (CPU)")
    p.add_argument("--width", type=int, default=None, help="default 768 (CUDA) / 64 (CPU)")
    p.add_argument("--heads", type=int, default=None, help="default 12 (CUDA) / 2 (CPU)")
    p.add_argument("--vocab", type=int, default=None, help="default 8192 (CUDA) / 256 (CPU)")
    p.add_argument("--shapes", default=None, help="batch x tokens, comma separated; default "
                   "8x1024,2x4096,32x256 (CUDA) / 2x64 (CPU)")
    p.add_argument("--impls", default=None, help="comma separated subset of " + ",".join(IMPLS)
                   + "; default sdpa-flash,sdpa-cudnn,pycudaflash (CUDA) / sdpa-flash,sdpa-math,pycudaflash (CPU)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per implementation and round")
    p.add_argument("--steps", type=int, default=5, help="timed steps per implementation and round")
    p.add_argument("--rounds", type=int, default=10, help="rounds of every implementation in turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true",
                   help="after the timing, split each implementation's host time into phases and profile "
                        "its kernels' device time (see the method above)")
    p.add_argument("--profile-steps", type=int, default=3, help="steps of each --profile measurement")
    p.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    a = p.parse_args()
    cuda = a.device == "cuda"
    for name, gpu, cpu in (("layers", 12, 2), ("width", 768, 64), ("heads", 12, 2), ("vocab", 8192, 256),
                           ("shapes", "8x1024,2x4096,32x256", "2x64"),
                           ("impls", "sdpa-flash,sdpa-cudnn,pycudaflash", "sdpa-flash,sdpa-math,pycudaflash")):
        if getattr(a, name) is None:
            setattr(a, name, gpu if cuda else cpu)
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no GPU")
    if a.width % a.heads:
        p.error("--width must be a multiple of --heads")
    if a.steps < 1 or a.warmup < 0 or a.rounds < 1 or a.profile_steps < 1:
        p.error("--steps, --rounds and --profile-steps must be >= 1 and --warmup >= 0")
    try:
        a.shapes = [tuple(int(n) for n in s.lower().split("x")) for s in a.shapes.split(",")]
        assert all(len(s) == 2 and min(s) >= 1 for s in a.shapes)
    except (ValueError, AssertionError):
        p.error("--shapes must look like 8x1024,2x4096")
    a.impls = a.impls.split(",")
    unknown = [i for i in a.impls if i not in IMPLS]
    if unknown:
        p.error(f"unknown --impls {unknown}; choose from {list(IMPLS)}")
    return a


Step = Callable[..., torch.Tensor]


def make_step(base: GPT, name: str, idx: torch.Tensor, tgt: torch.Tensor) -> Step:
    """A training step of a fresh copy of ``base`` with one implementation's attention.

    ``step()`` runs it; ``step(marks)`` also appends ``time.perf_counter()``
    to the list ``marks`` at its start and after the forward pass, the
    backward pass and the optimizer.
    """
    attn, kernel_ctx = IMPLS[name]
    cuda = idx.is_cuda
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    amp = (lambda: torch.autocast(device_type="cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    clock = time.perf_counter

    def step(marks: Optional[List[float]] = None) -> torch.Tensor:
        if marks is not None:
            marks.append(clock())
        with amp(), kernel_ctx():
            logits = model(idx, attn)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), tgt.reshape(-1))
        if marks is not None:
            marks.append(clock())
        loss.backward()
        if marks is not None:
            marks.append(clock())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if marks is not None:
            marks.append(clock())
        return loss.detach()

    return step


def profile_step(step: Step, a: argparse.Namespace, cuda: bool) -> Dict[str, Any]:
    """``--profile`` figures of one implementation: median host ms of its phases over
    ``a.profile_steps`` steps, and (CUDA) the device ms a step of all kernels and of the attention
    kernels under ``torch.profiler``."""
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(a.warmup):
        step()
    sync()
    phases: Dict[str, List[float]] = {"forward": [], "backward": [], "optimizer": []}
    for _ in range(a.profile_steps):
        marks: List[float] = []
        step(marks)
        for name, t0, t1 in zip(phases, marks, marks[1:]):
            phases[name].append((t1 - t0) * 1e3)
    sync()
    out: Dict[str, Any] = {f"host_{k}_ms": statistics.median(v) for k, v in phases.items()}
    out.update(gpu_busy_ms=None, attention_gpu_ms=None)
    if not cuda:
        return out
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.profile_steps):
            step()
        sync()
    busy = attention = 0.0
    for e in prof.key_averages():
        us = float(getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0) or 0)
        if us <= 0:
            continue
        busy += us
        if ATTENTION_KERNELS.search(e.key):
            attention += us
    out.update(gpu_busy_ms=busy / a.profile_steps / 1e3, attention_gpu_ms=attention / a.profile_steps / 1e3)
    return out


def time_steps(step: Step, a: argparse.Namespace, cuda: bool) -> List[float]:
    """``a.warmup`` untimed steps, then the ms of each of ``a.steps`` steps."""
    for _ in range(a.warmup):
        step()
    if not cuda:
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(a.steps)]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def run_shape(base: GPT, idx: torch.Tensor, tgt: torch.Tensor, a: argparse.Namespace) -> List[Dict[str, Any]]:
    """Every implementation on one shape, timed in ``a.rounds`` interleaved rounds."""
    cuda = idx.is_cuda
    steps: Dict[str, Step] = {}
    rows: Dict[str, Dict[str, Any]] = {}
    for name in a.impls:
        rows[name] = {"impl": name, "times_ms": []}
        try:
            steps[name] = make_step(base, name, idx, tgt)
            rows[name]["first_loss"] = steps[name]().item()  # the loss of the fresh copy, before any update
        except Exception as e:  # reported, not fatal
            text = str(e).strip().replace("|", "/")
            rows[name]["error"] = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
            steps.pop(name, None)
    # Rounds: every implementation in turn, so that a change of clock or host load falls on all alike.
    for _ in range(a.rounds):
        for name, step in steps.items():
            rows[name]["times_ms"] += time_steps(step, a, cuda)
    for name in steps:
        t = rows[name]["times_ms"]
        rows[name].update(median_ms=statistics.median(t), mean_ms=statistics.fmean(t))
    if a.profile:
        for name, step in steps.items():
            rows[name]["profile"] = profile_step(step, a, cuda)
    return list(rows.values())


def _fmt(x: Optional[float], spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def main() -> None:
    a = parse_args()
    device = torch.device(a.device)
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch "
          f"{torch.__version__}; GPT {a.layers} layers, width {a.width}, {a.heads} heads (D "
          f"{a.width // a.heads}), vocab {a.vocab}, tied embeddings, "
          f"{'bf16 autocast' if device.type == 'cuda' else 'float32'}; {a.rounds} rounds of "
          f"{a.warmup} + {a.steps} steps")
    results: List[Dict[str, Any]] = []
    for B, N in a.shapes:
        torch.manual_seed(a.seed)
        base = GPT(a.vocab, a.width, a.heads, a.layers, N).to(device)
        gen = torch.Generator().manual_seed(a.seed + 1)
        tokens = torch.randint(a.vocab, (B, N + 1), generator=gen).to(device)
        idx, tgt = tokens[:, :-1], tokens[:, 1:]
        rows = run_shape(base, idx, tgt, a)
        for r in rows:
            r.update(shape=f"{B}x{N}", batch=B, tokens=N)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        flash = next((r for r in rows if r["impl"] == "sdpa-flash" and "error" not in r), None)
        for r in rows:
            ok = "error" not in r and flash is not None
            r["ratio_vs_flash"] = r["median_ms"] / flash["median_ms"] if ok else None
            r["loss_diff_vs_flash"] = abs(r["first_loss"] - flash["first_loss"]) if ok else None
        results += rows
        del base

    print()
    print("| shape | impl | ms/step median | ms/step mean | ratio vs sdpa-flash | first-step loss "
          "| abs(loss - flash loss) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        if "error" in r:
            print(f"| {r['shape']} | {r['impl']} | n/a | n/a | n/a | n/a | n/a ({r['error']}) |")
            continue
        print(f"| {r['shape']} | {r['impl']} | {r['median_ms']:.2f} | {r['mean_ms']:.2f} | "
              f"{_fmt(r['ratio_vs_flash'], '.3f')} | {r['first_loss']:.5f} | "
              f"{_fmt(r['loss_diff_vs_flash'], '.2e')} |")
    if a.profile:
        print()
        print("| shape | impl | ms/step median | GPU busy ms/step | attention kernels ms/step "
              "| host ms: forward | backward | optimizer |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for r in results:
            if "profile" not in r:
                continue
            pr = r["profile"]
            print(f"| {r['shape']} | {r['impl']} | {r['median_ms']:.2f} | {_fmt(pr['gpu_busy_ms'], '.2f')} | "
                  f"{_fmt(pr['attention_gpu_ms'], '.2f')} | {pr['host_forward_ms']:.2f} | "
                  f"{pr['host_backward_ms']:.2f} | {pr['host_optimizer_ms']:.2f} |")
    if a.json:
        config = {k: v for k, v in vars(a).items() if k != "json"}
        with open(a.json, "w") as f:
            json.dump({"config": config, "torch": torch.__version__,
                       "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                       "results": results}, f, indent=1)
        print(f"\nwrote {a.json}")
    print("done")


if __name__ == "__main__":
    main()
