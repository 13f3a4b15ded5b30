"""What compression costs, against llama.cpp: KL-divergence files and statistics (llama-perplexity),
pruned files (llama-quantize --prune-layers), and the --eval / auto-pruning reports built on them.
Reference: tests/data/compression_reference.json (tests/llama_ref/record_compression.py)."""
import hashlib
import json
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import DATA, REPORT, loaded_model, model_path

import minillm
from minillm.kernels.cpu.ops import ggml_build
from minillm.quality.perplexity import kl_divergence, perplexity
from minillm.quantize import quantize

REF = json.loads((DATA / "compression_reference.json").read_text())
TEXT = (DATA / "ppl_text_dev.txt").read_text()
# llama.cpp's logits are those of its build for this CPU; the reference came from one build
HOST_BUILD = ggml_build()
SAME_BUILD = HOST_BUILD in REF["builds"]   # else another build's figures, compared within a tolerance
BUILD_REF = REF["builds"][HOST_BUILD if SAME_BUILD else next(iter(REF["builds"]))]


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "minillm", *map(str, args)], capture_output=True, text=True,
                          input=stdin, timeout=600)


@pytest.fixture(scope="module")
def kld_base(smollm2_f16, tmp_path_factory):
    """(base file of SmolLM2 Q8_0's log-probabilities, its PerplexityResult)."""
    folder = tmp_path_factory.mktemp("kld")
    quantize(smollm2_f16, folder / "q8_0.gguf", "Q8_0")
    result = perplexity(minillm.load(folder / "q8_0.gguf"), TEXT, REF["n_ctx"], n_chunks=REF["n_chunks"],
                        kld_base=folder / "base.kld")
    return folder / "base.kld", result


