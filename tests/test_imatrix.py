"""Importance matrices against llama.cpp b11434: `minillm imatrix` writes llama-imatrix's file
(its ubatch order, its statistics, its bytes) and `quantize --imatrix` llama-quantize's.
Reference: tests/data/imatrix_reference.json (tests/llama_ref/record_imatrix.py)."""
import hashlib
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import DATA, ROOT, loaded_model, model_path
from synthetic import synthetic_imatrix

from minillm.errors import MinillmError
from minillm.imatrix import compute_imatrix
from minillm.imatrix_file import load, to_bytes
from minillm.kernels.cpu.ops import ggml_build
from minillm.quantize import quantize

REF = json.loads((DATA / "imatrix_reference.json").read_text())
TEXT = (ROOT / REF["text"]).read_text()
# the activations are those of ggml's build for this CPU; the reference came from one build
HOST_BUILD = ggml_build()
SAME_BUILD = HOST_BUILD in REF["builds"]   # else another build's figures, compared within a tolerance
BUILD_REF = REF["builds"][HOST_BUILD if SAME_BUILD else next(iter(REF["builds"]))]


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def check_against(run: dict, path: Path, ppl: float) -> None:
    imatrix = load(path)
    assert imatrix.chunk_count == run["chunk_count"] and imatrix.datasets == [REF["text"]]
    sums = {name: float(e.sum2.astype(np.float64).sum()) for name, e in imatrix.entries.items()}
    assert sums.keys() == run["entry_sums"].keys()
    if SAME_BUILD:
        assert sha256(path) == run["sha256"]
        assert round(ppl, 4) == run["ppl"]
    else:   # another ggml build rounds the activations differently: the sums agree, not the bits
        for name, value in run["entry_sums"].items():
            assert sums[name] == pytest.approx(value, rel=1e-3), name
        assert ppl == pytest.approx(run["ppl"], rel=1e-3)


@pytest.mark.parametrize("run", BUILD_REF["imatrix"][1:], ids=lambda r: f"{r['model']}{''.join(r['args'])}")
def test_imatrix_equals_llama_imatrixs(run, tmp_path):
    args = run["args"]
    n_batch = int(args[args.index("-b") + 1]) if "-b" in args else 2048
    result = compute_imatrix(loaded_model(run["model"]), TEXT, REF["text"], REF["n_ctx"], n_batch,
                             n_chunks=REF["n_chunks"], process_output="--process-output" in args)
    (tmp_path / "imatrix.gguf").write_bytes(to_bytes(result.imatrix))
    check_against(run, tmp_path / "imatrix.gguf", result.ppl)


def test_imatrix_command_writes_llama_imatrixs_file(tmp_path):
    """The CLI, with llama-imatrix's default batch: 16 chunks of 128 at a time, equal ubatches."""
    run = BUILD_REF["imatrix"][0]
    out = tmp_path / "sub" / "m.gguf"
    out.parent.mkdir()
    done = subprocess.run([sys.executable, "-m", "minillm", "imatrix", model_path(run["model"]), "-f", REF["text"],
                           "-o", out, "-c", str(REF["n_ctx"]), "--chunks", str(REF["n_chunks"]), "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["entries"] == len(run["entry_sums"]) and figures["chunks"] == run["chunk_count"]
    assert "saved 210 entries computed on 6 chunks" in done.stderr
    check_against(run, out, figures["ppl"])


def test_imatrix_refuses_a_short_text():
    with pytest.raises(MinillmError, match="needs at least 1024"):
        compute_imatrix(loaded_model("smollm2"), TEXT[:2000], "short", 512)


@pytest.mark.parametrize("quant", REF["quantize"], ids=lambda q: "".join(q["args"]))
def test_quantize_with_imatrix_equals_llama_quantizes(quant, smollm2_f16, tmp_path, monkeypatch):
    """Every weighted quantizer (Q2_K..Q6_K, Q4_0/Q4_1/Q5_0/Q5_1 through these mixtures) and the
    quantize.imatrix.* keys, with a synthetic importance matrix passed as llama-quantize got it."""
    (tmp_path / "imatrix.gguf").write_bytes(to_bytes(synthetic_imatrix(smollm2_f16)))
    monkeypatch.chdir(tmp_path)
    *flags, type_name = quant["args"]
    quantize(smollm2_f16, "out.gguf", type_name, pure="--pure" in flags, imatrix=Path("imatrix.gguf"))
    assert sha256("out.gguf") == quant["sha256"]


def test_quantize_refuses_an_imatrix_of_another_model(smollm2_f16):
    imatrix = synthetic_imatrix(smollm2_f16)
    e = imatrix.entries["blk.3.ffn_up.weight"]
    e.sum2, e.sum1 = e.sum2[:512], e.sum1[:512]
    with pytest.raises(MinillmError, match="512 values for blk.3.ffn_up.weight, whose rows hold 576"):
        quantize(smollm2_f16, None, "Q4_K_M", imatrix=imatrix, dry_run=True)


def test_bad_imatrix_files_are_refused_by_name(tmp_path, smollm2_f16):
    good = to_bytes(synthetic_imatrix(smollm2_f16))
    (tmp_path / "cut.gguf").write_bytes(good[:5000])
    (tmp_path / "text.dat").write_text("not an importance matrix\n")
    with pytest.raises(MinillmError, match="not a valid importance matrix"):
        load(tmp_path / "cut.gguf")
    with pytest.raises(MinillmError, match="not an importance matrix"):
        load(tmp_path / "text.dat")
    with pytest.raises(MinillmError, match="missing imatrix metadata"):
        load(model_path("smollm2"))
    with pytest.raises(MinillmError, match="cannot read"):
        load(tmp_path / "absent.gguf")


def test_legacy_dat_file_weights(tmp_path):
    """llama-imatrix --output-format dat: sums already averaged per call, one call count."""
    sums = np.array([2.0, 4.0, 0.5], np.float32)
    name = b"blk.0.attn_q.weight"
    raw = struct.pack("<ii", 1, len(name)) + name + struct.pack("<ii", 4, 3) + sums.tobytes()
    raw += struct.pack("<ii", 10, 4) + b"text"
    (tmp_path / "old.dat").write_bytes(raw)
    imatrix = load(tmp_path / "old.dat")
    assert imatrix.legacy and imatrix.chunk_count == 10 and imatrix.datasets == ["text"]
    np.testing.assert_array_equal(imatrix.weights("blk.0.attn_q.weight"), sums / np.float32(4))
    assert imatrix.weights("blk.0.attn_k.weight") is None
