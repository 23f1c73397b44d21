"""Shared test configuration: Hypothesis profiles and backend fixtures.

Profiles
--------
``ci``
    Bounded: a few dozen examples per property, no deadline.  The default
    where no CUDA device is usable.
``gpu``
    300 examples per property, no deadline.  The default where CUDA is usable.

Set ``PYCUDAFLASH_HYPOTHESIS_PROFILE`` to pick one explicitly.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest
from hypothesis import HealthCheck, settings

from pycudaflash.testing import selected_profile

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]

# Examples per property and input dtype (the properties are parametrized by
# dtype: float32, float16, bfloat16).
settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    suppress_health_check=_SLOW_OK,
    print_blob=True,
)
settings.register_profile(
    "gpu",
    max_examples=300,
    deadline=None,
    suppress_health_check=_SLOW_OK,
    print_blob=True,
)

PROFILE = selected_profile()
settings.load_profile(PROFILE)


def _cuda_status() -> tuple:
    try:
        from pycudaflash import cuda_status
    except Exception as exc:  # the package itself failed to import
        return False, f"pycudaflash is not importable ({type(exc).__name__}: {exc})"
    return cuda_status()


def pytest_report_header(config: pytest.Config) -> str:
    usable, reason = _cuda_status()
    return f"pycudaflash: hypothesis profile {PROFILE!r}; CUDA {'usable' if usable else 'unusable'}: {reason}"


_CUDA_ACTIVE = False


def _require_cuda() -> None:
    """Skip the calling test unless CUDA is usable; activate the context once."""
    global _CUDA_ACTIVE
    usable, reason = _cuda_status()
    if not usable:
        pytest.skip(f"CUDA backend unavailable: {reason}")
    if not _CUDA_ACTIVE:
        from pycudaflash import cuda_backend

        cuda_backend.activate()
        _CUDA_ACTIVE = True


@pytest.fixture(scope="session", params=["numpy", "cuda", "cuda-mma"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every backend: ``'numpy'`` always, ``'cuda'`` skipped with the reason
    when PyCUDA or a device is missing.  Session-scoped so that Hypothesis
    tests may use it.

    ``cuda-mma`` is the CUDA backend once more on a Hopper GPU, with the
    Hopper (wgmma) kernels switched off (``$PYCUDAFLASH_WGMMA=0``), so that
    the mma.sync kernels, which other GPUs run, are tested there too; the
    tests receive ``'cuda'``.  Elsewhere it skips: there 'cuda' already runs
    the mma.sync kernels.
    """
    if request.param == "numpy":
        yield "numpy"
        return
    _require_cuda()
    if request.param == "cuda":
        yield "cuda"
        return
    from pycudaflash import compiler

    arch = compiler.arch_of_current_device()
    if arch not in compiler.HOPPER_ARCHES:
        pytest.skip(f"{arch} has no Hopper kernels: the 'cuda' runs test the mma.sync kernels")
    saved = os.environ.get(compiler.HOPPER_ENV)
    os.environ[compiler.HOPPER_ENV] = "0"
    try:
        yield "cuda"
    finally:
        if saved is None:
            del os.environ[compiler.HOPPER_ENV]
        else:
            os.environ[compiler.HOPPER_ENV] = saved


@pytest.fixture(scope="session")
def cuda() -> Iterator[None]:
    """For GPU-only tests: skips with the reason when CUDA is unusable."""
    _require_cuda()
    yield None
