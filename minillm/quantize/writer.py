"""Writing the output GGUF file: the header as llama-quantize writes it, and a temporary file
that becomes OUT only once it is complete.

Header: the input's metadata copied byte for byte, in order (gguf_set_kv), without the split
keys; general.quantization_version and then general.file_type set last (gguf_set_val_u32
removes a key and appends it again); version 3; tensor infos in the output order with offsets
padded to the alignment; zero padding to the alignment after the header and after every
tensor's data, as llama-quantize does.

Crash safety: the data goes to an unnamed O_TMPFILE in OUT's directory, which the kernel
deletes by itself if the process dies, even by SIGKILL. Only when everything is written is it
linked under a temporary name (`.OUT.minillm-tmp-<pid>`) and renamed over OUT. Where O_TMPFILE
is not supported the named temporary file is written directly; a later run removes such files
whose process is gone.
"""
from __future__ import annotations

import errno
import os
import re
import struct
from pathlib import Path

import numpy as np

from ..errors import MinillmError
from ..gguf_file import ARRAY, STRING, UINT32, GGUFFile, _SCALAR_FORMATS
from .plan import TensorPlan

GGUF_VERSION = 3
QUANTIZATION_VERSION = 2              # GGML_QNT_VERSION
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
SET_KEYS = ("general.quantization_version", "general.file_type")
TMP_TAG = ".minillm-tmp-"


# ---------------------------------------------------------------------------------------------
# header
# ---------------------------------------------------------------------------------------------
def _string(s: str) -> bytes:
    raw = s.encode("utf-8", "surrogateescape")
    return struct.pack("<Q", len(raw)) + raw


def _kv_u32(key: str, value: int) -> bytes:
    return _string(key) + struct.pack("<II", UINT32, value)


def _kv(key: str, value: str | int) -> bytes:
    """A string or uint32 entry."""
    if isinstance(value, str):
        return _string(key) + struct.pack("<I", STRING) + _string(value)
    return _kv_u32(key, value)


def _value_size(value, types: tuple[int, ...]) -> int:
    """Bytes the value (without key and type) takes in the file."""
    vtype = types[0]
    if vtype in _SCALAR_FORMATS:
        return struct.calcsize(_SCALAR_FORMATS[vtype])
    if vtype == STRING:
        return 8 + len(value.encode("utf-8", "surrogateescape"))
    if types[1] == STRING:
        return 12 + 8 * len(value) + len("".join(value).encode("utf-8", "surrogateescape"))
    if types[1] == ARRAY:
        raise MinillmError("metadata holds an array of arrays, which llama.cpp cannot read either")
    return 12 + value.nbytes


def metadata_blobs(gf: GGUFFile) -> list[tuple[str, bytes]]:
    """(key, raw bytes of the whole key-value entry) for every metadata entry, in file order,
    sliced from the input file itself so that every value is copied exactly."""
    blobs, pos = [], 24                          # after magic, version, tensor and kv counts
    for key, value in gf.metadata.items():
        size = 8 + len(key.encode("utf-8")) + 4 + _value_size(value, gf.metadata_types[key])
        blobs.append((key, gf.buffer[pos:pos + size].tobytes()))
        pos += size
    # self-check: the tensor infos must start right here, with the first tensor's name
    first = next(iter(gf.tensors), None)
    if first is not None and gf.buffer[pos:pos + 8 + len(first.encode())].tobytes() != _string(first):
        raise MinillmError(f"{gf.path}: could not delimit the metadata for copying")
    return blobs


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def build_header(gf: GGUFFile, tensors: list[TensorPlan], ftype: int, alignment: int,
                 n_layer: int | None = None, metadata: tuple = ()) -> bytes:
    """Everything before the tensor data, padded to the alignment. n_layer: the block count
    after pruning (set last, as llama-quantize does), None to copy the input's. metadata:
    (key, str or uint32) entries set after the file type (llama-quantize's --imatrix keys)."""
    replaced = SET_KEYS + tuple(key for key, _ in metadata)
    replaced += (f"{gf.architecture}.block_count",) if n_layer is not None else ()
    kvs = [blob for key, blob in metadata_blobs(gf) if key not in SPLIT_KEYS + replaced]
    kvs += [_kv_u32("general.quantization_version", QUANTIZATION_VERSION),
            _kv_u32("general.file_type", ftype)]
    kvs += [_kv(key, value) for key, value in metadata]
    if n_layer is not None:
        kvs.append(_kv_u32(f"{gf.architecture}.block_count", n_layer))
    parts = [b"GGUF", struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(kvs)), *kvs]
    offset = 0
    for t in tensors:
        parts.append(_string(t.name) + struct.pack("<I", len(t.shape))
                     + struct.pack(f"<{len(t.shape)}Q", *t.shape)
                     + struct.pack("<IQ", t.dst.ggml_type, offset))
        offset += _align(t.dst_bytes, alignment)
    header = b"".join(parts)
    return header + bytes(_align(len(header), alignment) - len(header))


