"""``python -m pycudaflash warm`` builds the torch operators' C++ host path beside the kernel variants."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[test]')")

from pycudaflash import __main__ as cli  # noqa: E402
from pycudaflash import _fastpath  # noqa: E402


@pytest.fixture
def fake_build(tmp_path: Path, monkeypatch: Any) -> list:
    """library_path in tmp_path; build writes a file and records its path."""
    built: list = []
    monkeypatch.delenv(_fastpath.ENV, raising=False)
    monkeypatch.setattr(_fastpath, "library_path", lambda: tmp_path / "torch_ops-x.so")

    def build(path: Path) -> None:
        built.append(path)
        path.write_bytes(b"\x7fELF")
    monkeypatch.setattr(_fastpath, "build", build)
    return built


def test_builds_once_then_finds_it_built(fake_build: list, tmp_path: Path) -> None:
    ok, line = cli.warm_torch_ops()
    assert ok and "built in" in line and fake_build == [tmp_path / "torch_ops-x.so"]
    ok, line = cli.warm_torch_ops()
    assert ok and "built already" in line and len(fake_build) == 1


def test_off_builds_nothing(fake_build: list, monkeypatch: Any) -> None:
    monkeypatch.setenv(_fastpath.ENV, "0")
    ok, line = cli.warm_torch_ops()
    assert ok and "off" in line and not fake_build


def test_a_failed_build_fails_warm(fake_build: list, monkeypatch: Any) -> None:
    def broken(path: Path) -> None:
        raise RuntimeError("building torch_ops.cpp failed (1):\nerror: boom")
    monkeypatch.setattr(_fastpath, "build", broken)
    ok, line = cli.warm_torch_ops()
    assert not ok and "boom" in line


def test_warm_reports_the_cpp_path_and_its_status(fake_build: list, monkeypatch: Any, capsys: Any) -> None:
    """The command's status is that of the variants (1 here: no PyCUDA, or a stubbed failure) and of
    the C++ path; its line is printed either way."""
    for variants_status in (0, 1):
        monkeypatch.setattr(cli, "_warm_variants", lambda args, s=variants_status: s)
        assert cli.main(["warm"]) == variants_status
        assert "C++ host path:" in capsys.readouterr().out
    monkeypatch.setattr(cli, "_warm_variants", lambda args: 0)
    monkeypatch.setattr(cli, "warm_torch_ops", lambda: (False, "C++ host path: the build failed (x)"))
    assert cli.main(["warm"]) == 1
