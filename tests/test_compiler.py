"""Kernel selection, defines and shared-memory sizes of pycudaflash.compiler (CPU only)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pycudaflash import compiler

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def hopper_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(compiler.HOPPER_ENV, raising=False)


def test_hopper_passes_on_sm90_only(hopper_on: None) -> None:
    for dtype in ("float16", "bfloat16"):
        assert compiler.pass_name("fwd", dtype, "sm_90", 128) == "fwd_sm90"
        assert compiler.pass_name("bwd", dtype, "sm_90", 128) == "bwd_sm90"
        for arch in ("sm_80", "sm_86", "sm_89", "sm_100", None):
            assert compiler.pass_name("fwd", dtype, arch, 128) == "fwd_f16"
            assert compiler.pass_name("bwd", dtype, arch, 128) == "bwd_f16"
    assert compiler.pass_name("fwd", "float32", "sm_90", 64) == "fwd"
    assert compiler.pass_name("bwd", "float32", "sm_90", 64) == "bwd"


def test_hopper_backward_coverage(hopper_on: None) -> None:
    # Every bucket and mask kind but a float mask at head dim 128 (its
    # addressing would spill there), which stays on the mma.sync kernel.
    for hd in compiler.HEAD_DIM_BUCKETS_F16:
        for mk in compiler.MASK_MODES:
            want = "bwd_f16" if (hd, mk) == (128, "float") else "bwd_sm90"
            assert compiler.pass_name("bwd", "bfloat16", "sm_90", hd, mk) == want
            assert compiler.pass_name("fwd", "bfloat16", "sm_90", hd, mk) == "fwd_sm90"


def test_hopper_backward_with_modifiers(hopper_on: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # With modifiers the Hopper backward serves every bucket (at MODS_SPILL_BUCKETS subject to
    # its compiled code, spill_checked), unless the tile sizes say bwd90_mods=-1 for a bucket.
    monkeypatch.delenv(compiler.TILES_ENV, raising=False)
    for hd in compiler.HEAD_DIM_BUCKETS_F16:
        assert compiler.pass_name("bwd", "bfloat16", "sm_90", hd, mods=True) == "bwd_sm90"
        assert compiler.pass_name("fwd", "bfloat16", "sm_90", hd, mods=True) == "fwd_sm90"
        assert compiler.spill_checked("bwd_sm90", hd, True) == (hd in (96, 128, 256))
        assert not compiler.spill_checked("bwd_sm90", hd, False) and not compiler.spill_checked("bwd_f16", hd, True)
    monkeypatch.setenv(compiler.TILES_ENV, "h128:bwd90_mods=-1")
    assert compiler.pass_name("bwd", "float16", "sm_90", 128, mods=True) == "bwd_f16"
    assert compiler.pass_name("bwd", "float16", "sm_90", 256, mods=True) == "bwd_sm90"
    assert compiler.pass_name("bwd", "float16", "sm_80", 128, mods=True) == "bwd_f16"


def test_hopper_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compiler.HOPPER_ENV, "0")
    assert compiler.pass_name("fwd", "float16", "sm_90", 128) == "fwd_f16"
    assert compiler.pass_name("bwd", "float16", "sm_90", 64) == "bwd_f16"
    monkeypatch.setenv(compiler.HOPPER_ENV, "1")
    assert compiler.pass_name("fwd", "float16", "sm_90", 128) == "fwd_sm90"
    monkeypatch.setenv(compiler.HOPPER_ENV, "yes")
    with pytest.raises(ValueError, match="PYCUDAFLASH_WGMMA"):
        compiler.pass_name("fwd", "float16", "sm_90", 128)


def test_build_arch() -> None:
    assert compiler.build_arch("fwd_sm90", "sm_90") == "sm_90a"
    assert compiler.build_arch("bwd_sm90", "sm_90a") == "sm_90a"
    assert compiler.build_arch("fwd_f16", "sm_80") == "sm_80"
    with pytest.raises(ValueError, match="runs only on sm_90"):
        compiler.build_arch("fwd_sm90", "sm_80")


def test_hopper_defines() -> None:
    d = compiler.defines("fwd_sm90", 128, "none", "float16", "sm_90")
    assert d == {"HEAD_DIM": 128, "MASK_MODE": 0, "KV_GROUPS": 0, "SCORE_MOD": 0, "MASK_MOD": 0, "ELEM_BF16": 0,
                 "LEAN_REGISTERS": 0, "BC": 128, "FWD_WGS": 2, "FWD_MINB": 1, "FWD_PERSIST": 1}
    # Grouped K/V heads: persistent blocks without a dense mask, one job a block with one.
    assert [compiler.defines("fwd_sm90", 128, mk, "float16", "sm_90", groups=True)["FWD_PERSIST"]
            for mk in ("none", "bool")] == [1, 0]
    # The register budget class is the architecture's, decided in Python only.
    assert compiler.defines("fwd_f16", 128, "none", "float16", "sm_80")["LEAN_REGISTERS"] == 1
    assert compiler.defines("bwd_f16", 128, "none", "bfloat16", "sm_90")["LEAN_REGISTERS"] == 0
    assert "LEAN_REGISTERS" not in compiler.defines("fwd", 128, "none", "float32", "sm_80")
    # Persistent forward blocks only where the job loop fits the registers.
    assert [compiler.defines("fwd_sm90", hd, "none", "float16", "sm_90")["FWD_PERSIST"]
            for hd in (64, 96, 128, 192, 256)] == [0, 1, 1, 0, 0]
    # D 64: 64 keys a step, 2 blocks per SM, but one block per SM with a dense
    # mask (its addressing needs more than 128 registers).
    assert [compiler.defines("fwd_sm90", 64, mk, "float16", "sm_90")["FWD_MINB"] for mk in ("none", "bool")] == [2, 1]
    # D 256 with a dense mask takes 32 keys a step (registers), 64 without.
    assert compiler.defines("fwd_sm90", 256, "bool", "bfloat16", "sm_90")["BC"] == 32
    assert compiler.defines("fwd_sm90", 256, "none", "bfloat16", "sm_90")["BC"] == 64
    b = compiler.defines("bwd_sm90", 96, "float", "bfloat16", "sm_90")
    assert b["ELEM_BF16"] == 1 and b["B90_BR"] == 64 and b["B90_WGS"] == 2
    # D 64 backward: 3 warpgroups (192 keys), 2 with a dense mask.
    assert [compiler.defines("bwd_sm90", 64, mk, "float16", "sm_90")["B90_WGS"] for mk in ("none", "float")] == [3, 2]
    assert compiler.defines("bwd_sm90", 256, "none", "float16", "sm_90")["HEAD_DIM"] == 256
    with pytest.raises(ValueError):
        compiler.defines("bwd_sm90", 128, "float", "float16", "sm_90")
    with pytest.raises(ValueError):
        compiler.defines("fwd_sm90", 128, "none", "float32", "sm_90")


def test_wgmma_header_is_generated() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_wgmma.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_warm_cache_reports_progress_in_order(monkeypatch) -> None:
    built = []
    monkeypatch.setattr(compiler, "cubin", lambda p, d, a: built.append((p, d["HEAD_DIM"], a)) or b"")
    variants = list(compiler.all_variants(arch="sm_90"))[:7]
    seen = []
    res = compiler.warm_cache(arch="sm_90", jobs=3, variants=variants,
                              progress=lambda done, total, p, d, s: seen.append((done, total)))
    assert [(p, d) for p, d, _ in res] == variants
    assert sorted(built) == sorted((p, d["HEAD_DIM"], "sm_90") for p, d in variants)
    assert seen == [(i, 7) for i in range(1, 8)]


def test_slow_compilation_is_announced_once(monkeypatch, capsys) -> None:
    monkeypatch.delenv("PYCUDAFLASH_QUIET", raising=False)
    monkeypatch.setattr(compiler, "COMPILE_NOTICE_S", 0.01)
    with compiler._compile_notice("fwd_sm90", {"HEAD_DIM": 64}, "sm_90"):
        import time

        time.sleep(0.2)
    with compiler._compile_notice("fwd_sm90", {"HEAD_DIM": 64}, "sm_90"):
        pass  # (a cached variant: no line)
    err = capsys.readouterr().err
    assert err.count("compiling kernel variant fwd_sm90 (HEAD_DIM=64) for sm_90a") == 1


def test_pass_sources_are_their_files_with_headers_inlined_once(tmp_path, monkeypatch) -> None:
    """``source()`` follows each file's own #include lines; a header edit changes the text (the
    disk cache's key), for every pass that includes it."""
    kdir = tmp_path / "cuda_src"
    shutil.copytree(compiler.kernel_dir(), kdir)
    monkeypatch.setattr(compiler, "kernel_dir", lambda: kdir)
    compiler.source.cache_clear()  # (memoised per process)
    before = {p: compiler.source(p) for p in compiler.PASSES}
    for p, text in before.items():
        assert '#include "' not in text, f"{p}: an include was left in the source"
        assert text.count("#pragma once") == 0
        assert text.count('#line 1 "flash_common.cuh"') == 1, f"{p}: the common header is not there once"
    assert 'flash_bwd_rows_f16.cuh' in before["bwd_sm90"] and 'flash_bwd_rows_f16.cuh' in before["bwd_f16"]
    assert "flash_wgmma.cuh" not in before["fwd_f16"]
    # Every header is reached by some pass.
    reached = {h.name for h in kdir.glob("*.cuh") if any(f'"{h.name}"' in t for t in before.values())}
    assert reached == {h.name for h in kdir.glob("*.cuh")}
    # An edit in a header reaches exactly the passes that include it.
    with open(kdir / "flash_common_sm90.cuh", "a") as f:
        f.write("\n// edited\n")
    compiler.source.cache_clear()
    after = {p: compiler.source(p) for p in compiler.PASSES}
    compiler.source.cache_clear()
    assert {p for p in compiler.PASSES if after[p] != before[p]} == {"fwd_sm90", "bwd_sm90", "fwd_sm90_tma"}


