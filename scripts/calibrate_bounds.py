"""Measure the error bounds the property suite needs, over many drawn problems.

For every problem drawn by :func:`pycudaflash.testing.attention_problems`,
the forward and backward run on one backend and each result is compared with
the float64 reference.  For each quantity the script computes the smallest
``rtol`` with which :func:`pycudaflash.testing.check` (``atol = rtol *
noise floor``, element factor 4) would pass that example, and reports the
distribution of those values: the bounds in ``tests/test_properties.py``
should sit a margin above the maximum seen over several thousand examples.

    python3 scripts/calibrate_bounds.py --backend cuda --examples 3000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Dict, List

import numpy as np

QUANTITIES = ("out", "lse", "dq", "dk", "dv")
ELEM_FACTOR = 4.0  # as check()'s default


def needed_rtol(out: np.ndarray, ref: np.ndarray, floor: np.ndarray, exact: np.ndarray) -> float:
    """Smallest rtol for which check(out, ref, rtol_norm=rtol, atol=rtol*floor) passes.

    Returns inf when no rtol passes (non-finite mismatch, or an element that
    must be exact is not).
    """
    o = np.asarray(out, np.float64)
    r = np.asarray(ref, np.float64)
    fl = np.broadcast_to(np.asarray(floor, np.float64), r.shape)
    ex = np.broadcast_to(np.asarray(exact, bool), r.shape)
    fin = np.isfinite(r)
    if not np.array_equal(np.isfinite(o), fin) or np.any(o[~fin] != r[~fin]):
        return float("inf")
    if np.any(ex & fin & (o != r)):
        return float("inf")
    with np.errstate(invalid="ignore"):
        diff = np.abs(np.where(fin, o - r, 0.0))
    max_ref = float(np.max(np.abs(r), where=fin, initial=0.0))
    ref_norm = float(np.sqrt(np.sum(np.where(fin, r * r, 0.0))))
    floor_norm = float(np.sqrt(np.sum(np.where(fin, fl * fl, 0.0))))
    err_norm = float(np.sqrt(np.sum(diff * diff)))
    need = 0.0
    if err_norm > 0.0:
        den = ref_norm + floor_norm
        need = err_norm / den if den > 0.0 else float("inf")
    scale = ELEM_FACTOR * np.maximum(fl, max_ref)
    with np.errstate(divide="ignore", invalid="ignore"):
        elem = np.where(diff > 0.0, diff / scale, 0.0)
    return max(need, float(np.max(elem, initial=0.0)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("cuda", "numpy"), default="cuda")
    ap.add_argument("--examples", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="stop measuring after this long and report what was seen")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)

    from hypothesis import HealthCheck, Phase, given, seed, settings

    from pycudaflash import flash_attn_backward, flash_attn_forward
    from pycudaflash.reference import reference_backward, reference_forward
    from pycudaflash.testing import attention_kwargs, attention_problems, make_inputs, noise_floors, to_host

    if args.backend == "cuda":
        from pycudaflash import cuda_backend

        cuda_backend.activate()

    needs: Dict[str, List[float]] = {q: [] for q in QUANTITIES}
    t0 = time.perf_counter()
    worst: Dict[str, tuple] = {}

    @seed(args.seed)
    @settings(max_examples=args.examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(problem=attention_problems())
    def one(problem) -> None:
        if args.max_seconds is not None and time.perf_counter() - t0 > args.max_seconds:
            return  # over the time budget: the remaining draws are not measured
        x = make_inputs(problem)
        kw = attention_kwargs(problem, x)
        out, lse = flash_attn_forward(x["q"], x["k"], x["v"], backend=args.backend, **kw)
        dq, dk, dv = flash_attn_backward(x["dout"], x["q"], x["k"], x["v"], out, lse, backend=args.backend, **kw)
        ref_out, ref_lse = reference_forward(x["q"], x["k"], x["v"], **kw)
        ref = dict(zip(("dq", "dk", "dv"), reference_backward(x["dout"], x["q"], x["k"], x["v"], **kw)))
        ref.update(out=ref_out, lse=ref_lse)
        got = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
        floors = noise_floors(x["q"], x["k"], x["v"], x["dout"], **kw)
        empty = ~np.isfinite(ref_lse)
        unseen = np.all(ref["dv"] == 0.0, axis=-1, keepdims=True)
        exact = dict(out=empty[..., None], lse=np.zeros((), bool), dq=empty[..., None], dk=unseen, dv=unseen)
        for name in QUANTITIES:
            n = needed_rtol(to_host(got[name]), ref[name], floors[name], exact[name])
            needs[name].append(n)
            if n > worst.get(name, (-1.0,))[0]:
                worst[name] = (n, repr(problem))

    one()
    secs = time.perf_counter() - t0
    print(f"backend {args.backend}: {len(needs['out'])} examples in {secs:.0f} s")
    summary = {}
    for name in QUANTITIES:
        v = np.array(needs[name])
        summary[name] = {"max": float(v.max()), "p99.9": float(np.quantile(v, 0.999)),
                         "p99": float(np.quantile(v, 0.99)), "median": float(np.median(v)),
                         "worst_problem": worst[name][1]}
        print(f"  {name:3s} needed rtol: max {v.max():.3g}  p99.9 {summary[name]['p99.9']:.3g}  "
              f"p99 {summary[name]['p99']:.3g}  median {summary[name]['median']:.3g}")
        print(f"      worst: {worst[name][1]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "examples": len(needs["out"]), "summary": summary}, f, indent=1)
    if args.backend == "cuda":
        cuda_backend.deactivate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
