"""scripts/bench.py pieces that need no GPU (option checks, the merging of timing rounds) and the
confidence interval of its medians."""

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from pycudaflash.timing import TimingResult

_SPEC = importlib.util.spec_from_file_location(
    "bench", Path(__file__).resolve().parents[1] / "scripts" / "bench.py")
bench = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("bench", bench)  # (its dataclasses look their module up)
_SPEC.loader.exec_module(bench)


def _impl(name: str, fwd_ms, bwd_ms, flops=1e12) -> "bench.ImplResult":
    r = bench.ImplResult(name)
    r.fwd = bench._measure(TimingResult.from_times(fwd_ms), flops)
    r.bwd = bench._measure(TimingResult.from_times(bwd_ms), 2.5 * flops)
    return r


def test_rounds_option() -> None:
    assert bench.parse_args([]).rounds == 1
    assert bench.parse_args(["--rounds", "3"]).rounds == 3
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])


def test_merge_rounds_pools_every_call() -> None:
    first = _impl("pycudaflash", [1.0, 1.0, 1.2], [2.0, 2.2, 2.4])
    first.check = {"out": 1e-4}
    second = _impl("pycudaflash", [1.2, 1.3, 1.3], [2.6, 2.6, 2.8])
    merged = bench.merge_rounds([first, second], 1e12, 2.5e12)
    assert merged.name == "pycudaflash" and merged.check == {"out": 1e-4}
    assert merged.fwd.timing["median_ms"] == pytest.approx(1.2)  # of all six calls
    assert merged.bwd.timing["median_ms"] == pytest.approx(2.5)
    assert merged.fwd.tflops == pytest.approx(1e12 / 1.2e-3 / 1e12)
    assert len(merged.fwd.timing["times_ms"]) == 6
    assert bench.merge_rounds([first], 1e12, 2.5e12) is first


def test_merge_rounds_keeps_an_error() -> None:
    ok = _impl("torch-flash", [1.0], [2.0])
    failed = bench.ImplResult("torch-flash")
    failed.bwd.error = "RuntimeError: boom"
    failed.fwd = bench._measure(TimingResult.from_times([1.1]), 1e12)
    merged = bench.merge_rounds([ok, failed], 1e12, 2.5e12)
    assert merged.bwd.error == "RuntimeError: boom" and math.isnan(merged.bwd.ms)
    assert merged.fwd.timing["median_ms"] == pytest.approx(1.05)


def test_settle_option() -> None:
    assert bench.parse_args([]).settle == 0.5
    assert bench.parse_args(["--settle", "0"]).settle == 0.0
    for bad in ("-0.1", "61"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--settle", bad])


def test_settle_synchronises_then_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    calls = []
    drv = types.ModuleType("pycuda.driver")
    drv.Context = types.SimpleNamespace(synchronize=lambda: calls.append("sync"))
    pycuda = types.ModuleType("pycuda")
    pycuda.driver = drv
    monkeypatch.setitem(sys.modules, "pycuda", pycuda)
    monkeypatch.setitem(sys.modules, "pycuda.driver", drv)
    monkeypatch.setattr(bench.time, "sleep", lambda s: calls.append(("sleep", s)))
    bench.settle(0.25)
    bench.settle(0.0)
    assert calls == ["sync", ("sleep", 0.25), "sync"]


def test_median_interval_uses_the_binomial_ranks() -> None:
    from pycudaflash.timing import median_interval

    # n = 100: ranks 40 and 61 (the tabulated 95 % interval); n = 9: ranks 2 and 8.
    assert median_interval(list(range(1, 101))) == (40.0, 61.0)
    assert median_interval([9, 1, 8, 2, 7, 3, 6, 4, 5]) == (2.0, 8.0)
    assert median_interval([2.0, 1.0]) == (1.0, 2.0)  # too few samples: the range


def test_median_interval_covers_the_median_at_its_level() -> None:
    from pycudaflash.timing import median_interval

    # Skewed samples (exponential, median log 2): coverage of 3000 intervals of 25 samples
    # lies within 3 standard errors of the exact coverage of ranks 8 and 18 (0.9567).
    rng = np.random.default_rng(7)
    hits = sum(lo <= np.log(2) <= hi for lo, hi in (median_interval(rng.exponential(size=25)) for _ in range(3000)))
    se = (0.9567 * 0.0433 / 3000) ** 0.5
    assert abs(hits / 3000 - 0.9567) < 3 * se