def test_a_missing_include_is_named(tmp_path, monkeypatch) -> None:
    (tmp_path / "flash_common.cuh").write_text("// x\n")
    (tmp_path / "flash_fwd.cu").write_text('#include "flash_common.cuh"\n#include "nowhere.cuh"\n')
    monkeypatch.setattr(compiler, "kernel_dir", lambda: tmp_path)
    compiler.source.cache_clear()
    try:
        with pytest.raises(FileNotFoundError, match=r"flash_fwd.cu:2: included 'nowhere.cuh'"):
            compiler.source("fwd")
    finally:
        compiler.source.cache_clear()


def test_every_define_a_kernel_requires_is_given() -> None:
    """The kernels state no tile size, warp count or padding of their own: each is required
    (``#ifndef X`` / ``#error``) and every variant's options give it."""
    import re

    for arch in ("sm_80", "sm_90"):
        for pass_, defs in compiler.all_variants(arch=arch):
            required = set(re.findall(r"#ifndef (\w+)\n#error", compiler.source(pass_)))
            given = {o[2:].split("=")[0] for o in compiler.options(defs) if o.startswith("-D")}
            assert required and required <= given, f"{pass_} {arch}: missing {required - given}"
    with pytest.raises(ValueError, match="layout constants"):
        compiler.options({"HEAD_DIM": 64, "BWD_WARPS": 4})


