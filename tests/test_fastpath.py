"""The C++ host path of the torch operators (``pycudaflash._fastpath``) builds and registers.

Without a GPU these tests compile ``csrc/torch_ops.cpp`` against the installed
torch and load it, so a C++ error shows in CI; what it computes is tested on
the GPU (``test_torch_op.test_cpp_host_path_gives_the_python_paths_bits``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[test]')")

from pycudaflash import _fastpath  # noqa: E402
from pycudaflash.torch import flash_attention  # noqa: E402


def _compiler() -> str:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx!r} is not on PATH)")
    return cxx


def test_library_builds_loads_and_registers_the_cuda_kernels(tmp_path: Path) -> None:
    _compiler()
    path = tmp_path / "torch_ops.so"
    _fastpath.build(path)
    torch.ops.load_library(str(path))
    for op, key in (("flash_fwd", "CUDA"), ("flash_bwd", "CUDA"), ("flash_fwd", "AutogradCUDA")):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"pycudaflash::{op}", key), (op, key)
    # CPU tensors keep their Python kernels and autograd.
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g, requires_grad=True) for _ in range(3))
    out = flash_attention(q, k, v, causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    (dq,) = torch.autograd.grad(out.sum(), (q,))
    (rq,) = torch.autograd.grad(ref.sum(), (q,))
    assert torch.allclose(dq, rq, atol=1e-5, rtol=1e-5)


def _parse(lib: Any, words: list) -> tuple:
    import ctypes

    arr = (ctypes.c_int64 * len(words))(*words)
    msg = ctypes.create_string_buffer(512)
    lib.pycudaflash_fast_parse.restype = ctypes.c_int64
    n = lib.pycudaflash_fast_parse(arr, ctypes.c_int64(len(words)), msg, ctypes.c_int64(len(msg)))
    return n, msg.value.decode(errors="replace")


def test_the_library_reads_the_plan_layout_with_tensor_maps(tmp_path: Path) -> None:
    """A plan in the layout cuda_backend._Plan.export writes, with a tensor map whose arguments
    are pycudaflash._tma.encode_args', parses; a map of the wrong length or out of the struct
    is refused with the reason."""
    import ctypes

    from pycudaflash import _tma
    from pycudaflash.cuda_backend import EXPORT_STRUCT, EXPORT_VERSION

    _compiler()
    path = tmp_path / "torch_ops.so"
    _fastpath.build(path)
    torch.ops.load_library(str(path))
    lib = ctypes.CDLL(str(path))
    args = list(_tma.encode_args(_tma.tile_map((2, 4, 100, 128), (51200, 12800, 128, 1), "bfloat16", 128)))
    n_words = 32

    def plan(map_word: int = 16, map_args: list = args) -> list:
        head = [EXPORT_VERSION, 0, 9, 6, 7, -1, 0, 0, 0, n_words, 1, 1]
        kernel = [0, 1, 1, 1, 384, 1, 1, 0, 1, EXPORT_STRUCT, 0]
        return head + [0] * n_words + [map_word, 0, len(map_args), *map_args] + kernel

    assert _parse(lib, plan()) == (1, "")
    n, why = _parse(lib, plan(map_args=args[:-1]))
    assert n == -1 and "tensor map" in why
    n, why = _parse(lib, plan(map_word=24))  # (16 words from 24 pass the 32 of the struct)
    assert n == -1 and "tensor map out of place" in why


def test_library_takes_the_processs_cxx_runtime(tmp_path: Path) -> None:
    """The library links against the libstdc++ torch loaded, never a static copy of its own
    (two C++ runtimes in one process crash on the first formatted error message)."""
    cxx = _compiler()
    if shutil.which("nm") is None:
        pytest.skip("no nm to read the library's symbols")
    runtime = _fastpath.cxx_runtime()
    assert runtime is not None and Path(runtime).exists(), "torch's libstdc++ is not in /proc/self/maps"
    assert runtime in _fastpath.compile_command(_fastpath.SOURCE, tmp_path / "x.so")
    path = tmp_path / "torch_ops.so"
    _fastpath.build(path)
    assert not _fastpath.own_runtime(path)
    # The check itself tells a library linked as compile_command links from one with a static runtime.
    src = tmp_path / "probe.cpp"
    src.write_text('#include <locale>\nextern "C" const void *probe() { return &std::locale::classic(); }\n')
    for flags, carries in (([runtime], False), (["-static-libstdc++"], True)):
        lib = tmp_path / f"probe{len(flags)}.so"
        # (the runtime after the source, as in compile_command: a linker with --as-needed drops a
        # shared library that nothing before it needs)
        subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", str(lib), *flags], check=True)
        assert _fastpath.own_runtime(lib) is carries, flags


def test_a_failed_build_reports_the_compiler_error(tmp_path: Path, monkeypatch: Any) -> None:
    _compiler()
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++;\n")
    monkeypatch.setattr(_fastpath, "SOURCE", bad)
    with pytest.raises(RuntimeError, match="broken.cpp"):
        _fastpath.build(tmp_path / "broken.so")
    assert not (tmp_path / "broken.so").exists()


def test_the_environment_variable_turns_the_path_off(monkeypatch: Any) -> None:
    monkeypatch.setenv(_fastpath.ENV, "0")
    assert not _fastpath.enabled()
    monkeypatch.setenv(_fastpath.ENV, "1")
    assert _fastpath.enabled()


def test_status_says_off_unbuilt_or_built(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(_fastpath, "_state", None)
    monkeypatch.setenv(_fastpath.ENV, "0")
    assert _fastpath.status().startswith("off")
    monkeypatch.setenv(_fastpath.ENV, "1")
    lib = tmp_path / "torch-ops" / "torch_ops-x.so"
    monkeypatch.setattr(_fastpath, "library_path", lambda: lib)
    assert _fastpath.status().startswith("not built yet")
    lib.parent.mkdir()
    lib.write_bytes(b"")
    assert _fastpath.status() == f"built, not loaded yet: {lib}"
