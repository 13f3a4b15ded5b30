"""A validating, memory-mapping GGUF parser.

Reads the header, metadata and tensor infos without copying tensor data, and checks
everything before any kernel touches the bytes: Numba kernels do not check bounds, so
this module must. Every count and length is bounded by the bytes that remain in the file.

Layout (GGUF v2/v3, little-endian):
    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x (string key, u32 value type, value)
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml type, u64 offset)
    padding to general.alignment | tensor data (offsets relative to here)
"""
from __future__ import annotations

import mmap
import os
import re
import struct
from collections.abc import Sequence
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import GGUFError
from .formats import FORMATS_BY_ID

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_ARRAY_NESTING = 4
MAX_STRING_BYTES = 1 << 30

# metadata value types
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALAR_FORMATS = {
    UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i",
    FLOAT32: "<f", BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d",
}
_SCALAR_DTYPES = {
    UINT8: np.uint8, INT8: np.int8, UINT16: np.uint16, INT16: np.int16, UINT32: np.uint32,
    INT32: np.int32, FLOAT32: np.float32, BOOL: np.bool_, UINT64: np.uint64, INT64: np.int64,
    FLOAT64: np.float64,
}
TYPE_NAMES = {
    UINT8: "uint8", INT8: "int8", UINT16: "uint16", INT16: "int16", UINT32: "uint32", INT32: "int32",
    FLOAT32: "float32", BOOL: "bool", STRING: "string", ARRAY: "array", UINT64: "uint64",
    INT64: "int64", FLOAT64: "float64",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: shape[0] is the innermost (contiguous) dimension
    ggml_type: int
    offset: int             # absolute offset of the data in the file
    n_bytes: int
    part: int = 0           # the split file that holds it (0: the first, or the only file)

    @property
    def format(self):
        return FORMATS_BY_ID[self.ggml_type]

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


LAZY_STRINGS = 1024  # string arrays longer than this (vocabularies, merges) decode on access


class StringArray(Sequence):
    """A long GGUF array of strings, kept as its bytes and decoded on access: a 262,144-token
    vocabulary takes ~22 MiB as Python strings, which a process that never tokenizes (bench,
    info) need not hold. Strings that are not UTF-8 decode with surrogateescape."""

    def __init__(self, data: bytes, starts: np.ndarray, ends: np.ndarray):
        # offsets into data, int32 where they fit (a vocabulary's are 2 MiB instead of 4)
        offset_type = np.int32 if len(data) < 2**31 else np.int64
        self._data = data
        self._starts, self._ends = starts.astype(offset_type), ends.astype(offset_type)

    @classmethod
    def from_strings(cls, strings) -> "StringArray":
        """The same strings held as one buffer (each written back as the bytes it decoded from)."""
        raw = [s.encode("utf-8", "surrogateescape") for s in strings]
        lengths = np.array([len(r) for r in raw], np.int64)
        ends = np.cumsum(lengths)
        return cls(b"".join(raw), ends - lengths, ends)

    def buffers(self) -> tuple[bytes, np.ndarray, np.ndarray]:
        """(data, starts, ends): string i is data[starts[i]:ends[i]]."""
        return self._data, self._starts, self._ends

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._decode(self._data[self._starts[i]:self._ends[i]])

    def __iter__(self):
        data, spans = self._data, zip(self._starts.tolist(), self._ends.tolist())
        try:
            return iter([data[a:b].decode("utf-8") for a, b in spans])  # all at once: the usual case
        except UnicodeDecodeError:
            return (self._decode(data[a:b]) for a, b in zip(self._starts.tolist(), self._ends.tolist()))

    def __eq__(self, other) -> bool:
        if not isinstance(other, (StringArray, list, tuple)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings)"

    @staticmethod
    def _decode(raw: bytes) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="surrogateescape")


