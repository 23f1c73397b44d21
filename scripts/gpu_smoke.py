"""Quick GPU smoke check: compile every variant, compare fwd/bwd against the float64 reference."""
import os, sys, time
import numpy as np

t0 = time.perf_counter()
import pycuda.driver as drv
import pycudaflash as pf
from pycudaflash import compiler, cuda_backend
from pycudaflash.reference import reference_forward, reference_backward

cuda_backend.activate()
res = compiler.warm_cache(jobs=16)
print(f"warm cache: {len(res)} variants in {time.perf_counter()-t0:.1f}s; slowest {max(r[2] for r in res):.1f}s", flush=True)

def rel(a, b):
    a = np.asarray(a, np.float64); b = np.asarray(b, np.float64)
    fin = np.isfinite(b)
    nb = np.linalg.norm(b[fin])
    return float(np.linalg.norm((a - b)[fin]) / (nb if nb else 1.0)), bool(np.all(np.isfinite(a) == fin))

rng = np.random.default_rng(0)
cases = []
for D in (1, 16, 33, 64, 100, 128, 200, 256):
    cases.append(dict(B=2, H=2, Nq=97, Nk=129, D=D))
cases += [
    dict(B=1, H=2, Nq=257, Nk=113, D=64, causal=True),
    dict(B=1, H=2, Nq=113, Nk=257, D=64, causal="bottom_right"),
    dict(B=1, H=2, Nq=300, Nk=300, D=128, window=(17, 5)),
    dict(B=2, H=1, Nq=200, Nk=300, D=64, key_lengths=np.array([0, 150], np.int32)),
    dict(B=2, H=2, Nq=130, Nk=70, D=32, mask="bool"),
    dict(B=2, H=2, Nq=130, Nk=70, D=96, mask="float"),
    dict(B=1, H=1, Nq=700, Nk=700, D=256, causal=True, window=(100, None)),
]
worst = 0
for c in cases:
    c = dict(c); B, H, Nq, Nk, D = (c.pop(x) for x in ("B", "H", "Nq", "Nk", "D"))
    mk = c.pop("mask", None)
    q = rng.standard_normal((B, H, Nq, D), dtype=np.float32)
    k = rng.standard_normal((B, H, Nk, D), dtype=np.float32)
    v = rng.standard_normal((B, H, Nk, D), dtype=np.float32)
    do = rng.standard_normal((B, H, Nq, D), dtype=np.float32)
    if mk == "bool":
        c["mask"] = rng.random((B, 1, Nq, Nk)) > 0.3
        c["mask"][:, :, 3, :] = False
    elif mk == "float":
        m = rng.standard_normal((Nq, Nk)).astype(np.float32)
        m[rng.random((Nq, Nk)) < 0.2] = -np.inf
        m[5, :] = -np.inf
        c["mask"] = m
    t1 = time.perf_counter()
    o, lse = pf.flash_attn_forward(q, k, v, backend="cuda", **c)
    dq, dk, dv = pf.flash_attn_backward(do, q, k, v, o, lse, backend="cuda", **c)
    dq2, dk2, dv2 = pf.flash_attn_backward(do, q, k, v, o, lse, backend="cuda", deterministic=True, **c)
    t2 = time.perf_counter()
    ro, rl = reference_forward(q, k, v, **c)
    rdq, rdk, rdv = reference_backward(do, q, k, v, **c)
    errs = [rel(o, ro), rel(lse, rl), rel(dq, rdq), rel(dk, rdk), rel(dv, rdv), rel(dq2, rdq)]
    worst = max([worst] + [e[0] for e in errs])
    print(f"B{B} H{H} Nq{Nq} Nk{Nk} D{D} {sorted(c.keys())} " + " ".join(f"{e[0]:.1e}{'' if e[1] else '!NF'}" for e in errs)
          + f"  det-bitsame-dk={np.array_equal(dk, dk2)} {t2-t1:.2f}s", flush=True)
print("worst", worst)
