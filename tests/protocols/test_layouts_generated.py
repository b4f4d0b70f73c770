"""Every binary layout shared by Python and C is generated from its one declaration (protocols/layout):
the committed files are what the generator writes now, and the C compiler lays the generated structs out
at the offsets the Python views use."""
import ctypes
import importlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from protocols.layout import FLEX, Field, Layout, Struct, gen
from protocols.layout.compute import lay_out, lay_out_all

CUDA_INCLUDE = Path("/usr/local/cuda/include")


def test_the_committed_files_are_what_the_declarations_generate(tmp_path):
    assert gen.main(["--out", str(tmp_path)]) == 0
    stale = []
    for path in gen.generated_files():
        committed = gen.ROOT / path
        if not committed.is_file() or committed.read_text() != (tmp_path / path).read_text():
            stale.append(path)
    assert not stale, f"generated files differ from their declarations: {stale}; run `{gen.COMMAND}` and commit"


def test_check_mode_names_a_stale_file(tmp_path, capsys):
    gen.write(tmp_path)
    path = next(iter(gen.generated_files()))
    (tmp_path / path).write_text((tmp_path / path).read_text() + "// edited by hand\n")
    assert gen.main(["--check", "--out", str(tmp_path)]) == 1
    assert path in capsys.readouterr().err


def test_every_generated_file_says_it_is_generated():
    for path, text in gen.generated_files().items():
        assert "do not edit" in text.splitlines()[0] + text.splitlines()[2], path


def _views(layout: Layout) -> dict[str, dict[str, int]]:
    """{struct: {field or "sizeof": offset}} from the generated Python module's views (all of them agree)."""
    module = importlib.import_module(layout.py_out[:-3].replace("/", "."))
    laid = lay_out_all([i for i in layout.items if isinstance(i, Struct)])
    out = {}
    for name, entry in laid.items():
        s, offsets = entry.struct, {}
        for p in (p for p in entry.placed if not p.is_pad):
            seen = set()
            if s.fields_dict:
                seen.add(getattr(module, s.fields_dict)[p.field.name][0])
            if s.prefix:
                seen.add(getattr(module, f"{s.prefix}{p.field.name.upper()}"))
            if s.ctypes_name and p.field.count != FLEX:
                seen.add(getattr(getattr(module, s.ctypes_name), p.field.name).offset)
            if s.dtype_name and p.field.count != FLEX:
                seen.add(getattr(module, s.dtype_name).fields[p.field.name][1])
            assert len(seen) == 1, f"{name}.{p.field.name}: the Python views disagree: {seen}"
            offsets[p.field.name] = seen.pop()
        if s.ctypes_name:
            assert ctypes.sizeof(getattr(module, s.ctypes_name)) == entry.size, name
        if s.dtype_name:
            assert getattr(module, s.dtype_name).itemsize == entry.size, name
        offsets["sizeof"] = entry.size
        out[name] = offsets
    return out


def _c_layout(layout: Layout, views: dict, tmp_path: Path) -> dict:
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.fail("no C++ compiler on PATH: the layout check needs one (apt-get install g++)")
    header = gen.ROOT / layout.c_out
    lines = ["#include <cstdio>", f'#include "{header.name}"', "int main() {", 'printf("{");']
    for struct, fields in views.items():
        for name in fields:
            expr = f"sizeof({struct})" if name == "sizeof" else f"offsetof({struct}, {name})"
            lines.append(f'printf("\\"{struct}.{name}\\": %zu, ", (size_t){expr});')
    lines += ['printf("\\"end\\": 0}");', "return 0; }"]
    src, exe = tmp_path / "layout.cpp", tmp_path / "layout"
    src.write_text("\n".join(lines))
    includes = ["-I", str(header.parent)] + (["-I", str(CUDA_INCLUDE)] if CUDA_INCLUDE.is_dir() else [])
    res = subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", *includes, "-o", str(exe), str(src)],
                         capture_output=True, text=True)
    if res.returncode and "cuda_runtime.h" in res.stderr:
        pytest.skip("the CUDA headers are not installed: cannot compile this layout's header")
    assert res.returncode == 0, res.stderr
    return json.loads(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout)


@pytest.mark.parametrize("layout", gen.layouts(), ids=lambda layout: layout.name)
def test_the_c_compiler_places_every_field_where_python_reads_it(layout, tmp_path):
    views = _views(layout)
    c = _c_layout(layout, views, tmp_path)
    for struct, fields in views.items():
        for name, offset in fields.items():
            assert c[f"{struct}.{name}"] == offset, f"{struct}.{name}: C {c[f'{struct}.{name}']}, Python {offset}"


def test_gaps_become_named_pads_and_pinned_offsets_are_kept():
    s = lay_out(Struct("t", (Field("a", "uint32_t"), Field("b", "uint64_t"), Field("c", "uint32_t", at=64))), {})
    assert [(p.field.name, p.offset, p.nbytes) for p in s.placed] == [
        ("a", 0, 4), ("_pad0", 4, 4), ("b", 8, 8), ("_pad1", 16, 48), ("c", 64, 4), ("_pad2", 68, 4)]
    assert s.size == 72


def test_a_pinned_offset_behind_the_previous_field_is_refused():
    with pytest.raises(ValueError, match="t.b: at=4"):
        lay_out(Struct("t", (Field("a", "uint64_t"), Field("b", "uint32_t", at=4))), {})
