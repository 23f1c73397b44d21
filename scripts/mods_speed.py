"""Speed of score and mask modifiers on the GPU (bf16, D = 128, B = 4, H = 16, N = 4096, causal off):
forward and forward + backward in ms for no modifier, ALiBi and soft-capping (score_mod), and a
document mask (mask_mod; and through a BlockMap built once) against FlexAttention compiled, where
torch has it, with the same documents (its block mask built once).

    python scripts/mods_speed.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from mask_speed import elapsed_ms  # (scripts/, beside this one)
from pycudaflash import BlockMap
from pycudaflash.torch import flash_attention

B, H, N, D = 4, 16, 4096, 128


def _time(attn, q, k, v, do) -> dict:
    def fwd():
        with torch.no_grad():
            attn(q, k, v)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        attn(q, k, v).backward(do)

    f = elapsed_ms(fwd, 2, 10, "cuda")
    return {"fwd_ms": round(f, 3), "bwd_ms": round(elapsed_ms(fwd_bwd, 2, 10, "cuda") - f, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    slope = (2.0 ** -torch.arange(1, H + 1, device="cuda", dtype=torch.float32) * 0.5).contiguous()
    lengths = torch.randint(256, 1536, (B, 8), generator=torch.Generator().manual_seed(1))
    # Documents of 256..1535 tokens; past the eighth, the rest of the sequence is document 7.
    doc = torch.stack([torch.nn.functional.pad(torch.repeat_interleave(torch.arange(8), row), (0, N), value=7)[:N]
                       for row in lengths]).to(torch.int32).cuda()
    res = {"shape": dict(B=B, H=H, N=N, D=D, dtype="bfloat16")}
    res["none"] = _time(lambda q, k, v: flash_attention(q, k, v), q, k, v, do)
    res["alibi"] = _time(lambda q, k, v: flash_attention(q, k, v, score_mod="score - slope[h] * abs(i - j)",
                                                         mod_tensors=dict(slope=slope)), q, k, v, do)
    res["softcap"] = _time(lambda q, k, v: flash_attention(q, k, v, score_mod="30 * tanh(score / 30)"), q, k, v, do)
    res["document_mask_mod"] = _time(lambda q, k, v: flash_attention(q, k, v, mask_mod="doc[b, i] == doc[b, j]",
                                                                     mod_tensors=dict(doc=doc)), q, k, v, do)
    # (its block maps built once, as FlexAttention's block mask below)
    block_map = BlockMap(mask_mod="doc[b, i] == doc[b, j]", mod_tensors=dict(doc=doc))
    res["document_block_map"] = _time(lambda q, k, v: flash_attention(q, k, v, block_map=block_map), q, k, v, do)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def doc_mask(b, h, i, j):
            return doc[b, i] == doc[b, j]

        block = create_block_mask(doc_mask, B, None, N, N, device="cuda")
        flex = torch.compile(flex_attention)
        res["document_flex_attention"] = _time(lambda q, k, v: flex(q, k, v, block_mask=block), q, k, v, do)
    except Exception as exc:  # (no FlexAttention in this torch, or it failed to compile)
        res["document_flex_attention"] = f"not run: {type(exc).__name__}: {exc}"[:300]
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
