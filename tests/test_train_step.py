"""scripts/train_step.py on the CPU: the table, the JSON and ``--profile``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[test]')")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import train_step  # noqa: E402


@pytest.mark.parametrize("name", [
    "flash_fwd_kernel", "flash_bwd_dkdv_kernel", "flash_bwd_preprocess", "flash_bwd_convert_dq",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false",
    "void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<64",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x",
    "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*",
    "void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*",
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80",
])
def test_attention_kernels_are_recognised(name: str) -> None:
    assert train_step.ATTENTION_KERNELS.search(name)


@pytest.mark.parametrize("name", [
    "nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_NNT",
    "void at::native::vectorized_elementwise_kernel<8, at::native::GeluCUDAKernelImpl(at::Tenso",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>(",
    "Memset (Device)",
])
def test_other_kernels_are_not_attention(name: str) -> None:
    assert not train_step.ATTENTION_KERNELS.search(name)


def test_cpu_run_with_profile(tmp_path: Any) -> None:
    out = tmp_path / "ts.json"
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_step.py"), "--device", "cpu", "--steps", "1", "--warmup", "1",
         "--rounds", "1", "--profile", "--profile-steps", "1", "--json", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "| shape | impl | ms/step median | GPU busy ms/step |" in res.stdout
    results = json.loads(out.read_text())["results"]
    assert {r["impl"] for r in results} == {"sdpa-flash", "sdpa-math", "pycudaflash"}
    flash = next(r for r in results if r["impl"] == "sdpa-flash")
    for r in results:
        assert "error" not in r, r.get("error")
        # Same weights and data: the first-step losses agree to float32 rounding (measured:
        # 4.8e-7 apart on a loss of 5.57).
        assert abs(r["first_loss"] - flash["first_loss"]) <= 1e-6 * abs(flash["first_loss"])
        pr = r["profile"]
        assert pr["gpu_busy_ms"] is None and pr["attention_gpu_ms"] is None  # (no GPU)
        assert all(pr[f"host_{k}_ms"] > 0 for k in ("forward", "backward", "optimizer"))