class _Cursor:
    """Reads little-endian values from a buffer, refusing to read past its end."""

    def __init__(self, buf, size: int):
        self.buf = buf
        self.size = size
        self.pos = 0

    def remaining(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.remaining():
            raise GGUFError(f"truncated file: {what} needs {n} bytes at offset {self.pos}, "
                            f"only {self.remaining()} remain")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def u32(self, what: str) -> int:
        return self.unpack("<I", what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", what)

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        if n > MAX_STRING_BYTES:
            raise GGUFError(f"{what}: string length {n} is absurd")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{what}: string is not valid UTF-8") from None


SPLIT_NAME = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")  # llama.cpp's split files: NAME-00001-of-00003.gguf


def split_paths(first: Path, count: int) -> list[Path]:
    """The files of a model split in `count` parts, from the path of the first."""
    m = SPLIT_NAME.match(first.name)
    if m is None or int(m.group(2)) != 1 or int(m.group(3)) != count:
        raise GGUFError(f"{first}: the first of {count} split files, but not named "
                        f"NAME-00001-of-{count:05d}.gguf, so its other parts cannot be found")
    return [first.with_name(f"{m.group(1)}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


class GGUFFile:
    """A parsed, validated GGUF file. Tensor data stays in the memory map. A model split over
    several files (split.count > 1, as llama.cpp's gguf-split writes) opens from its first file
    and reads as one: metadata from the first, tensors from all.

    Attributes:
        path, version, file_size (all parts together)
        metadata: dict key -> value (str, int, float, bool, list of str, or numpy array)
        metadata_types: dict key -> value type (and element type for arrays)
        tensors: dict name -> TensorInfo, in file order
        data_offset: absolute offset of the tensor data section (of the first file)
        parts: the open files, [self] when the model is one file
    """

    def __init__(self, path: str | os.PathLike, split_no: int | None = None):
        self.path = Path(path)
        self._file = None
        self._mmap = None
        self.parts = [self]
        self._open()
        try:
            self._parse()
            if split_no is None:
                self._open_splits()
        except GGUFError:
            self.close()
            raise
        except (struct.error, OverflowError, ValueError, MemoryError) as exc:
            self.close()
            raise GGUFError(f"{self.path}: malformed GGUF file ({exc})") from None

    def _open_splits(self) -> None:
        """The other parts of a split model, checked as llama.cpp checks them: each names its
        index, no tensor twice, and split.tensors.count tensors in all."""
        count = self.metadata.get("split.count", 0)
        if not isinstance(count, int) or count <= 1:
            return
        if self.metadata.get("split.no", 0) != 0:
            raise GGUFError(f"{self.path}: part {self.metadata.get('split.no') + 1} of a split model: "
                            f"load the model from its first part (…-00001-of-{count:05d}.gguf)")
        for index, part_path in enumerate(split_paths(self.path, count)[1:], start=1):
            part = GGUFFile(part_path, split_no=index)
            self.parts.append(part)
            if part.metadata.get("split.no") != index:
                raise GGUFError(f"{part_path}: split.no is {part.metadata.get('split.no')!r}, expected {index}")
            for name, info in part.tensors.items():
                if name in self.tensors:
                    raise GGUFError(f"{part_path}: tensor '{name}' is also in an earlier part")
                self.tensors[name] = dataclasses.replace(info, part=index)
        expected = self.metadata.get("split.tensors.count")
        if expected != len(self.tensors):
            raise GGUFError(f"{self.path}: split.tensors.count is {expected!r}, the {count} parts hold "
                            f"{len(self.tensors)} tensors")
        self.file_size = sum(part.file_size for part in self.parts)

    # -- opening -----------------------------------------------------------------
    def _open(self) -> None:
        p = self.path
        if not p.exists():
            raise GGUFError(f"{p}: no such file")
        if p.is_dir():
            raise GGUFError(f"{p}: is a directory, not a GGUF file")
        try:
            self.file_size = p.stat().st_size
            if self.file_size < 24:
                raise GGUFError(f"{p}: not a GGUF file (only {self.file_size} bytes)")
            self._file = open(p, "rb")
            self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            self.close()
            if isinstance(exc, PermissionError):
                raise GGUFError(f"{p}: permission denied") from None
            raise GGUFError(f"{p}: cannot read ({exc.strerror or exc})") from None
        self.buffer = np.frombuffer(self._mmap, dtype=np.uint8)

    def release_pages(self, name: str | None = None, rows: tuple[int, int] | None = None) -> None:
        """Drop the mapped pages of a tensor (rows [r0, r1) of it, or all), or of the whole file,
        from memory; they are read back from the file if touched again. Called as weights are
        repacked, so that they are not held twice."""
        if name is None:
            for part in self.parts:
                if part._mmap is not None and hasattr(mmap, "MADV_DONTNEED"):
                    part._mmap.madvise(mmap.MADV_DONTNEED)
            return
        t = self.tensors[name]
        part = self.parts[t.part]
        if part._mmap is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        begin, end = t.offset, t.offset + t.n_bytes
        if rows is not None:
            row_bytes = t.shape[0] // t.format.block_size * t.format.type_size
            begin, end = t.offset + rows[0] * row_bytes, min(end, t.offset + rows[1] * row_bytes)
        start = begin // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            part._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        for part in self.parts[1:]:
            part.close()
        self.buffer = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # arrays still view the map; it closes when they are gone
            self._mmap = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- parsing -----------------------------------------------------------------
    def _parse(self) -> None:
        cur = _Cursor(self._mmap, self.file_size)
        magic = bytes(self._mmap[:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        cur.pos = 4
        self.version = cur.u32("version")
        if self.version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{self.path}: unsupported GGUF version {self.version} (supported: 2, 3)")
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        # each kv needs >= 8 (key len) + 4 (type) + 1 bytes; each tensor info >= 8 + 4 + 8 + 4 + 8
        if n_kv > cur.remaining() // 13:
            raise GGUFError(f"{self.path}: metadata count {n_kv} is larger than the file can hold")
        if n_tensors > cur.remaining() // 32:
            raise GGUFError(f"{self.path}: tensor count {n_tensors} is larger than the file can hold")

        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, tuple[int, ...]] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            if key in self.metadata:
                raise GGUFError(f"{self.path}: duplicate metadata key '{key}'")
            vtype = cur.u32(f"type of '{key}'")
            value, types = self._read_value(cur, vtype, key, 0)
            self.metadata[key] = value
            self.metadata_types[key] = types

        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (self.metadata_types.get("general.alignment", (UINT32,))[0] != UINT32
                or alignment <= 0 or alignment & (alignment - 1) or alignment > (1 << 20)):
            raise GGUFError(f"{self.path}: general.alignment must be a power-of-two uint32, got {alignment!r}")
        self.alignment = alignment

        infos = []
        for i in range(n_tensors):
            name = cur.string(f"name of tensor #{i}")
            n_dims = cur.u32(f"dimension count of '{name}'")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFError(f"tensor '{name}': {n_dims} dimensions (must be 1..{MAX_DIMS})")
            shape = tuple(cur.u64(f"dimension of '{name}'") for _ in range(n_dims))
            ggml_type = cur.u32(f"type of '{name}'")
            rel_offset = cur.u64(f"data offset of '{name}'")
            infos.append((name, shape, ggml_type, rel_offset))

        self.data_offset = _align(cur.pos, alignment)
        if n_tensors == 0:  # a vocabulary-only file may end right after its metadata
            self.data_offset = min(self.data_offset, self.file_size)
        if self.data_offset > self.file_size:
            raise GGUFError(f"{self.path}: truncated file: tensor data would start past the end")
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, rel_offset in infos:
            self.tensors[name] = self._check_tensor(name, shape, ggml_type, rel_offset)
        self._check_overlaps()

    def _read_value(self, cur: _Cursor, vtype: int, key: str, depth: int):
        if vtype in _SCALAR_FORMATS:
            value = cur.unpack(_SCALAR_FORMATS[vtype], f"value of '{key}'")
            return value, (vtype,)
        if vtype == STRING:
            return cur.string(f"value of '{key}'"), (vtype,)
        if vtype == ARRAY:
            if depth >= MAX_ARRAY_NESTING:
                raise GGUFError(f"metadata '{key}': arrays nested too deeply")
            etype = cur.u32(f"element type of '{key}'")
            count = cur.u64(f"length of '{key}'")
            if etype in _SCALAR_DTYPES:
                item = np.dtype(_SCALAR_DTYPES[etype]).itemsize
                if count > cur.remaining() // item:
                    raise GGUFError(f"metadata '{key}': array of {count} {TYPE_NAMES[etype]} "
                                    f"is longer than the rest of the file")
                arr = np.frombuffer(self._mmap, dtype=_SCALAR_DTYPES[etype], count=count, offset=cur.pos).copy()
                cur.pos += count * item
                return arr, (ARRAY, etype)
            if etype == STRING:
                if count > cur.remaining() // 8:
                    raise GGUFError(f"metadata '{key}': array of {count} strings is longer than the rest of the file")
                return self._read_string_array(cur, count, key), (ARRAY, etype)
            if etype == ARRAY:
                if count > cur.remaining() // 12:
                    raise GGUFError(f"metadata '{key}': array of {count} arrays is longer than the rest of the file")
                items = [self._read_value(cur, ARRAY, key, depth + 1)[0] for _ in range(count)]
                return items, (ARRAY, etype)
            raise GGUFError(f"metadata '{key}': unknown array element type {etype}")
        raise GGUFError(f"metadata '{key}': unknown value type {vtype}")

    def _read_string_array(self, cur: _Cursor, count: int, key: str) -> list[str] | StringArray:
        from .kernels.cpu.text import scan_string_array

        starts, ends, failed = scan_string_array(self.buffer, cur.pos, count)
        if failed >= 0:
            pos = int(ends[failed - 1]) if failed else cur.pos
            if pos + 8 > self.file_size:
                raise GGUFError(f"truncated file: metadata '{key}' element {failed}")
            raise GGUFError(f"metadata '{key}' element {failed}: string length "
                            f"{struct.unpack_from('<Q', self._mmap, pos)[0]} runs past the end of the file")
        end = int(ends[-1]) if count else cur.pos
        strings = StringArray(bytes(self._mmap[cur.pos:end]), starts - cur.pos, ends - cur.pos)
        cur.pos = end
        return strings if count > LAZY_STRINGS else list(strings)

    def _check_tensor(self, name: str, shape, ggml_type: int, rel_offset: int) -> TensorInfo:
        if name in self.tensors:
            raise GGUFError(f"duplicate tensor name '{name}'")
        fmt = FORMATS_BY_ID.get(ggml_type)
        if fmt is None:
            raise GGUFError(f"tensor '{name}': unknown or unsupported tensor type {ggml_type}")
        if any(d == 0 for d in shape):
            raise GGUFError(f"tensor '{name}': zero-sized dimension in shape {list(shape)}")
        n_elements = 1
        for d in shape:
            n_elements *= d  # Python ints: no overflow
        if shape[0] % fmt.block_size:
            raise GGUFError(f"tensor '{name}': row length {shape[0]} is not a multiple of "
                            f"{fmt.name}'s block size {fmt.block_size}")
        n_bytes = n_elements // fmt.block_size * fmt.type_size
        if rel_offset % self.alignment:
            raise GGUFError(f"tensor '{name}': data offset {rel_offset} is not aligned to {self.alignment}")
        start = self.data_offset + rel_offset
        if n_bytes > self.file_size or start > self.file_size - n_bytes:
            raise GGUFError(f"tensor '{name}': data ({n_bytes} bytes at offset {start}) runs past the end "
                            f"of the file ({self.file_size} bytes)")
        return TensorInfo(name, tuple(int(d) for d in shape), ggml_type, start, n_bytes)

    def _check_overlaps(self) -> None:
        spans = sorted((t.offset, t.offset + t.n_bytes, t.name) for t in self.tensors.values())
        for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise GGUFError(f"tensors '{n0}' and '{n1}' overlap in the file")

    # -- access ------------------------------------------------------------------
    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the map, shape (rows, row_bytes)."""
        t = self.tensors[name]
        row_bytes = t.shape[0] // t.format.block_size * t.format.type_size
        view = self.parts[t.part].buffer[t.offset:t.offset + t.n_bytes]
        return view.reshape(-1, row_bytes)

    def read_rows(self, name: str, rows) -> np.ndarray:
        """Rows of a tensor, (len(rows), row_bytes) uint8, read from the file rather than the map:
        the kernel maps page-cache folios whole (up to 2 MiB), so touching one mapped row can
        add megabytes to resident memory."""
        t = self.tensors[name]
        row_bytes = t.shape[0] // t.format.block_size * t.format.type_size
        out = np.empty((len(rows), row_bytes), np.uint8)
        fd = self.parts[t.part]._file.fileno()
        for i, row in enumerate(rows):
            if os.preadv(fd, [out[i]], t.offset + int(row) * row_bytes) != row_bytes:
                raise GGUFError(f"{self.path}: short read in tensor '{name}'")
        return out

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def peek_metadata(path: str | os.PathLike, keys: tuple[str, ...]) -> dict[str, Any]:
    """The scalar or string values of `keys` in a GGUF file's metadata, read from the start of the
    file and stopping once all are found: no tensor map, no vocabulary decoded (for listings
    of many files). Keys that are missing, or arrays, are left out; a malformed file gives {}."""
    found: dict[str, Any] = {}
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            cur = _Cursor(buf, len(buf))
            if bytes(buf[:4]) != GGUF_MAGIC:
                return found
            cur.pos = 4
            cur.u32("version")
            cur.u64("tensor count")
            for _ in range(cur.u64("metadata count")):
                key = cur.string("metadata key")
                vtype = cur.u32("type")
                if key in keys and vtype in _SCALAR_FORMATS:
                    found[key] = cur.unpack(_SCALAR_FORMATS[vtype], key)
                elif key in keys and vtype == STRING:
                    found[key] = cur.string(key)
                else:
                    _skip_value(cur, vtype)
                if len(found) == len(keys):
                    break
    except (OSError, ValueError, GGUFError, struct.error):
        pass
    return found


def _skip_value(cur: _Cursor, vtype: int) -> None:
    if vtype in _SCALAR_FORMATS:
        cur.pos += struct.calcsize(_SCALAR_FORMATS[vtype])
    elif vtype == STRING:
        length = cur.u64("string length")
        cur.pos += length
    elif vtype == ARRAY:
        etype, count = cur.u32("element type"), cur.u64("array length")
        if etype in _SCALAR_FORMATS:
            cur.pos += count * struct.calcsize(_SCALAR_FORMATS[etype])
        else:
            for _ in range(count):
                _skip_value(cur, etype)
    else:
        raise GGUFError(f"unknown value type {vtype}")
    cur.need(0, "value")
