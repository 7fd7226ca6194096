"""A GGUF file's tensors without its metadata values: what loading the weights needs.

``gguf.GGUFReader`` turns every metadata value into numpy views, one element at a time, and a
GGUF's tokenizer is metadata (SmolLM2's 49,152 tokens and 48,900 merges): reading the embedded
model's header took ~3 s of every start, five times its weights. Here the metadata is stepped over
with ``struct`` (string arrays by their length prefixes) and only the tensor table is built, as the
same ``ReaderTensor`` views over the same memory map. Anything but a little-endian GGUF v2/v3 is
handed to ``GGUFReader``.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import numpy as np

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_DENSE = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16}
_DENSE |= {"I32": np.int32, "I64": np.int64}


class GGUFTensors:
    """``.tensors``: the file's ``gguf.ReaderTensor`` list, in file order (``field`` is None)."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.gguf_reader import ReaderTensor
        from gguf.quants import quant_shape_to_byte_shape

        self.data = np.memmap(str(path), mode="r")
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            tensor_infos, data_start = _tensor_table(buf)
        tensors, names = [], set()
        for name, dims, type_id, offset in tensor_infos:
            if name in names:
                raise ValueError(f"Found duplicated tensor with name {name}")
            names.add(name)
            ggml_type = GGMLQuantizationType(type_id)
            n_elems = int(np.prod(dims)) if dims else 1
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            n_bytes = n_elems * type_size // block_size
            np_dims = tuple(reversed(dims))
            item_type = _DENSE.get(ggml_type.name)
            if item_type is None:  # a block type: rows of bytes
                item_type, np_dims = np.uint8, quant_shape_to_byte_shape(np_dims, ggml_type)
            start = data_start + offset
            view = self.data[start : start + n_bytes].view(item_type).reshape(np_dims)
            shape = np.array(dims, dtype=np.uint64)
            tensors.append(ReaderTensor(name, ggml_type, shape, n_elems, n_bytes, start, view, None))
        self.tensors = tensors


class _Unsupported(ValueError):
    pass


def _tensor_table(buf, values: dict | None = None) -> tuple[list[tuple[str, list[int], int, int]], int]:
    """(name, dims, type, offset) per tensor, and where the tensor data starts. ``values``: the
    metadata keys wanted, filled in where the file holds them as a number or a string."""
    if buf[:4] != _MAGIC:
        raise _Unsupported("not a GGUF file")
    (version,) = struct.unpack_from("<I", buf, 4)
    if version not in (2, 3):
        raise _Unsupported(f"GGUF version {version}")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    off = 24
    alignment = 32

    def string(off: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, off)
        return bytes(buf[off + 8 : off + 8 + n]).decode("utf-8"), off + 8 + n

    def skip(kind: int, off: int) -> int:
        if kind in _SCALAR_SIZES:
            return off + _SCALAR_SIZES[kind]
        if kind == _STRING:
            return off + 8 + struct.unpack_from("<Q", buf, off)[0]
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", buf, off)
            off += 12
            if item in _SCALAR_SIZES:
                return off + count * _SCALAR_SIZES[item]
            if item == _STRING:
                unpack = struct.Struct("<Q").unpack_from
                for _ in range(count):
                    off += 8 + unpack(buf, off)[0]
                return off
            for _ in range(count):
                off = skip(item, off)
            return off
        raise _Unsupported(f"GGUF value type {kind}")

    for _ in range(n_kv):
        key, off = string(off)
        (kind,) = struct.unpack_from("<I", buf, off)
        off += 4
        if key == "general.alignment" and kind == 4:
            (alignment,) = struct.unpack_from("<I", buf, off)
            if alignment == 0 or alignment & (alignment - 1):
                raise ValueError("Invalid alignment: must be a non-zero power of two")
        if values is not None and key in values:
            values[key] = _scalar(buf, kind, off)
        off = skip(kind, off)
    infos = []
    for _ in range(n_tensors):
        name, off = string(off)
        (n_dims,) = struct.unpack_from("<I", buf, off)
        dims = list(struct.unpack_from(f"<{n_dims}Q", buf, off + 4))
        type_id, offset = struct.unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
        off += 4 + 8 * n_dims + 12
        infos.append((name, dims, type_id, offset))
    return infos, off + (-off % alignment)


_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _scalar(buf, kind: int, off: int):
    if kind == _STRING:
        (n,) = struct.unpack_from("<Q", buf, off)
        return bytes(buf[off + 8 : off + 8 + n]).decode("utf-8", "replace")
    return struct.unpack_from(_SCALAR_FORMATS[kind], buf, off)[0] if kind in _SCALAR_FORMATS else None


def gguf_header(path: str | Path, keys: tuple[str, ...]) -> tuple[dict, list[tuple[str, list[int], int, int]]]:
    """The metadata ``keys`` that are numbers or strings (None where absent) and the tensor table,
    read by stepping over the rest (no ``GGUFReader``: milliseconds, not seconds)."""
    values = dict.fromkeys(keys)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        infos, _ = _tensor_table(buf, values)
    return values, infos


def metadata_field(reader, key: str, default=None):
    """A GGUF reader's metadata value ``key``, or ``default`` where the file has none."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_tensors_of(path: str | Path):
    """An object with the file's ``.tensors`` (``ReaderTensor``s): this module's fast reader, or
    ``gguf.GGUFReader`` for a file it does not read (big-endian, another version)."""
    try:
        return GGUFTensors(path)
    except _Unsupported:
        import gguf

        return gguf.GGUFReader(str(path))


def requantization_of(path: str | Path) -> str | None:
    """The ``--quantization`` that serves GGUF ``path``'s matrices at about their own precision where
    they cannot stay in their blocks (an architecture without native GGUF layers): ``int4`` for
    mostly 4-bit types, ``int8`` for 5- to 8-bit ones, None for float files. Counted by weights."""
    from llmkit.core.model.quant.gguf_quant import INT4_TYPES, INT8_TYPES

    sizes = {"int4": 0, "int8": 0, None: 0}
    for t in gguf_tensors_of(path).tensors:
        if len(t.shape) < 2:
            continue
        kind = t.tensor_type.name
        n = int(np.prod([int(d) for d in t.shape]))
        sizes["int4" if kind in INT4_TYPES else "int8" if kind in INT8_TYPES or kind in ("Q5_0", "Q5_1") else None] += n
    return max(sizes, key=sizes.get)
