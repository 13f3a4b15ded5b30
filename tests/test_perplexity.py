"""Perplexity with llama.cpp's protocol, against llama-perplexity's figures (tests/data)."""
import json
import subprocess
import sys

import pytest

from conftest import DATA, REPORT, loaded_model, model_path
from minillm.quality.perplexity import perplexity

REFERENCE = json.loads((DATA / "ppl_reference.json").read_text())
TEXT = (DATA / "ppl_text_dev.txt").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_perplexity_within_one_percent_of_llama_cpp(model):
    result = perplexity(loaded_model(model), TEXT, n_ctx=512)
    expected = REFERENCE[model]
    REPORT.append(f"{model}: perplexity {result.ppl:.4f} (llama.cpp {expected}), {result.n_chunks} chunks")
    assert result.n_chunks == 14 and result.n_scored == 14 * 255
    assert abs(result.ppl - expected) / expected < 0.01


@pytest.mark.slow
def test_perplexity_cli_prints_ppl(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT[:6000])
    out = subprocess.run([sys.executable, "-m", "minillm", "perplexity", str(model_path("smollm2")), "-f", str(text),
                          "-c", "128"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("PPL = ") and float(out.stdout.split("=")[1]) > 1
