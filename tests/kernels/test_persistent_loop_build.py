"""kernels/csrc/persistent_loop.cu (the GPU-resident loop) builds for sm_90 with no warnings, and the
ctypes mirrors of its structs in kernels/persistent_loop.py have the library's sizes. Needs nvcc, not a GPU
(the library links the CUDA runtime statically; nothing here calls into CUDA)."""
import ctypes
import subprocess

import pytest

from kernels import persistent_loop


@pytest.mark.parametrize("defines", [[], ["-DBLINK_BENCH_PROBES"]], ids=["product", "bench"])
def test_loop_compiles_without_warnings(nvcc, tmp_path, defines):
    res = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-rdc=true", "-Werror", "all-warnings", *defines, "-I",
                          str(persistent_loop.CSRC / "include"), "-c", str(persistent_loop.SOURCES[0]),
                          "-o", str(tmp_path / "loop.o")], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr


def test_the_product_library_has_no_benchmark_probes(nvcc):
    lib = persistent_loop.load()
    assert lib.blink_loop_has_bench_probes() == 0
    for probe in ("blink_loop_bench_mechanism", "blink_loop_stamps"):
        with pytest.raises(AttributeError):
            getattr(lib, probe)


def test_the_product_library_refuses_options_for_measuring_by_name(nvcc):
    """Checked before any CUDA call: runs with no GPU."""
    lib, loop = persistent_loop.load(), ctypes.c_void_p()
    options = persistent_loop.LoopOptions(stamps=True)
    assert options.needs_bench_build
    code = lib.blink_loop_create(ctypes.byref(persistent_loop.LoopArgs()), ctypes.byref(options.to_struct()),
                                 None, None, 0, ctypes.byref(loop))
    assert divmod(code, 1000) == (persistent_loop.LoopError.NEEDS_BENCH_BUILD, 0)
    with pytest.raises(RuntimeError, match="NEEDS_BENCH_BUILD: the options ask for benchmark probes"):
        persistent_loop.check(code, "building the loop graph")


def test_ctypes_structs_match_the_library(nvcc):
    lib = persistent_loop.load()  # raises when a size differs
    assert lib.blink_loop_args_bytes() == ctypes.sizeof(persistent_loop.LoopArgs)
    assert lib.blink_loop_ctl_bytes() == ctypes.sizeof(persistent_loop.LoopCtl)
    assert lib.blink_loop_ext_bytes() == ctypes.sizeof(persistent_loop.LoopExt)
    # the loop's own counters, then the speculation's words, as in C; eos_ids, then the extensions' pointer
    args = persistent_loop.LoopArgs
    assert args.step_buf_alt.offset == args.c.offset + 8 * len(persistent_loop.COUNTERS)
    assert args.ext.offset == args.eos_ids.offset + 4 * persistent_loop.MAX_EOS
    assert args.hash_offset.offset == args.ext.offset + 8  # then ring version 3's block-hash area, last
    assert args.max_block_hashes.offset + 4 <= ctypes.sizeof(args) < args.max_block_hashes.offset + 12


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


def test_library_errors_name_the_step_and_the_cuda_error():
    code = persistent_loop.LoopError.INSTANTIATE * 1000 + 1
    with pytest.raises(RuntimeError, match="building the loop graph failed: INSTANTIATE: instantiating a graph "
                                           "for device launch \\(cudaError 1\\)"):
        persistent_loop.check(code, "building the loop graph")
    with pytest.raises(RuntimeError, match="unknown code 999000"):
        persistent_loop.check(999000, "x")


def test_options_come_from_the_environment_in_one_place():
    assert persistent_loop.LoopOptions.from_env({}) == persistent_loop.LoopOptions()
    got = persistent_loop.LoopOptions.from_env({"BLINK_LOOP_ASYNC": "0", "BLINK_LOOP_SMEM": "0",
                                                "BLINK_LOOP_SPEC_AT": "0.25", "BLINK_LOOP_SPINNER_NS": "500",
                                                "BLINK_LOOP_SPEC_MASKED": "0"})
    assert (got.async_take, got.smem, got.spec_at, got.spinner_ns) == (False, False, 0.25, 500)
    assert not got.spec_masked and got.to_struct().spec_masked == 0 and persistent_loop.LoopOptions().spec_masked
    assert persistent_loop.LoopOptions().to_struct().spec_masked == 1
    assert not persistent_loop.LoopOptions(spec_masked=False).needs_bench_build  # a product option, not a probe
    assert got.needs_bench_build and not persistent_loop.LoopOptions(async_take=False).needs_bench_build
    struct = got.to_struct()
    assert (struct.async_take, struct.smem, struct.spec_tail_check, struct.spec_at) == (0, 0, 1, 0.25)
    assert persistent_loop.LoopOptions().to_struct().spec_at == -1.0  # after the model graph's first node
    with pytest.raises(ValueError, match="BLINK_LOOP_\\* environment variable.*spec_at"):
        persistent_loop.LoopOptions.from_env({"BLINK_LOOP_SPEC_AT": "2"})


def test_ctl_values_are_flat():
    ctl = persistent_loop.LoopCtl()
    ctl.steps, ctl.exited = 7, 1
    values = persistent_loop.ctl_values(ctl)
    assert values["steps"] == 7 and values["exited"] == 1 and set(persistent_loop.COUNTERS) <= set(values)


def test_a_prebuilt_library_is_used_as_given(monkeypatch, tmp_path):
    """Container images without nvcc point BLINK_LOOP_LIB at a library built in a devel stage."""
    lib = tmp_path / "loop.so"
    monkeypatch.setenv("BLINK_LOOP_LIB", str(lib))
    with pytest.raises(RuntimeError, match="no such file"):
        persistent_loop.build()
    lib.write_bytes(b"")
    assert persistent_loop.build() == lib


def _includes(path, seen):
    """The project headers `path` includes (quoted), transitively."""
    import re

    for name in re.findall(r'^#include "([^"]+)"', path.read_text(), re.M):
        header = persistent_loop.CSRC / "include" / name
        if header.is_file() and header not in seen:
            seen.add(header)
            _includes(header, seen)
    return seen


@pytest.mark.parametrize("defines", ["product", "bench"])
def test_the_build_cache_key_covers_every_included_header(defines):
    """A header left out of SOURCES would let a stale cached library load after it (or its declaration) changed."""
    from kernels import sched_host

    sources = persistent_loop.SOURCES + (persistent_loop.BENCH_SOURCES if defines == "bench" else ())
    needed = _includes(persistent_loop.SOURCES[0], set())
    if defines == "bench":
        needed |= _includes(persistent_loop.BENCH_SOURCES[0], {persistent_loop.BENCH_SOURCES[0]})
    else:
        needed.discard(persistent_loop.BENCH_SOURCES[0])  # included only under BLINK_BENCH_PROBES
        needed -= _includes(persistent_loop.BENCH_SOURCES[0], set())
    assert needed <= set(sources), sorted(str(p.name) for p in needed - set(sources))
    assert _includes(sched_host.SOURCES[0], set()) <= set(sched_host.SOURCES)
