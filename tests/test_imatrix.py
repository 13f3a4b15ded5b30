"""Importance matrices against llama.cpp b11434: `minillm imatrix` writes llama-imatrix's file
(its ubatch order, its statistics, its bytes), combines files, writes them periodically and in
the legacy format, and prints their statistics as llama-imatrix does; `quantize --imatrix`
writes llama-quantize's file. Reference: tests/data/imatrix_reference.json
(tests/llama_ref/record_imatrix.py)."""
import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import DATA, ROOT, loaded_model, model_path
from synthetic import imatrix_inputs, synthetic_imatrix

from minillm.cli.imatrix import parse_csv_row
from minillm.errors import MinillmError
from minillm.quality.imatrix import compute_imatrix
from minillm.imatrix_file import load, to_bytes
from minillm.kernels.cpu.ops import ggml_build
from minillm.quantize import quantize

REF = json.loads((DATA / "imatrix_reference.json").read_text())
TEXT = (ROOT / REF["text"]).read_text()
# the activations are those of ggml's build for this CPU; the reference came from one build
HOST_BUILD = ggml_build()
SAME_BUILD = HOST_BUILD in REF["builds"]   # else another build's figures, compared within a tolerance
BUILD_REF = REF["builds"][HOST_BUILD if SAME_BUILD else next(iter(REF["builds"]))]
# the options' runs (record_imatrix.py's "options") may have been recorded on fewer builds
OPTIONS_BUILD = HOST_BUILD if "options" in REF["builds"].get(HOST_BUILD, {}) else \
    next(build for build, ref in REF["builds"].items() if "options" in ref)
SAME_OPTIONS_BUILD = OPTIONS_BUILD == HOST_BUILD
OPTIONS_REF = REF["builds"][OPTIONS_BUILD]["options"]


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


