"""Writes a model as llama.cpp's gguf-split does (NAME-00001-of-0000N.gguf): the first part
holds all the metadata, every part split.no / split.count / split.tensors.count and a share of
the tensors. For tests of the loader and of the hub's split downloads."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from minillm.gguf_file import INT32, UINT16, GGUFFile
from minillm.quantize.writer import SPLIT_KEYS, _align, _string, metadata_blobs


def _kv(key: str, vtype: int, fmt: str, value: int) -> bytes:
    return _string(key) + struct.pack("<I", vtype) + struct.pack(fmt, value)


def split_gguf(src: Path, out_dir: Path, n_parts: int, stem: str | None = None) -> list[Path]:
    """src written as n_parts files in out_dir; returns their paths, first part first."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = stem or src.stem
    with GGUFFile(src) as gf:
        names = list(gf.tensors)
        blobs = [blob for key, blob in metadata_blobs(gf) if key not in SPLIT_KEYS]
        paths = []
        for index, group in enumerate(np.array_split(np.array(names, dtype=object), n_parts)):
            kvs = (blobs if index == 0 else []) + [
                _kv("split.no", UINT16, "<H", index), _kv("split.count", UINT16, "<H", n_parts),
                _kv("split.tensors.count", INT32, "<i", len(names))]
            infos, offset = [], 0
            for name in group:
                t = gf.tensors[name]
                infos.append(_string(name) + struct.pack(f"<I{len(t.shape)}QIQ", len(t.shape), *t.shape,
                                                         t.ggml_type, offset))
                offset += _align(t.n_bytes, gf.alignment)
            header = b"".join([b"GGUF", struct.pack("<IQQ", 3, len(group), len(kvs)), *kvs, *infos])
            path = out_dir / f"{stem}-{index + 1:05d}-of-{n_parts:05d}.gguf"
            with open(path, "wb") as f:
                f.write(header + bytes(_align(len(header), gf.alignment) - len(header)))
                for name in group:
                    data = gf.raw(name).tobytes()
                    f.write(data + bytes(_align(len(data), gf.alignment) - len(data)))
            paths.append(path)
    return paths
