"""A layout's Python view: constants, IntEnums, offset constants, `{name: (offset, C type)}` dicts,
ctypes Structures, numpy structured dtypes and array-block tables."""
from __future__ import annotations

import re
import textwrap

from protocols.layout import FLEX, SCALARS, ArrayBlock, Const, Enum, Layout, Struct, is_pointer
from protocols.layout.compute import Laid, Placed


def _ctype_text(p: Placed) -> str:
    f = p.field
    if f.count == FLEX:
        return f"{f.ctype}[]"
    return f.ctype + "".join(f"[{d}]" for d in f.shape)


def _ctypes_type(p: Placed, laid: dict[str, Laid]) -> str:
    f = p.field
    if f.ctype in SCALARS:
        base = f"ctypes.{SCALARS[f.ctype][2]}"
    elif is_pointer(f.ctype):
        base = "ctypes.c_void_p"
    else:
        base = laid[f.ctype].struct.ctypes_name or f"(ctypes.c_uint8 * {laid[f.ctype].size})"
    for i, d in enumerate(reversed(f.shape)):
        base = f"{base} * {d}" if i == 0 else f"({base}) * {d}"
    return base


def _np_format(p: Placed, laid: dict[str, Laid]) -> str:
    """A Python expression for the field's numpy format."""
    f = p.field
    if f.ctype == "char":
        return repr(f"S{f.num_elements}")
    if f.ctype in SCALARS or is_pointer(f.ctype):
        code = SCALARS[f.ctype][1] if f.ctype in SCALARS else "<u8"
        return repr(f"{f.shape}{code}" if f.shape else code)
    nested = laid[f.ctype].struct.dtype_name or repr(f"V{laid[f.ctype].size}")
    return f"({nested}, {f.shape})" if f.shape else nested


def _enum(e: Enum) -> list[str]:
    lines = [f"class {e.py_name}(enum.IntEnum):", f'    """{e.doc}"""' if e.doc else '    """(generated)"""', ""]
    lines += [f"    {name} = {value}" + (f"  # {doc}" if doc and not e.messages else "")
              for name, value, doc in e.values]
    if e.messages:
        lines += ["", "    @property", "    def message(self) -> str:",
                  f"        return _{e.py_name.upper()}_MESSAGES[self]", "", "",
                  f"_{e.py_name.upper()}_MESSAGES = {{"]
        lines += [f"    {e.py_name}.{name}: {doc!r}," for name, _, doc in e.values]
        lines.append("}")
    return lines


def _offsets(s: Struct, named: list[Placed], size: int) -> list[str]:
    lines = []
    if s.prefix:
        for p in named:
            note = ", ".join(x for x in (_ctype_text(p), p.field.writer) if x)
            lines.append(f"{s.prefix}{p.field.name.upper()} = {p.offset}  # {note}"
                         + (f": {p.field.doc}" if p.field.doc else ""))
    if s.size_name:
        lines.append(f"{s.size_name} = {size}")
    if s.fields_dict:
        lines.append(f"{s.fields_dict} = {{")
        lines += [f'    "{p.field.name}": ({p.offset}, "{_ctype_text(p)}"),' for p in named]
        lines.append("}")
    return lines


def _ctypes_class(laid_s: Laid, laid: dict[str, Laid]) -> list[str]:
    s = laid_s.struct
    doc = textwrap.wrap(f'"""{s.c_name}: {s.doc or "(generated)"}"""', 106, break_long_words=False)
    lines = ["", "", f"class {s.ctypes_name}(ctypes.Structure):", *("    " + line for line in doc), ""]
    if s.anonymous:
        lines.append(f"    _anonymous_ = {s.anonymous!r}")
    lines.append("    _fields_ = [")
    lines += [f'        ("{p.field.name}", {_ctypes_type(p, laid)}),' for p in laid_s.placed if p.field.count != FLEX]
    return lines + ["    ]", "", "", f"assert ctypes.sizeof({s.ctypes_name}) == {laid_s.size}"]


def _dtype(laid_s: Laid, named: list[Placed], laid: dict[str, Laid]) -> list[str]:
    fixed = [p for p in named if p.field.count != FLEX]
    return [f"{laid_s.struct.dtype_name} = np.dtype({{",
            *_wrapped("names", [repr(p.field.name) for p in fixed]),
            *_wrapped("formats", [_np_format(p, laid) for p in fixed]),
            *_wrapped("offsets", [str(p.offset) for p in fixed]),
            f"    \"itemsize\": {laid_s.size},", "})"]