# ---------------------------------------------------------------------------------------------
# the output file
# ---------------------------------------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(out: Path) -> list[Path]:
    """Delete `.OUT.minillm-tmp-<pid>` files left by runs that were killed."""
    pattern = re.compile(re.escape("." + out.name + TMP_TAG) + r"(\d+)$")
    removed = []
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return removed
    for p in entries:
        m = pattern.match(p.name)
        if m and not _pid_alive(int(m.group(1))):
            try:
                p.unlink()
                removed.append(p)
            except OSError:
                pass
    return removed


class AtomicOutput:
    """A file that appears at `out` only when commit() is called; close() without commit
    leaves nothing behind. Use as a context manager."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.tmp = self.out.with_name("." + self.out.name + TMP_TAG + str(os.getpid()))
        self.fd = -1
        self.named = False
        self.written = 0

    def __enter__(self) -> "AtomicOutput":
        remove_stale_temps(self.out)
        directory = str(self.out.parent)
        try:
            self.fd = os.open(directory, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o666)
        except (AttributeError, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno in (errno.ENOENT, errno.EACCES, errno.EROFS):
                raise MinillmError(f"cannot write in {directory}: {exc.strerror}") from None
            self._open_named()
        return self

    def _open_named(self) -> None:
        try:
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            raise MinillmError(f"cannot create {self.tmp}: {exc.strerror}") from None
        self.named = True

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            try:
                n = os.write(self.fd, view)
            except OSError as exc:
                raise MinillmError(f"cannot write {self.out}: {exc.strerror}") from None
            view = view[n:]
            self.written += n

    def pad(self, alignment: int) -> None:
        self.write(bytes(_align(self.written, alignment) - self.written))

    def commit(self) -> None:
        """Give the finished file its name (atomically replacing any existing OUT)."""
        try:
            if not self.named:
                # an explicit dir fd makes Python call linkat(AT_SYMLINK_FOLLOW), which links
                # the unnamed file the /proc link points to (plain link() would not follow it)
                dir_fd = os.open(self.out.parent, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.link(f"/proc/self/fd/{self.fd}", self.tmp.name, dst_dir_fd=dir_fd,
                            follow_symlinks=True)
                finally:
                    os.close(dir_fd)
                self.named = True
            os.close(self.fd)
            self.fd = -1
            os.replace(self.tmp, self.out)
            self.named = False
        except OSError as exc:
            raise MinillmError(f"cannot create {self.out}: {exc.strerror}") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.named:
            try:
                self.tmp.unlink()
            except FileNotFoundError:
                pass
            self.named = False

    def __exit__(self, *exc) -> None:
        self.close()


def write_array(out: AtomicOutput, data: np.ndarray, alignment: int) -> None:
    """Write one tensor's bytes, then zeros up to the alignment."""
    out.write(np.ascontiguousarray(data))
    out.pad(alignment)
