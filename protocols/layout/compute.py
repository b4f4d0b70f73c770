"""Offsets of a declared struct, as a C compiler lays it out, with every gap made an explicit pad field."""
from __future__ import annotations

from dataclasses import dataclass

from protocols.layout import FLEX, POINTER_BYTES, SCALARS, Field, Struct, is_pointer


@dataclass(frozen=True)
class Placed:
    """A field (or a pad) at its byte offset; `elem_bytes` x `num_elements` bytes (0 for FLEX)."""

    field: Field
    offset: int
    elem_bytes: int
    align: int

    @property
    def is_pad(self) -> bool:
        return self.field.name.startswith("_pad")

    @property
    def nbytes(self) -> int:
        return 0 if self.field.count == FLEX else self.elem_bytes * self.field.num_elements


@dataclass(frozen=True)
class Laid:
    struct: Struct
    placed: tuple[Placed, ...]
    size: int
    align: int

    def offset(self, name: str) -> int:
        return next(p.offset for p in self.placed if p.field.name == name)


def _align_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def elem_size_align(ctype: str, known: dict[str, Laid]) -> tuple[int, int]:
    if ctype in SCALARS:
        size = SCALARS[ctype][0]
        return size, size
    if is_pointer(ctype):
        return POINTER_BYTES, POINTER_BYTES
    if ctype in known:
        return known[ctype].size, known[ctype].align
    raise ValueError(f"unknown C type {ctype!r} (declare the struct before its users)")


def _pad(index: int, nbytes: int, offset: int) -> Placed:
    return Placed(Field(f"_pad{index}", "uint8_t", nbytes), offset, 1, 1)


def lay_out(struct: Struct, known: dict[str, Laid]) -> Laid:
    """Place the fields; raises ValueError for an `at` that is behind, or a `size` that is too small."""
    placed: list[Placed] = []
    off, max_align, pads = 0, 1, 0
    for f in struct.fields:
        size, align = elem_size_align(f.ctype, known)
        max_align = max(max_align, align)
        start = _align_up(off, align) if f.at is None else f.at
        if start < _align_up(off, align) or start % align:
            raise ValueError(f"{struct.c_name}.{f.name}: at={f.at} is before the end of the previous field "
                             f"({off}) or misaligned for {f.ctype}")
        if start > off:
            placed.append(_pad(pads, start - off, off))
            pads += 1
        p = Placed(f, start, size, align)
        placed.append(p)
        off = start + p.nbytes
        if f.count == FLEX and f is not struct.fields[-1]:
            raise ValueError(f"{struct.c_name}.{f.name}: a flexible array must be the last field")
    flex = struct.fields and struct.fields[-1].count == FLEX
    end = _align_up(off, max_align) if struct.size is None else struct.size
    if end < off or end % max_align:
        raise ValueError(f"{struct.c_name}: size={struct.size} is below its fields ({off}) or misaligned")
    if end > off and not flex:
        placed.append(_pad(pads, end - off, off))
    if flex and placed[-1].offset != end:
        raise ValueError(f"{struct.c_name}: the flexible array must start at the struct's size ({end}): "
                         f"pin it with at={end}")
    return Laid(struct, tuple(placed), end, max_align)


def lay_out_all(structs: list[Struct]) -> dict[str, Laid]:
    known: dict[str, Laid] = {}
    for s in structs:
        known[s.c_name] = lay_out(s, known)
    return known


def dim_expr(dim: str | int) -> str:
    """A shape entry as an expression over dimension names ("S+1" -> "(S + 1)")."""
    if isinstance(dim, int):
        return str(dim)
    if "+" in dim:
        a, b = dim.split("+")
        return f"({a.strip()} + {b.strip()})"
    return dim