_SYNTHETIC = '''
struct DemoParams {
    int Nq, Nk;          // sizes
    i64 q_sb, q_sh;      /* strides */
    float scale;
    u32 flags;
    i64 total;
};
extern "C" __global__ void __launch_bounds__(128, 1)
demo_kernel(const float *__restrict__ Q, float *__restrict__ O, int D,
            const __grid_constant__ DemoParams p) {}
'''


def _with_source(tmp_path, monkeypatch, text: str) -> None:
    (tmp_path / "flash_common.cuh").write_text("// x\n")
    (tmp_path / "flash_fwd.cu").write_text(text)
    monkeypatch.setattr(compiler, "kernel_dir", lambda: tmp_path)
    for fn in (compiler.source, compiler.param_struct, compiler.kernel_params):
        fn.cache_clear()


@pytest.fixture
def fresh_caches():
    yield
    for fn in (compiler.source, compiler.param_struct, compiler.kernel_params):
        fn.cache_clear()


def test_kernel_params_are_read_from_the_signature_and_the_struct(tmp_path, monkeypatch, fresh_caches) -> None:
    import ctypes

    _with_source(tmp_path, monkeypatch, _SYNTHETIC)
    kp = compiler.kernel_params("fwd", "demo_kernel")
    assert kp.pointers == ("Q", "O") and kp.scalars == (("D", "int"),)
    st = kp.struct
    assert st.name == "DemoParams"
    assert st.fields == (("Nq", "int"), ("Nk", "int"), ("q_sb", "i64"), ("q_sh", "i64"), ("scale", "float"),
                         ("flags", "u32"), ("total", "i64"))
    # The C layout: 64-bit fields 8-aligned (scale and flags share 8 bytes), sizeof a multiple of 8.
    offsets = {name: getattr(st.ctype, name).offset for name, _ in st.fields}
    assert offsets == {"Nq": 0, "Nk": 4, "q_sb": 8, "q_sh": 16, "scale": 24, "flags": 28, "total": 32}
    assert st.size == ctypes.sizeof(st.ctype) == 40
    assert kp.size == 8 * 3 + 40
    assert kp.names() == ("Q", "O", "D", "Nq", "Nk", "q_sb", "q_sh", "scale", "flags", "total")


