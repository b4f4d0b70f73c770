"""Run-time helpers over generated layouts: the offsets of an array block (`protocols.layout.ArrayBlock`)
for given dimensions (what the generated C carves with its X-macro list), and `struct` formats of a run
of a struct's fields (from a generated `{name: (offset, C type)}` dict)."""
from __future__ import annotations

import numpy as np

ArraySpec = tuple[str, str, tuple]  # (name, numpy dtype string, shape over dimension names)


def shape_of(shape: tuple, dims: dict[str, int]) -> tuple[int, ...]:
    """A declared shape with its dimension names replaced ("S+1" is S plus one)."""
    out = []
    for d in shape:
        if isinstance(d, int):
            out.append(d)
        elif "+" in d:
            name, extra = d.split("+")
            out.append(dims[name.strip()] + int(extra))
        else:
            out.append(dims[d])
    return tuple(out)


def carve(arrays: tuple[ArraySpec, ...], dims: dict[str, int], align: int = 8,
          start: int = 0) -> tuple[dict[str, tuple[int, np.dtype, tuple[int, ...]]], int]:
    """({name: (byte offset, dtype, shape)}, end offset aligned to `align`), arrays placed in order from
    `start`, each at the next multiple of `align`."""
    out, off = {}, start
    for name, dtype, shape in arrays:
        off = -(-off // align) * align
        dt, dims_ = np.dtype(dtype), shape_of(shape, dims)
        out[name] = (off, dt, dims_)
        off += int(np.prod(dims_, dtype=np.int64)) * dt.itemsize
    return out, -(-off // align) * align


_STRUCT_CODES = {"uint8_t": "B", "int8_t": "b", "uint16_t": "H", "int16_t": "h", "uint32_t": "I", "int32_t": "i",
                 "float": "f", "uint64_t": "Q", "int64_t": "q", "double": "d"}
_SIZES = {"B": 1, "b": 1, "H": 2, "h": 2, "I": 4, "i": 4, "f": 4, "Q": 8, "q": 8, "d": 8}


def pack_format(fields: dict[str, tuple[int, str]], first: str, last: str) -> str:
    """A little-endian `struct` format for the scalar fields `first`..`last` (declaration order) of a
    generated fields dict, gaps as pad bytes: pack it at the struct's base + fields[first][0]."""
    names = list(fields)
    run = names[names.index(first): names.index(last) + 1]
    fmt, off = "<", fields[first][0]
    for name in run:
        offset, ctype = fields[name]
        if ctype not in _STRUCT_CODES:
            raise ValueError(f"{name}: {ctype} is not a scalar")
        fmt += "x" * (offset - off) + _STRUCT_CODES[ctype]
        off = offset + _SIZES[_STRUCT_CODES[ctype]]
    return fmt