# ---------------------------------------------------------------------------------------------
# the options: --in-file, --output-format dat, --show-statistics, the periodic files, --chunk
# ---------------------------------------------------------------------------------------------
def imatrix_cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "minillm", "imatrix", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=300, env={**os.environ, "NUMBA_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The synthetic files record_imatrix.py had llama-imatrix combine and show, checked."""
    files = imatrix_inputs(model_path("smollm2"), tmp_path_factory.mktemp("inputs"))
    assert {name: sha256(path) for name, path in files.items()} == REF["combine"]["inputs"]
    return files["a.gguf"].parent


@pytest.mark.parametrize("case", REF["combine"]["runs"], ids=lambda c: " ".join(c["args"][:-2]))
def test_combining_files_equals_llama_imatrixs(case, inputs, tmp_path):
    """--in-file without a text: sums and counts added, activation sums only while every file
    has them, a legacy file's averages counted as -c rows a chunk, the first chunk size kept;
    entries of different sizes refused. GGUF or .dat out, byte for byte."""
    args = list(case["args"])
    out = tmp_path / args[args.index("-o") + 1]
    args[args.index("-o") + 1] = out
    done = imatrix_cli(*args, "--json", cwd=inputs)
    assert done.returncode == case["rc"], done.stderr
    if case["rc"] == 0:
        assert sha256(out) == case["sha256"]
        assert json.loads(done.stdout)["file"] == str(out)
    else:
        assert done.stderr.startswith("error: bad.gguf: blk.3.ffn_up.weight holds 288 values, the files before 576")
        assert not out.exists()


@pytest.mark.parametrize("case", REF["combine"]["statistics"], ids=lambda c: c["args"][-1])
def test_show_statistics_prints_llama_imatrixs_table(case, inputs):
    """--show-statistics: the per-tensor and per-layer tables, byte for byte (b.gguf: one entry
    without activation sums, so the legacy layout; gap.gguf: a missing block, so no layer table
    and status 1)."""
    done = imatrix_cli(*case["args"], cwd=inputs)
    assert done.returncode == case["rc"], done.stderr
    assert done.stdout == case["stdout"]
    if case["rc"]:
        assert done.stderr == "error: the blocks have a gap (29 blocks in 0-29, 30 expected): no layer statistics\n"


def test_show_statistics_json(inputs):
    done = imatrix_cli("--show-statistics", "--in-file", "a.gguf", "--json", cwd=inputs)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["files"] == ["a.gguf"] and not figures["legacy"] and figures["gap"] is None
    assert len(figures["tensors"]) == 210 and [row["layer"] for row in figures["layers"]] == [str(i) for i in range(30)]
    table = REF["combine"]["statistics"][0]["stdout"]
    row = next(r for r in figures["tensors"] if r["tensor"] == "blk.7.ffn_down.weight")
    line = next(line for line in table.splitlines() if "blk.7.ffn_down.weight" in line)
    assert f"{row['mean']:10.4f}{row['std_deviation']:10.4f}" in line and f"{row['sum_sq']:14.4f}" in line
    assert figures["tensors"][0]["gain"] is None and figures["layers"][0]["cossim"] is None   # block 0: NaN


def test_periodic_files_equal_llama_imatrixs(tmp_path):
    """-ofreq and --save-frequency with the default batch (6 chunks of 128 in one batch, two
    ubatches: 4 chunks, then 6). Written at llama-imatrix's moments, in the middle of a ubatch
    (after its first product: .at_4 holds one entry), when the chunk count passes a multiple of
    the frequency; then the statistics of the output as llama-imatrix prints them."""
    ref = REF["options"]["periodic"]
    done = imatrix_cli(model_path("smollm2"), "-f", REF["text"], "-c", REF["n_ctx"], "-o", tmp_path / "imatrix.gguf",
                       "-t", "1", "--no-ppl", *ref["args"])
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(ref["files"])
    for name, pattern in ref["files"].items():
        counts = [str(int(e.counts[0])) for e in load(tmp_path / name).entries.values()]
        assert {c: counts.count(c) for c in set(counts)} == pattern, name
        if SAME_OPTIONS_BUILD:
            assert sha256(tmp_path / name) == OPTIONS_REF["periodic"][name], name
    shown = imatrix_cli("--show-statistics", "--in-file", "imatrix.gguf", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    if SAME_OPTIONS_BUILD:
        assert shown.stdout == OPTIONS_REF["statistics"]


def test_from_chunk_with_in_file_equals_llama_imatrixs(tmp_path):
    """Two chunks, then two more from chunk 2 (--chunk) added to them (--in-file), written as
    .dat: the file llama-imatrix writes, with its chunk count and both datasets."""
    ref = REF["options"]["from_chunk"]
    first = compute_imatrix(loaded_model("smollm2"), TEXT, REF["text"], REF["n_ctx"], 128, n_chunks=2)
    (tmp_path / "part1.gguf").write_bytes(to_bytes(first.imatrix))
    second = [tmp_path / "part1.gguf" if a == "{part1}" else a for a in ref["second"]]
    done = imatrix_cli(model_path("smollm2"), "-f", REF["text"], "-c", REF["n_ctx"], "-o", tmp_path / "part2.dat",
                       "-t", "1", "--json", *second)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    result = load(tmp_path / "part2.dat")
    assert result.legacy and result.chunk_count == ref["chunk_count"] == figures["chunks"] == 4
    assert result.datasets == ref["datasets"] and figures["datasets"] == [REF["text"]] * 2
    if SAME_OPTIONS_BUILD:
        assert sha256(tmp_path / "part1.gguf") == OPTIONS_REF["from_chunk"]["first"]
        assert sha256(tmp_path / "part2.dat") == OPTIONS_REF["from_chunk"]["second"]
        assert round(figures["ppl"], 4) == OPTIONS_REF["from_chunk"]["ppl"]
    else:
        for name, value in OPTIONS_REF["from_chunk"]["second_sums"].items():
            assert float(result.entries[name].sum2.astype(np.float64).sum()) == pytest.approx(value, rel=1e-3)


def test_from_chunk_past_the_text_is_refused():
    """llama-imatrix's rule: two chunks and a token must remain after the first N."""
    n_chunk = len(loaded_model("smollm2").tokenizer.tokenize(TEXT)) // 128
    with pytest.raises(MinillmError, match=f"starting from chunk {n_chunk - 1} of 128 tokens leaves fewer than two"):
        compute_imatrix(loaded_model("smollm2"), TEXT, "t", 128, 128, first_chunk=n_chunk - 1)


def test_in_file_values_split_as_llama_cpps():
    assert parse_csv_row("a.gguf,b.gguf") == ["a.gguf", "b.gguf"]
    assert parse_csv_row('"x,y.gguf",z""q.dat') == ["x,y.gguf", 'z""q.dat']
    assert parse_csv_row('"say ""hi"".gguf"') == ['say "hi".gguf']
    assert parse_csv_row("") == [""]


@pytest.mark.parametrize("args, status, message", [
    (["--in-file", "absent.gguf"], 1, "error: cannot read absent.gguf: No such file or directory"),
    (["--in-file", "text.gguf"], 1, "error: text.gguf: not an importance matrix (GGUF or legacy .dat)"),
    (["--in-file", "cut.gguf"], 1, "error: cut.gguf: not a valid importance matrix"),
    (["--in-file", "cut.dat", "--show-statistics"], 1, "error: cut.dat: not an importance matrix (GGUF or legacy): "
                                                       "truncated reading entry blk.0.ffn_down.weight's values"),
    (["--in-file", "a.gguf,"], 1, "error: --in-file 'a.gguf,' names a file without a name"),
    (["--show-statistics"], 1, "error: --show-statistics shows the statistics of --in-file FILE"),
    ([], 1, "error: nothing to do: pass MODEL -f TEXT to compute an importance matrix, or --in-file FILE"),
    (["-f", "empty.txt"], 1, "error: nothing to do: pass MODEL -f TEXT"),
    (["-f", "text.gguf"], 1, "error: computing an importance matrix needs MODEL"),
    (["--in-file", "a.gguf", "-o", "."], 1, "error: . is a directory"),
    (["--in-file", "a.gguf", "-ofreq", "-1"], 2, "error: invalid value for '-ofreq' / '--output-frequency': -1 is"),
    (["--in-file", "a.gguf", "-ofreq", "0"], 2, "error: invalid value for '-ofreq' / '--output-frequency': 0 is"),
    (["--in-file", "a.gguf", "--save-frequency", "-2"], 2, "error: invalid value for '--save-frequency': -2"),
    (["--in-file", "a.gguf", "--chunk", "-1"], 2, "error: invalid value for '--chunk' / '--from-chunk': -1"),
    (["--in-file", "a.gguf", "--from-chunk", "two"], 2, "error: invalid value for '--chunk' / '--from-chunk': 'two'"),
    (["--in-file", "a.gguf", "--output-format", "xml"], 2, "error: invalid value for '--output-format': 'xml'"),
    (["--in-file", "a.gguf", "--outfile", "x"], 2, "error: no such option: --outfile"),
])
def test_bad_input_ends_in_one_error_line(args, status, message, inputs, tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes((inputs / name).read_bytes())
    (tmp_path / "text.gguf").write_text("not an importance matrix\n")
    (tmp_path / "cut.gguf").write_bytes((inputs / "a.gguf").read_bytes()[:5000])
    (tmp_path / "cut.dat").write_bytes((inputs / "c.dat").read_bytes()[:10000])
    (tmp_path / "empty.txt").write_text("\n")
    done = imatrix_cli(*args, cwd=tmp_path)
    assert done.returncode == status and done.stdout == ""
    assert done.stderr.startswith(message) and done.stderr.count("\n") == 1, done.stderr
