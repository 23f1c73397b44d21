"""Host-side pieces of the driver layer that run without a GPU."""

from __future__ import annotations

import threading
from typing import Any, List

import pytest

from pycudaflash import _driver


def test_current_context_answers_each_thread_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads asking at once (the query releases the GIL) each get the context written for them."""
    both_wrote = threading.Barrier(2)
    handles = {"a": 0x1000, "b": 0x2000}

    def fake_get_current(ref: Any) -> int:
        ref._obj.value = handles[threading.current_thread().name]
        both_wrote.wait(timeout=10)  # (the other thread writes before this one reads)
        return 0

    monkeypatch.setattr(_driver, "_libcuda", lambda name: fake_get_current)
    got: List[Any] = []

    def ask() -> None:
        got.append((threading.current_thread().name, _driver.current_context()))

    threads = [threading.Thread(target=ask, name=n) for n in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert sorted(got) == sorted(handles.items())
