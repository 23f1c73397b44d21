"""GPU timing with CUDA events, and FLOP counts for attention.

The timers record ``pycuda.driver.Event`` objects on the caller's stream, so
they measure time on the device (from the moment the stream reaches the start
event to the moment it reaches the end event), not host launch overhead.
PyCUDA is imported inside the functions: this module imports without it.

Example
-------
>>> import pycuda.driver as drv
>>> stream = drv.Stream()
>>> res = time_cuda(lambda i: flash_attn_forward(*inputs[i], stream=stream),
...                 stream=stream, rotate=len(inputs))      # doctest: +SKIP
>>> res.median_ms, tflops(attention_flops(B, H, N, N, D, causal=False), res.median_ms)
...                                                          # doctest: +SKIP
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple

__all__ = ["TimingResult", "time_cuda", "CudaTimer", "attention_flops", "tflops", "median_interval"]


@dataclass(frozen=True)
class TimingResult:
    """Per-call device times of a timed loop, in milliseconds.

    Attributes
    ----------
    times_ms : tuple of float
        Time of every timed call, in call order (warm-up calls excluded).
    median_ms, min_ms, mean_ms, max_ms, stdev_ms : float
        Summary statistics of ``times_ms`` (``stdev_ms`` is 0 for one call).
    median_ci_ms : (float, float)
        A distribution-free 95 % confidence interval of the median
        (:func:`median_interval`).
    """

    times_ms: Tuple[float, ...]
    median_ms: float
    min_ms: float
    mean_ms: float
    max_ms: float
    stdev_ms: float
    median_ci_ms: Tuple[float, float]

    @classmethod
    def from_times(cls, times_ms: Sequence[float]) -> "TimingResult":
        """Summarise a non-empty sequence of per-call times (ms)."""
        times = tuple(float(t) for t in times_ms)
        if not times:
            raise ValueError("no times to summarise")
        return cls(
            times_ms=times,
            median_ms=statistics.median(times),
            min_ms=min(times),
            mean_ms=statistics.fmean(times),
            max_ms=max(times),
            stdev_ms=statistics.stdev(times) if len(times) > 1 else 0.0,
            median_ci_ms=median_interval(times),
        )

    def as_dict(self) -> dict:
        """Plain-dict form (for JSON output)."""
        return {
            "median_ms": self.median_ms,
            "min_ms": self.min_ms,
            "mean_ms": self.mean_ms,
            "max_ms": self.max_ms,
            "stdev_ms": self.stdev_ms,
            "median_ci_ms": list(self.median_ci_ms),
            "times_ms": list(self.times_ms),
        }

    def __str__(self) -> str:
        return (
            f"median {self.median_ms:.4f} ms (95 % CI {self.median_ci_ms[0]:.4f}-{self.median_ci_ms[1]:.4f}), "
            f"min {self.min_ms:.4f} ms, "
            f"mean {self.mean_ms:.4f} ms over {len(self.times_ms)} calls"
        )


def median_interval(samples: Sequence[float], level: float = 0.95) -> Tuple[float, float]:
    """A confidence interval of the median of the distribution ``samples`` were drawn from.

    Distribution-free (timings are skewed, often bimodal): with ``n`` sorted
    samples ``x(1) <= ... <= x(n)``, ``[x(j), x(n + 1 - j)]`` misses the
    median with probability ``2 P(X < j)``, ``X ~ Binomial(n, 1/2)``; ``j`` is
    the largest rank that keeps this at most ``1 - level``.  Below 6
    samples no rank does, and the interval is ``(min, max)``, whose coverage
    is then less than ``level``.
    """
    from scipy.stats import binom

    x = sorted(float(t) for t in samples)
    n = len(x)
    if n == 0:
        raise ValueError("no samples")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    j = int(binom.ppf((1.0 - level) / 2.0, n, 0.5))  # (a first guess, then adjusted exactly)
    while j >= 1 and 2.0 * binom.cdf(j - 1, n, 0.5) > 1.0 - level:
        j -= 1
    while 2.0 * binom.cdf(j, n, 0.5) <= 1.0 - level:
        j += 1
    j = max(j, 1)
    return x[j - 1], x[n - j]


def time_cuda(
    fn: Callable[[int], Any],
    *,
    stream: Any,
    warmup: int = 5,
    repeat: int = 20,
    rotate: Optional[int] = None,
) -> TimingResult:
    """Time ``fn`` on ``stream`` with CUDA events, one event pair per call.

    ``fn(i)`` must enqueue its work on ``stream`` and must not synchronise
    with the host for the times to be meaningful (enqueued calls then run
    back to back on the device).  An event is recorded on ``stream`` just
    before and just after each timed call; the host waits once, after the
    last call, and reads every interval.

    Parameters
    ----------
    fn : callable taking an int
        Enqueues one call.  It receives the call's index, counted from 0
        across the warm-up and the timed calls (``warmup + repeat`` calls in
        all), reduced modulo ``rotate`` when given, so the caller can cycle
        through several independent input sets (to defeat the L2 cache).
    stream : pycuda.driver.Stream or None
        The stream ``fn`` enqueues on (None: the default stream).
    warmup : int, optional
        Untimed calls made first; the stream is synchronised after them, so
        one-off costs (compilation, module loading, allocation) are excluded.
    repeat : int, optional
        Timed calls, at least 1.
    rotate : int, optional
        Number of input sets to cycle through (``fn`` gets ``i % rotate``).

    Returns
    -------
    TimingResult
        Device time of each timed call and their median, min, mean and max.
    """
    import pycuda.driver as drv

    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if rotate is not None and rotate < 1:
        raise ValueError(f"rotate must be None or >= 1, got {rotate}")

    def index(n: int) -> int:
        return n % rotate if rotate else n

    for n in range(warmup):
        fn(index(n))
    if warmup:
        if stream is None:
            drv.Context.synchronize()
        else:
            stream.synchronize()

    starts = [drv.Event() for _ in range(repeat)]
    ends = [drv.Event() for _ in range(repeat)]
    for r in range(repeat):
        starts[r].record(stream)
        fn(index(warmup + r))
        ends[r].record(stream)
    ends[-1].synchronize()
    return TimingResult.from_times([e.time_since(s) for s, e in zip(starts, ends)])


class CudaTimer:
    """Context manager timing the work enqueued on a stream inside its block.

    Records an event on ``stream`` on entry and another on exit, then waits
    for the exit event; :attr:`elapsed_ms` holds the device time between them.

    Parameters
    ----------
    stream : pycuda.driver.Stream or None
        The stream to record on (None: the default stream).

    Examples
    --------
    >>> with CudaTimer(stream) as t:                          # doctest: +SKIP
    ...     flash_attn_forward(q, k, v, stream=stream)
    >>> t.elapsed_ms                                          # doctest: +SKIP
    """

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream
        self.elapsed_ms: Optional[float] = None
        self._start: Any = None
        self._end: Any = None

    def __enter__(self) -> "CudaTimer":
        import pycuda.driver as drv

        self._start = drv.Event()
        self._end = drv.Event()
        self.elapsed_ms = None
        self._start.record(self.stream)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._end.record(self.stream)
        self._end.synchronize()
        self.elapsed_ms = float(self._end.time_since(self._start))


def attention_flops(
    B: int,
    H: int,
    Nq: int,
    Nk: int,
    D: int,
    *,
    causal: bool,
    backward: bool = False,
) -> float:
    """Floating-point operations of one attention pass, as FlashAttention counts them.

    The forward pass has two matrix products (``Q K^T`` and ``P V``) of
    ``2 * Nq * Nk * D`` operations each per head: ``4 * B * H * Nq * Nk * D``.
    Causal masking halves it; the backward pass counts 2.5 times the forward
    (five matrix products against two).  This is the convention of the
    FlashAttention papers and benchmarks, so TFLOP/s figures are comparable
    with theirs.  It ignores the softmax, the work skipped by windows, key
    lengths and masks, and the exact causal triangle when ``Nq != Nk``.

    Parameters
    ----------
    B, H, Nq, Nk, D : int
        Batch size, heads, query length, key length, head dimension.
    causal : bool
        Whether the pass is causal (halves the count).
    backward : bool, optional
        Count the backward pass instead of the forward.

    Returns
    -------
    float
        The operation count.
    """
    flops = 4.0 * B * H * Nq * Nk * D
    if causal:
        flops /= 2.0
    if backward:
        flops *= 2.5
    return flops


def tflops(flops: float, ms: float) -> float:
    """Throughput in TFLOP/s of ``flops`` operations done in ``ms`` milliseconds.

    Parameters
    ----------
    flops : float
        Operation count (see :func:`attention_flops`).
    ms : float
        Time in milliseconds; must be positive.

    Returns
    -------
    float
        ``flops / (ms * 1e-3) / 1e12``; ``nan`` when ``ms`` is not positive.
    """
    if not ms > 0:
        return float("nan")
    return flops / (ms * 1e-3) / 1e12
