"""The loader refuses bad files with one clear error, never a crash or a read past the end."""
import struct

import numpy as np
import pytest

from minillm.errors import GGUFError, MinillmError
from minillm.gguf_file import GGUFFile
from minillm.cli.inspect import describe


def header(n_tensors=0, n_kv=0, version=3, magic=b"GGUF"):
    return magic + struct.pack("<IQQ", version, n_tensors, n_kv)


def gstr(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def kv_u32(key: bytes, value: int) -> bytes:
    return gstr(key) + struct.pack("<II", 4, value)


def write(tmp_path, data: bytes, name="bad.gguf"):
    path = tmp_path / name
    path.write_bytes(data + b"\0" * 64)
    return path


def expect_error(path, *words):
    with pytest.raises(GGUFError) as exc:
        GGUFFile(path)
    msg = str(exc.value)
    for w in words:
        assert w in msg, msg
    return msg


def test_valid_synthetic_file(tiny_llama):
    g = GGUFFile(tiny_llama)
    assert g.version == 3 and g.architecture == "llama"
    assert g.metadata["llama.block_count"] == 1
    info = g.tensors["blk.0.attn_q.weight"]
    assert info.shape == (64, 64) and info.format.name == "Q8_0"
    assert g.raw("blk.0.attn_q.weight").shape == (64, 2 * 34)


def test_bad_magic_and_version(tmp_path):
    expect_error(write(tmp_path, header(magic=b"GGUX")), "not a GGUF file")
    expect_error(write(tmp_path, header(version=1)), "unsupported GGUF version 1")
    expect_error(write(tmp_path, header(version=99)), "unsupported GGUF version 99")


def test_absurd_counts(tmp_path):
    expect_error(write(tmp_path, header(n_kv=1 << 40)), "metadata count")
    expect_error(write(tmp_path, header(n_tensors=1 << 60)), "tensor count")


def test_absurd_string_and_array_lengths(tmp_path):
    expect_error(write(tmp_path, header(n_kv=1) + struct.pack("<Q", 1 << 62)), "string length")
    # the 43-byte file whose array length is 2^63 (GGUFReader loops forever on it)
    arr = header(n_kv=1) + gstr(b"a") + struct.pack("<IIQ", 9, 4, 1 << 63)
    expect_error(write(tmp_path, arr), "longer than the rest of the file")
    arr = header(n_kv=1) + gstr(b"a") + struct.pack("<IIQ", 9, 8, 1 << 40)
    expect_error(write(tmp_path, arr), "strings is longer")


def test_string_arrays_that_run_past_the_end(tmp_path):
    def string_array(*strings: bytes, count: int):
        return header(n_kv=1) + gstr(b"a") + struct.pack("<IIQ", 9, 8, count) + b"".join(strings)

    long_length = struct.pack("<Q", 1000)  # a string of 1000 bytes where 64 remain
    expect_error(write(tmp_path, string_array(gstr(b"xy"), long_length, count=3)),
                 "metadata 'a' element 1", "string length 1000 runs past the end")
    # 40 + 64 bytes left hold 13 length fields, but the first string takes 40 of them
    expect_error(write(tmp_path, string_array(gstr(b"x" * 32), count=13)),
                 "truncated file: metadata 'a' element 9")
    g = GGUFFile(write(tmp_path, string_array(gstr(b"x" * 32), gstr("é".encode()), count=2)))
    assert g.metadata["a"] == ["x" * 32, "é"]


def test_unknown_value_and_tensor_types(tmp_path):
    expect_error(write(tmp_path, header(n_kv=1) + gstr(b"k") + struct.pack("<I", 99)), "unknown value type 99")
    expect_error(write(tmp_path, header(n_kv=1) + gstr(b"k") + struct.pack("<IIQ", 9, 77, 1)),
                 "unknown array element type 77")
    tensor = gstr(b"t") + struct.pack("<IQIQ", 1, 32, 99, 0)
    expect_error(write(tmp_path, header(n_tensors=1) + tensor), "unknown or unsupported tensor type 99")


def test_tensor_geometry(tmp_path):
    def one_tensor(dims, ggml_type=0, offset=0, pad=0):
        body = gstr(b"t") + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        body += struct.pack("<IQ", ggml_type, offset)
        return write(tmp_path, header(n_tensors=1) + body + b"\0" * pad)

    expect_error(one_tensor([1 << 42, 1 << 42]), "runs past the end")
    expect_error(one_tensor([2 ** 42 + 1, 2 ** 40]), "runs past the end")
    expect_error(one_tensor([4], offset=3), "not aligned")
    expect_error(one_tensor([4], offset=1 << 41), "runs past the end")
    expect_error(one_tensor([0]), "zero-sized")
    expect_error(one_tensor([33], ggml_type=8), "not a multiple")
    expect_error(one_tensor([4, 4, 4, 4, 4]), "dimensions")


def test_truncated_and_bit_flipped_files_fail_cleanly(tiny_llama, tmp_path):
    data = tiny_llama.read_bytes()
    g = GGUFFile(tiny_llama)
    header_end = g.data_offset
    rng = np.random.default_rng(0)
    cuts = sorted(set(rng.integers(1, len(data), 60).tolist()) | {1, 4, 8, 23, header_end - 1})
    for cut in cuts:
        path = tmp_path / "cut.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(MinillmError):
            describe(path)
    for i in range(300):  # single bit flips in the header, metadata and tensor infos
        flipped = bytearray(data)
        pos = int(rng.integers(0, header_end))
        flipped[pos] ^= 1 << int(rng.integers(0, 8))
        path = tmp_path / "flip.gguf"
        path.write_bytes(bytes(flipped))
        try:
            describe(path)
        except MinillmError as exc:
            assert str(exc)


def test_not_files(tmp_path):
    expect_error(tmp_path, "is a directory")
    expect_error(tmp_path / "missing.gguf", "no such file")
    text = tmp_path / "notes.txt"
    text.write_text("hello, this is just a text file that is long enough\n" * 3)
    expect_error(text, "not a GGUF file")


@pytest.mark.parametrize("key,value,words", [
    ("llama.block_count", 100000, ["block_count", "out of range"]),
    ("llama.attention.head_count", 0, ["head_count", "out of range"]),
    ("llama.embedding_length", 128, ["has shape", "metadata implies"]),
    ("llama.context_length", 1 << 31, ["context_length", "out of range"]),
])
def test_metadata_that_lies(tmp_path, key, value, words):
    from synthetic import SyntheticModel

    sm = SyntheticModel("llama", "Q8_0", n_layer=1, n_embd=64, n_head=2, n_head_kv=1,
                        head_dim=32, n_ff=128, n_vocab=40).build()
    path = sm.write(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    name = key.encode()
    at = data.index(name) + len(name)
    vtype = struct.unpack_from("<I", data, at)[0]
    assert vtype == 4  # uint32
    struct.pack_into("<I", data, at + 4, value)
    path.write_bytes(bytes(data))
    with pytest.raises(MinillmError) as exc:
        describe(path)
    for w in words:
        assert w in str(exc.value)


# -- models split over several files (llama.cpp's gguf-split) ----------------------------------
def test_split_model_reads_as_one(tiny_llama, tmp_path):
    from split_gguf import split_gguf

    import minillm

    paths = split_gguf(tiny_llama, tmp_path / "split", 3, stem="tiny")
    assert [p.name for p in paths] == [f"tiny-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    with GGUFFile(tiny_llama) as whole, GGUFFile(paths[0]) as split:
        assert len(split.parts) == 3 and list(split.tensors) == list(whole.tensors)
        assert {t.part for t in split.tensors.values()} == {0, 1, 2}
        assert split.file_size == sum(p.stat().st_size for p in paths)
        for name in whole.tensors:
            assert np.array_equal(split.raw(name), whole.raw(name)), name
            assert np.array_equal(split.read_rows(name, [0]), whole.read_rows(name, [0])), name
        assert {k: v for k, v in split.metadata.items() if not k.startswith("split.")}.keys() == whole.metadata.keys()
    ids = [1, 5, 9, 3]
    assert np.array_equal(minillm.load(paths[0]).logits(ids), minillm.load(tiny_llama).logits(ids))


def test_split_model_errors(tiny_llama, tmp_path):
    from split_gguf import split_gguf

    paths = split_gguf(tiny_llama, tmp_path / "split", 3, stem="tiny")
    with pytest.raises(GGUFError, match="load the model from its first part"):
        GGUFFile(paths[1])
    renamed = paths[0].with_name("tiny.gguf")
    paths[0].rename(renamed)
    with pytest.raises(GGUFError, match="not named NAME-00001-of-00003.gguf"):
        GGUFFile(renamed)
    renamed.rename(paths[0])
    paths[2].unlink()
    with pytest.raises(GGUFError, match="tiny-00003-of-00003.gguf: no such file"):
        GGUFFile(paths[0])
    paths[1].rename(paths[2])  # part 2 in part 3's place: its split.no says 1
    split_gguf(tiny_llama, tmp_path / "again", 3, stem="tiny")[1].rename(paths[1])
    with pytest.raises(GGUFError, match="split.no is 1, expected 2"):
        GGUFFile(paths[0])
