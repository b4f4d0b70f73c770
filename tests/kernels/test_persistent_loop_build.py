"""kernels/csrc/persistent_loop.cu (the GPU-resident loop) builds for sm_90 with no warnings, and the
ctypes mirrors of its structs in kernels/persistent_loop.py have the library's sizes. Needs nvcc, not a GPU
(the library links the CUDA runtime statically; nothing here calls into CUDA)."""
import ctypes
import subprocess

import pytest

from kernels import persistent_loop


@pytest.fixture(scope="module")
def nvcc():
    found = persistent_loop.nvcc()
    if found is None:
        pytest.skip("nvcc not found (PATH, $CUDA_HOME/bin): cannot build the persistent loop")
    return found


def test_loop_compiles_without_warnings(nvcc, tmp_path):
    res = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-Werror", "all-warnings", "-I",
                          str(persistent_loop.CSRC / "include"), "-c", str(persistent_loop.SOURCES[0]),
                          "-o", str(tmp_path / "loop.o")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr


def test_ctypes_structs_match_the_library(nvcc):
    lib = persistent_loop.load()  # raises when a size differs
    assert lib.blink_loop_args_bytes() == ctypes.sizeof(persistent_loop.LoopArgs)
    assert lib.blink_loop_ctl_bytes() == ctypes.sizeof(persistent_loop.LoopCtl)
    assert lib.blink_loop_ext_bytes() == ctypes.sizeof(persistent_loop.LoopExt)
    # the loop's own counters, then the speculation's words, as in C; eos_ids, then the extensions' pointer
    args = persistent_loop.LoopArgs
    assert args.step_buf_alt.offset == args.c_iterations.offset + 8 * len(persistent_loop.COUNTERS)
    assert args.ext.offset == args.eos_ids.offset + 4 * persistent_loop.MAX_EOS
    assert args.ext.offset + 8 == ctypes.sizeof(args)


def test_loop_ext_offsets_match_the_header(nvcc, tmp_path):
    """Every field of blink_loop_ext at the offset LoopExt gives it (a host program prints offsetof)."""
    names = [name for name, _ in persistent_loop.LoopExt._fields_]
    src = tmp_path / "offsets.cu"
    src.write_text('#include <cstdio>\n#include <cstddef>\n#include "blink_loop.cuh"\nint main() {\n'
                   + "".join(f'  printf("%zu\\n", offsetof(blink_loop_ext, {n}));\n' for n in names)
                   + '  printf("%zu\\n", sizeof(blink_loop_ext));\n  return 0;\n}\n')
    exe = tmp_path / "offsets"
    res = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-I", str(persistent_loop.CSRC / "include"), str(src),
                          "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    printed = [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    expected = [getattr(persistent_loop.LoopExt, n).offset for n in names] + [ctypes.sizeof(persistent_loop.LoopExt)]
    assert printed == expected


def test_library_errors_name_the_step():
    with pytest.raises(RuntimeError, match="at step 12: cudaError 1"):
        persistent_loop.check(12001, "building the loop graph")


def test_a_prebuilt_library_is_used_as_given(monkeypatch, tmp_path):
    """Container images without nvcc point BLINK_LOOP_LIB at a library built in a devel stage."""
    lib = tmp_path / "loop.so"
    monkeypatch.setenv("BLINK_LOOP_LIB", str(lib))
    with pytest.raises(RuntimeError, match="no such file"):
        persistent_loop.build()
    lib.write_bytes(b"")
    assert persistent_loop.build() == lib