def _struct(laid_s: Laid, laid: dict[str, Laid]) -> list[str]:
    s, named = laid_s.struct, [p for p in laid_s.placed if not p.is_pad]
    lines = textwrap.wrap(f"# ---- {s.c_name}: {s.doc}" if s.doc else f"# ---- {s.c_name}", 110,
                          subsequent_indent="# ", break_long_words=False)
    lines += _offsets(s, named, laid_s.size)
    if s.ctypes_name:
        lines += _ctypes_class(laid_s, laid)
    if s.dtype_name:
        lines += _dtype(laid_s, named, laid)
    return lines


def _wrapped(key: str, items: list[str]) -> list[str]:
    """A dict entry `"key": [items],` broken at 110 columns."""
    text = f'    "{key}": [' + ", ".join(items) + "],"
    return textwrap.wrap(text, 110, subsequent_indent=" " * 8, break_long_words=False, break_on_hyphens=False)


def _block(b: ArrayBlock) -> list[str]:
    lines = [f"# ---- {b.name.lower()}: {b.doc}" if b.doc else f"# ---- {b.name.lower()}",
             f"{b.name}_DIMS = {b.dims!r}", f"{b.name}_ALIGN = {b.align}", f"{b.name}_ARRAYS = ("]
    lines += [f"    ({a.name!r}, {SCALARS[a.ctype][1]!r}, {tuple(a.shape)!r}),"
              + (f"  # {a.doc}" if a.doc else "") for a in b.arrays]
    lines.append(")")
    groups = dict.fromkeys(a.group for a in b.arrays)
    if len(groups) > 1:
        lines.append(f"{b.name}_GROUPS = {{")
        for g in groups:
            lines += textwrap.wrap(f"    {g!r}: {tuple(a.name for a in b.arrays if a.group == g)!r},", 110,
                                   subsequent_indent=" " * 8, break_long_words=False, break_on_hyphens=False)
        lines.append("}")
    return lines


def _public_names(layout: Layout, laid: dict[str, Laid]) -> list[str]:
    names = []
    for item in layout.items:
        if isinstance(item, Const):
            names.append(item.py_name)
        elif isinstance(item, Enum):
            names.append(item.py_name)
        elif isinstance(item, Struct):
            s = item
            if s.prefix:
                names += [f"{s.prefix}{p.field.name.upper()}" for p in laid[s.c_name].placed if not p.is_pad]
            names += [n for n in (s.size_name, s.fields_dict, s.ctypes_name, s.dtype_name) if n]
        elif isinstance(item, ArrayBlock):
            names += [f"{item.name}_DIMS", f"{item.name}_ALIGN", f"{item.name}_ARRAYS"]
            if len(dict.fromkeys(a.group for a in item.arrays)) > 1:
                names.append(f"{item.name}_GROUPS")
    return names


def render_py(layout: Layout, laid: dict[str, Laid], generator: str) -> str:
    items = layout.items
    structs = [i for i in items if isinstance(i, Struct)]
    need_np = any(s.dtype_name for s in structs)
    head = (layout.doc.strip() + "\n\n") if layout.doc else ""
    out = [f'"""{head}Generated by `{generator}` from {layout.source}: do not edit."""',
           "from __future__ import annotations", ""]
    out += ["import ctypes"] * any(s.ctypes_name for s in structs)
    out += ["import enum"] * any(isinstance(i, Enum) for i in items)
    out += ["", "import numpy as np"] * need_np
    out += ["", ""]
    out += textwrap.wrap("__all__ = [" + ", ".join(repr(n) for n in _public_names(layout, laid)) + "]", 110,
                         subsequent_indent=" " * 11, break_long_words=False, break_on_hyphens=False)
    out += ["", ""]
    for item in items:
        if isinstance(item, Const):
            value = f"0x{item.value:X}" if item.hex else str(item.value)
            out.append(f"{item.py_name} = {value}" + (f"  # {item.doc}" if item.doc else ""))
            continue
        out += ["", ""]
        if isinstance(item, Enum):
            out += _enum(item)
        elif isinstance(item, Struct):
            out += _struct(laid[item.c_name], laid)
        elif isinstance(item, ArrayBlock):
            out += _block(item)
        out += [""]
    return re.sub(r"\n{4,}", "\n\n\n", "\n".join(out).strip("\n")) + "\n"
