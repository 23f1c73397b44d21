"""scripts/mask_speed.py on the CPU: its masks, its checks (which catch a wrong mask) and its table."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[test]')")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import mask_speed  # noqa: E402


@pytest.mark.parametrize("pattern", mask_speed.PATTERNS)
def test_masks_leave_every_row_a_key(pattern: str) -> None:
    m = mask_speed.dense_mask(pattern, 2, 3, 600, "cpu", seed=1)
    assert m.shape == (2, 3, 600, 600) and m.dtype == torch.bool
    assert m.any(dim=-1).all()
    if pattern == "random":
        assert 0.45 < m.float().mean() < 0.55
    else:  # (causal inside: no key after its row)
        assert not torch.triu(m, diagonal=1).any()
    if pattern == "documents":  # (two batch elements with different documents, the first one 256+ long)
        assert not torch.equal(m[0], m[1]) and m[0, 0, 255, :256].all()


def _args(*extra: str) -> Any:
    return mask_speed.parse_args(["--device", "cpu", "--batch", "1", "--seqlen", "97", "--peers", "math",
                                  "--reps", "1", "--warmup", "0", *extra])


@pytest.mark.parametrize("name", ["f32-mask", "f32-window"])
def test_rows_check_ours_against_float64_and_the_peer_against_ours(name: str) -> None:
    rows = mask_speed.run_problem(mask_speed.PROBLEMS[name], _args("--pattern", "random"))
    ours, math_ = rows
    assert ours["impl"] == "pycudaflash" and ours["ref_max_abs_err"] < 2e-6  # (measured 4e-7: float32)
    assert math_["impl"] == "sdpa-math" and math_["max_abs_diff_vs_ours"] < 2e-6
    assert ours["fwd_ms"] > 0 and math_["fwd_ms"] > 0


def test_a_mask_ignored_shows_in_the_check(monkeypatch: Any) -> None:
    real = mask_speed.flash_attention
    monkeypatch.setattr(mask_speed, "flash_attention", lambda q, k, v, mask=None, **kw: real(q, k, v, **kw))
    ours, math_ = mask_speed.run_problem(mask_speed.PROBLEMS["f32-mask"], _args("--pattern", "random"))
    assert ours["ref_max_abs_err"] > 1e-2 and math_["max_abs_diff_vs_ours"] > 1e-2


def test_table_prints_every_row(capsys: Any) -> None:
    assert mask_speed.main(["--device", "cpu", "--batch", "1", "--seqlen", "33", "--peers", "math", "--reps", "1",
                            "--warmup", "0", "--problems", "f32-causal", "bf16-mask"]) == 0
    out = capsys.readouterr().out
    for problem in ("f32-causal", "bf16-mask"):
        for impl in ("pycudaflash", "sdpa-math"):
            assert f"| {problem} | {impl} |" in out
