"""make gpu-check's parts that run without a GPU: the random-weight models it writes on the
machine, and its refusal (exit 1, the reason in its report) where there is no GPU."""
import json

import numpy as np

import minillm
from minillm.cli import gpu_check


def test_a_synthetic_llama_shape_is_a_model_that_runs(tmp_path):
    path = gpu_check.write_synthetic(tmp_path / "tiny.gguf", "tiny")
    model = minillm.load(path)
    shape = gpu_check.SYNTHETIC_SHAPES["tiny"]
    assert (model.hp.n_layer, model.hp.n_embd, model.hp.n_head_kv, model.n_vocab) == (
        shape["n_layer"], shape["n_embd"], shape["n_head_kv"], shape["n_vocab"])
    assert {t.format.name for t in model.gguf.tensors.values()} == {"Q4_0", "F32"}
    logits = model.logits([1, 5, 9])
    assert logits.shape == (3, shape["n_vocab"]) and np.all(np.isfinite(logits)) and logits.std() > 0


def test_without_a_gpu_it_says_why_and_exits_1(tmp_path, capsys):
    out = tmp_path / "gpu-check.json"
    assert gpu_check.main(["--out", str(out)]) == 1  # the tests run the CUDA simulator, not a GPU
    report = json.loads(out.read_text())
    assert report["ok"] is False and "simulator" in report["gpu"]["error"]
    assert "no GPU to check" in capsys.readouterr().err
    assert (gpu_check.DATA / "greedy_smollm2_dev.jsonl").exists()  # it reads the checkout's tests/data


def test_a_failing_stage_is_reported_and_the_run_goes_on(tmp_path, capsys):
    """A stage that raises (a kernel the GPU refuses, say) is written down with its error and
    lowers the verdict; the next stage still runs and the report keeps both."""
    report = gpu_check.Report(tmp_path / "gpu-check.json")
    entry = {"ok": True}

    def refused():
        raise RuntimeError("CUDA_ERROR_ILLEGAL_INSTRUCTION")

    gpu_check._stage(report, "smollm2", entry, "mma_cuda", refused)
    gpu_check._stage(report, "smollm2", entry, "batched_cuda", lambda: {"ok": True, "levels": [1]})
    saved = json.loads((tmp_path / "gpu-check.json").read_text())
    assert saved["ok"] is False and saved["smollm2"]["ok"] is False
    assert saved["smollm2"]["mma_cuda"]["error"] == "RuntimeError: CUDA_ERROR_ILLEGAL_INSTRUCTION"
    assert "refused" in saved["smollm2"]["mma_cuda"]["traceback_tail"]
    assert saved["smollm2"]["batched_cuda"] == {"ok": True, "levels": [1]}
    assert "smollm2.mma_cuda failed" in capsys.readouterr().err


def test_tests_cut_by_the_time_limit_still_say_how_far_they_got(monkeypatch):
    """The tests stage on a GPU may run past its limit (kernels compile on first use): the
    report keeps how many passed and failed before the cut, and the output's tail."""
    import subprocess

    progress = "....F.s...                                     [ 10%]\n..E..\n"

    def run(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], kwargs["timeout"], output=progress.encode())

    monkeypatch.setattr(gpu_check.subprocess, "run", run)
    result = gpu_check.run_tests(timeout=5)
    assert result["ok"] is False and result["error"] == "timed out after 5 s"
    assert (result["passed_so_far"], result["failed_so_far"]) == (12, 2)
    assert result["output_tail"] == progress