def test_base_file_is_llama_perplexitys(kld_base):
    path, result = kld_base
    assert round(result.ppl, 4) == pytest.approx(BUILD_REF["kld"]["base_ppl"], abs=0 if SAME_BUILD else 0.05)
    assert result.n_scored == REF["n_chunks"] * (REF["n_ctx"] // 2 - 1)
    if SAME_BUILD:
        assert sha256(path) == BUILD_REF["kld"]["base_sha256"]


def test_kl_divergence_report_equals_llama_perplexitys(kld_base):
    result = kl_divergence(loaded_model("smollm2"), kld_base[0])
    lines = result.report_lines()
    REPORT.append("KLD of SmolLM2 Q4_1 against Q8_0: " + lines[9].split(":", 1)[1].strip())
    if SAME_BUILD:
        assert lines == BUILD_REF["kld"]["report"]
    else:   # another ggml build rounds the logits differently: the figures agree, not the digits
        ref = dict(line.split(":", 1) for line in BUILD_REF["kld"]["report"] if ":" in line)
        assert len(lines) == len(BUILD_REF["kld"]["report"])
        for line in lines:
            if ":" in line and "Δp" not in line:
                key, value = line.split(":", 1)
                assert float(value.split()[0].rstrip("%")) == pytest.approx(
                    float(ref[key].split()[0].rstrip("%")), rel=0.05, abs=2e-5), key
    figures = result.figures()
    assert figures["n_scored"] == REF["n_chunks"] * (REF["n_ctx"] // 2 - 1)
    assert 0 < figures["kld"] < figures["kld_quantiles"]["99.0%"] and 0.9 < figures["same_top"] < 1


def test_a_model_against_its_own_base_file(kld_base, tmp_path):
    """The base file's 16-bit log-probabilities cost almost nothing: KLD ~0, the same top token."""
    figures = kl_divergence(minillm.load(kld_base[0].parent / "q8_0.gguf"), kld_base[0]).figures()
    assert figures["kld"] < 1e-5 and figures["same_top"] == 1.0
    assert figures["ppl"] == pytest.approx(kld_base[1].ppl, rel=1e-6)


def test_pruned_file_is_llama_quantizes(smollm2_f16, tmp_path):
    out = tmp_path / "pruned.gguf"
    quantize(smollm2_f16, out, BUILD_REF["prune"]["type"], prune_layers=[21, 20])
    assert sha256(out) == BUILD_REF["prune"]["sha256"]
    m = minillm.load(out)
    assert m.arch.hp.n_layer == 28
    ppl = perplexity(m, TEXT, REF["n_ctx"], n_chunks=REF["n_chunks"]).ppl
    REPORT.append(f"SmolLM2 Q4_K_M without layers 20,21: PPL {ppl:.4f} (llama.cpp {BUILD_REF['prune']['ppl']}), -c 128")
    assert round(ppl, 4) == pytest.approx(BUILD_REF["prune"]["ppl"], abs=0 if SAME_BUILD else 0.2)


def test_a_skipped_layer_computes_as_the_pruned_file(smollm2_f16, tmp_path):
    """Layer importance leaves a layer out of the forward; for a Llama that is the pruned file."""
    out = tmp_path / "pruned.gguf"
    quantize(smollm2_f16, out, "F16", prune_layers=[3, 17])
    ids = loaded_model("smollm2").tokenize("The quick brown fox jumps over the lazy dog because")
    whole = minillm.load(smollm2_f16)
    whole.backend.skipped_layers = frozenset((3, 17))
    assert np.array_equal(whole.logits(ids), minillm.load(out).logits(ids))


def test_prune_refusals(smollm2_f16, tmp_path):
    for layers, message in (([30], "layers 0-29; no layer 30"), (list(range(30)), "remove all 30")):
        with pytest.raises(minillm.MinillmError, match=message):
            quantize(smollm2_f16, tmp_path / "x.gguf", "Q8_0", prune_layers=layers)
    assert not (tmp_path / "x.gguf").exists()


def test_cli_kl_divergence_and_errors(kld_base, tmp_path):
    base = kld_base[0]
    out = cli("perplexity", model_path("smollm2"), "--kl-divergence-base", base, "--kl-divergence", "--json")
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    assert figures["kld"] == pytest.approx(kl_divergence(loaded_model("smollm2"), base).figures()["kld"])
    text = cli("perplexity", model_path("smollm2"), "--kl-divergence-base", base, "--kl-divergence")
    assert text.stdout.splitlines()[0] == "====== Perplexity statistics ======"
    (tmp_path / "short.kld").write_bytes(base.read_bytes()[:100000])
    for args, message in (
            (["--kl-divergence"], "needs --kl-divergence-base"),
            (["--kl-divergence-base", DATA / "ppl_text_dev.txt", "--kl-divergence"], "does not look like"),
            (["--kl-divergence-base", tmp_path / "short.kld", "--kl-divergence"], "truncated or damaged"),
            ([], "pass -f FILE")):
        out = cli("perplexity", model_path("smollm2"), *args)
        assert out.returncode == 1 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
    out = cli("perplexity", model_path("gemma3"), "--kl-divergence-base", base, "--kl-divergence")
    assert out.returncode == 1 and "vocabulary of 49152 tokens, the model 262144" in out.stderr


@pytest.fixture(scope="module")
def small_f16(tmp_path_factory):
    """A 4-layer Llama with a byte vocabulary, F16: the --eval and auto:N mechanics, quickly."""
    from synthetic import SyntheticModel

    path = tmp_path_factory.mktemp("small") / "small.gguf"
    return SyntheticModel("llama", "F16", n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512,
                          vocab=True, seed=7).build().write(path)


def test_cli_eval_table_and_auto_prune(small_f16, tmp_path):
    """Two types compared with --eval, then auto-pruning measured on a calibration text."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT[:3000])
    out = cli("quantize", small_f16, tmp_path / "types", "Q8_0,Q4_K_M", "--eval", text, "--eval-ctx", "128",
              "--json")
    assert out.returncode == 0, out.stderr
    table = json.loads(out.stdout)
    q8, q4 = table["files"]
    assert [q8["name"], q4["name"]] == ["small-Q8_0.gguf", "small-Q4_K_M.gguf"]
    assert table["source"]["kld"] is None and 0 < q8["kld"] < q4["kld"]
    assert q4["file_bytes"] < q8["file_bytes"] < table["source"]["file_bytes"]
    assert all(r["tg_tokens_per_s"] > 0 and 0 < r["same_top"] <= 1 for r in (q8, q4))
    assert (tmp_path / "types" / "small-Q4_K_M.gguf").exists()

    out = cli("quantize", small_f16, tmp_path / "auto.gguf", "Q8_0", "--prune-layers", "auto:2",
              "--calibration", text, "--eval-ctx", "128")
    assert out.returncode == 0, out.stderr
    costs = [line.split() for line in out.stderr.splitlines() if re.match(r"\s*\d+ +[\d.]+ +[\d.]+% ", line)]
    assert sorted(int(c[0]) for c in costs) == [0, 1, 2, 3]
    chosen = sorted(int(c[0]) for c in costs if c[-1] == "pruned")
    assert [c[-1] == "pruned" for c in costs] == [True, True, False, False]   # the cheapest first
    assert f"pruning layers {chosen[0]},{chosen[1]}" in out.stderr
    assert minillm.load(tmp_path / "auto.gguf").arch.hp.n_layer == 2


@pytest.mark.parametrize("args, message", [
    (["Q8_0,Q4_K_M"], "several types need --eval"),
    (["Q8_0", "--prune-layers", "2,x"], "bad --prune-layers"),
    (["Q8_0", "--prune-layers", "auto:2"], "pass --calibration TEXT or --eval TEXT"),
    (["Q8_0", "--prune-layers", "auto:z"], "expected auto:N"),
])
def test_cli_quantize_compression_errors(tiny_llama, tmp_path, args, message):
    out = cli("quantize", tiny_llama, tmp_path / "out", *args)
    assert out.returncode == 1 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "out").exists()