_ALIGNED = """
struct alignas(64) Map64 {
    unsigned long long opaque[16];
};
struct Inner {
    int a;
    Map64 m;
};
struct AlignedParams {
    int n;
    Map64 k;
    float s;
    Map64 two[2];
    Inner inner;
    u64 last;
    int tail;
};
"""


def test_param_structs_follow_alignas(tmp_path, monkeypatch, fresh_caches) -> None:
    """A member of an ``alignas`` struct sits at a multiple of its alignment, and a struct holding
    one is padded to a multiple of it, as the C++ compiler lays them out (g++ is the oracle)."""
    import ctypes

    _with_source(tmp_path, monkeypatch, _ALIGNED)
    st = compiler.param_struct("fwd", "AlignedParams")
    assert [n for n, _ in st.fields] == ["n", "k", "s", "two", "inner", "last", "tail"]
    got = {n: getattr(st.ctype, n).offset for n, _ in st.fields}
    got["sizeof"] = ctypes.sizeof(st.ctype)
    got["inner.m"] = compiler.param_struct("fwd", "Inner").ctype.m.offset
    got["sizeof Inner"] = ctypes.sizeof(compiler.param_struct("fwd", "Inner").ctype)
    # (what the C rules give: n 0, k 64, s 192, two 256, inner 512 (m at 64, 128 + 64 = 192 bytes), last 704,
    # tail 712, size 768)
    want = {"n": 0, "k": 64, "s": 192, "two": 256, "inner": 512, "last": 704, "tail": 712, "sizeof": 768,
            "inner.m": 64, "sizeof Inner": 192}
    assert got == want
    if shutil.which("g++") is None:
        return
    cpp = tmp_path / "layout.cpp"
    cpp.write_text("#include <cstdio>\n#include <cstddef>\ntypedef unsigned long long u64;\n" + _ALIGNED +
                   "int main() { std::printf(\"%zu %zu %zu %zu %zu %zu %zu %zu %zu %zu\\n\", "
                   "offsetof(AlignedParams, n), offsetof(AlignedParams, k), offsetof(AlignedParams, s), "
                   "offsetof(AlignedParams, two), offsetof(AlignedParams, inner), offsetof(AlignedParams, last), "
                   "offsetof(AlignedParams, tail), sizeof(AlignedParams), offsetof(Inner, m), sizeof(Inner)); }\n")
    exe = tmp_path / "layout"
    subprocess.run(["g++", "-std=c++17", str(cpp), "-o", str(exe)], check=True)
    printed = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    assert printed == list(want.values())


@pytest.mark.parametrize("signature, message", [
    ("const float *__restrict__ Q, int D", "is not 'const __grid_constant__ STRUCT p'"),
    ("const float *Q, const __grid_constant__ DemoParams p", "neither a '__restrict__' pointer nor a scalar"),
    ("int D, float *__restrict__ O, const __grid_constant__ DemoParams p", "pointer parameter .* after a scalar"),
    ("double x, const __grid_constant__ DemoParams p", "no layout for type 'double'"),
    ("const float *__restrict__ Nq, const __grid_constant__ DemoParams p", "a name repeats"),
    ("const __grid_constant__ Missing p", "0 definitions of struct Missing"),
])
def test_bad_kernel_signatures_are_refused(tmp_path, monkeypatch, fresh_caches, signature, message) -> None:
    text = _SYNTHETIC.replace(_SYNTHETIC[_SYNTHETIC.index("demo_kernel("):], f"demo_kernel({signature}) {{}}\n")
    _with_source(tmp_path, monkeypatch, text)
    with pytest.raises(ValueError, match=message):
        compiler.kernel_params("fwd", "demo_kernel")


@pytest.mark.parametrize("body, message", [
    ("int a; int a;", "field 'a' declared twice"),
    ("const float *x;", "cannot lay out"),
    ("double d;", "no layout for type 'double'"),
    ("", "has no fields"),
])
def test_bad_param_structs_are_refused(tmp_path, monkeypatch, fresh_caches, body, message) -> None:
    _with_source(tmp_path, monkeypatch, "struct S {" + body + "};\n")
    with pytest.raises(ValueError, match=message):
        compiler.param_struct("fwd", "S")
