"""The README's NumPy example runs as written, on any machine, and prints a small error."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _first_python_block_after(heading: str) -> str:
    text = README.read_text()
    start = text.index(heading)
    m = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert m is not None, f"no python block after {heading!r}"
    return m.group(1)


def test_numpy_example_runs_and_matches_the_reference() -> None:
    code = _first_python_block_after("## A first call")
    printed = io.StringIO()
    scope: dict = {}
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md (NumPy example)", "exec"), scope)
    err = float(printed.getvalue().split()[-1])
    assert 0.0 < err < 1e-5, f"the example's max error {err} is not the small float32 error it promises"
    assert scope["dq"].shape == scope["q"].shape and scope["dk"].shape == scope["k"].shape
