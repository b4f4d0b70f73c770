"""One declaration per binary layout shared by Python and C; `python -m protocols.layout.gen` writes
the Python views and the C headers from them (and `--check` fails on a committed file that differs).

A declaration is a `Layout` of constants, enums, structs and array blocks:

- `Struct`: fixed fields laid out as a C compiler lays them (natural alignment), every gap made an
  explicit `_padN` field in both languages; `at=` pins a field's offset (the generator pads up to it and
  refuses a field that is already past it), `size=` pads the end. A field's `count` is a number, a shape
  tuple, or `FLEX` (a C flexible array member: it starts at the struct's size).
- `ArrayBlock`: arrays whose lengths are only known at run time (the step buffer, the scheduler's
  carved state): each a dtype and a shape over named dimensions, 8-byte aligned, in order.
- `Enum` and `Const`: named values both sides use.

Each field names its writer (who stores it: "gateway", "engine", "host", "gpu", "creator", ...) where
a layout crosses processors. Declarations live next to their owner (`protocols/ring_decl.py`,
`kernels/loop_decl.py`, ...); this package holds only the format and the generator, so both the gateway
and the backend may import it.
"""
from __future__ import annotations

from dataclasses import dataclass

FLEX = -1  # count of a C flexible array member

# C scalar type -> (size and alignment in bytes, struct/numpy code, ctypes name)
SCALARS = {
    "uint8_t": (1, "u1", "c_uint8"), "int8_t": (1, "i1", "c_int8"), "char": (1, "S1", "c_char"),
    "uint16_t": (2, "<u2", "c_uint16"), "int16_t": (2, "<i2", "c_int16"),
    "uint32_t": (4, "<u4", "c_uint32"), "int32_t": (4, "<i4", "c_int32"), "float": (4, "<f4", "c_float"),
    "uint64_t": (8, "<u8", "c_uint64"), "int64_t": (8, "<i8", "c_int64"), "double": (8, "<f8", "c_double"),
}
POINTER_BYTES = 8
OPAQUE_POINTERS = ("cudaGraphExec_t", "cudaGraph_t")  # handles that are pointers in C


def is_pointer(ctype: str) -> bool:
    return ctype.endswith("*") or ctype in OPAQUE_POINTERS


@dataclass(frozen=True)
class Field:
    """One struct member: `ctype` a scalar (SCALARS), a pointer (`T*`, a CUDA handle) or another struct
    of the same layout (by its C name)."""

    name: str
    ctype: str
    count: int | tuple[int, ...] = 1
    writer: str = ""
    doc: str = ""
    at: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        if self.count == FLEX or self.count == 1:
            return ()
        return self.count if isinstance(self.count, tuple) else (self.count,)

    @property
    def num_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Struct:
    """A C struct and its Python views. `prefix`: offset constants `<prefix><NAME>` in Python (none if
    empty); `fields_dict`: a `{name: (offset, ctype)}` dict of that name; `ctypes_name`: a ctypes.Structure
    class; `dtype_name`: a numpy structured dtype; `size_name`: the size as a constant."""

    c_name: str
    fields: tuple[Field, ...]
    doc: str = ""
    size: int | None = None
    prefix: str = ""
    fields_dict: str = ""
    ctypes_name: str = ""
    dtype_name: str = ""
    size_name: str = ""
    anonymous: tuple[str, ...] = ()  # ctypes: nested struct fields whose members read as the outer's


@dataclass(frozen=True)
class Array:
    """One array of an `ArrayBlock`: `shape` over the block's dimension names (and integers); a
    dimension written "S+1" is S plus one."""

    name: str
    ctype: str
    shape: tuple[str | int, ...]
    doc: str = ""
    group: str = ""  # e.g. "hot" / "cold": the C side gets one X-macro list per group


@dataclass(frozen=True)
class ArrayBlock:
    """Arrays carved one after another from one buffer, each start aligned to `align` bytes."""

    name: str  # C: BLINK_<NAME>_ARRAYS(X) lists, Python: <NAME>_ARRAYS
    arrays: tuple[Array, ...]
    dims: tuple[str, ...]
    doc: str = ""
    align: int = 8
    enum_prefix: str = ""  # C: an enum of the arrays' indices, in order (e.g. BLINK_F_)


@dataclass(frozen=True)
class Enum:
    c_name: str
    py_name: str
    c_prefix: str
    values: tuple[tuple[str, int, str], ...]  # (NAME, value, doc)
    doc: str = ""
    messages: bool = False  # Python: a `message` property giving each value's doc


@dataclass(frozen=True)
class Const:
    py_name: str
    c_name: str
    value: int
    doc: str = ""
    hex: bool = False
    c_suffix: str = "u"


@dataclass(frozen=True)
class Layout:
    """One layout: its declarations and where the two generated files go (paths from the repo root)."""

    name: str
    py_out: str
    c_out: str
    items: tuple = ()
    doc: str = ""
    c_prelude: tuple[str, ...] = ()  # lines after the guard (includes, forward declarations)
    source: str = ""  # the declaring module, named in the generated files (set by the generator)
