"""Reading a constant out of a cubin (an ELF64 image) without a GPU: how the launch code
learns the sizes that the kernels state, such as their shared memory."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from pycudaflash.compiler import cubin_constant


def _elf(symbols: dict, data_offset: int = 8) -> bytes:
    """A minimal ELF64 image: a data section holding each symbol's int32 value, a symbol table and
    its string table (``symbols``: name -> value; values start ``data_offset`` bytes in)."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n in symbols)
    data = b"\xAA" * data_offset + b"".join(struct.pack("<i", v) for v in symbols.values())
    syms = [struct.pack("<IBBHQQ", 0, 0, 0, 0, 0, 0)]
    pos = 1
    for i, n in enumerate(symbols):
        syms.append(struct.pack("<IBBHQQ", pos, 1, 0, 3, data_offset + 4 * i, 4))
        pos += len(n) + 1
    symtab = b"".join(syms)
    body_start = 64
    offs = [body_start, body_start + len(names), body_start + len(names) + len(data)]
    body = names + data + symtab
    shoff = body_start + len(body)
    sec = struct.Struct("<IIQQQQIIQQ")
    sections = [sec.pack(*(0,) * 10),
                sec.pack(0, 3, 0, 0, offs[0], len(names), 0, 0, 1, 0),  # 1: string table
                sec.pack(0, 1, 0, 0, 0, 0, 0, 0, 1, 0),  # 2: an empty section
                sec.pack(0, 1, 2, 0, offs[1], len(data), 0, 0, 4, 0),  # 3: the constants
                sec.pack(0, 2, 0, 0, offs[2], len(symtab), 1, 1, 8, 24)]  # 4: symbol table -> strings 1
    header = b"\x7fELF" + bytes([2, 1, 1]) + b"\0" * 9
    header += struct.pack("<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, shoff, 0, 64, 0, 0, 64, len(sections), 1)
    return header + body + b"".join(sections)


def test_reads_each_constant_by_name() -> None:
    image = _elf({"a_smem_bytes": 123456, "b_smem_bytes": -7, "c": 0})
    assert cubin_constant(image, "a_smem_bytes") == 123456
    assert cubin_constant(image, "b_smem_bytes") == -7
    assert cubin_constant(image, "c") == 0
    with pytest.raises(KeyError, match="no symbol 'a_smem'"):
        cubin_constant(image, "a_smem")  # (a prefix of a name is not the name)


def test_refuses_what_is_not_an_elf64_image() -> None:
    with pytest.raises(ValueError, match="ELF64"):
        cubin_constant(b"\x7fELF\x01\x01" + b"\0" * 60, "x")
    with pytest.raises(ValueError, match="ELF64"):
        cubin_constant(b"MZ" + b"\0" * 62, "x")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_reads_a_constant_that_nvcc_compiled(tmp_path: Path) -> None:
    cu = tmp_path / "k.cu"
    cu.write_text('struct L { static constexpr int bytes = 3 * 4096 + 17; };\n'
                  'extern "C" __constant__ int k_smem_bytes = L::bytes;\n'
                  'extern "C" __global__ void k(float* x) { x[threadIdx.x] += 1.0f; }\n')
    out = tmp_path / "k.cubin"
    subprocess.run(["nvcc", "--cubin", "-arch", "sm_80", "-O3", str(cu), "-o", str(out)], check=True)
    assert cubin_constant(out.read_bytes(), "k_smem_bytes") == 3 * 4096 + 17
