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


def test_a_real_model_is_checked_only_where_it_is_the_file_its_sha256_names(tmp_path):
    """On a machine without network SmolLM2 arrives in pieces (make gpu-parts) joined there: a
    missing or short file is skipped with the reason, never measured."""
    path = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "is missing" in gpu_check.model_problem(path)
    path.write_bytes(gpu_check.MODELS["smollm2"].read_bytes()[:50_000_000])  # one piece of two
    assert "is not the expected b179c952" in gpu_check.model_problem(path)
    assert gpu_check.model_problem(gpu_check.MODELS["smollm2"]) is None  # make models' file


def test_the_measurements_come_first_and_the_tests_get_the_time_left(tmp_path, monkeypatch):
    """A GPU's minutes are few: the real models, then the large shapes, then the batched stages,
    then the CUDA tests until the budget's end; with too little left they are skipped, said so."""
    clock = {"now": 1000.0}
    calls = []

    def stage(name, seconds):
        def run(*args):
            calls.append(name)
            clock["now"] += seconds
            return {} if name == "models" else None
        return run

    monkeypatch.setattr(gpu_check, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock["now"])}))
    monkeypatch.setattr(gpu_check, "gpu_facts", lambda: {"name": "a stand-in GPU"})
    monkeypatch.setattr(gpu_check, "release_device_memory", lambda: None)
    monkeypatch.setattr(gpu_check, "CpuWarmUp", lambda paths: type("NoWarmUp", (), {"stop": lambda self: None})())
    monkeypatch.setattr(gpu_check, "check_models", stage("models", 100))
    monkeypatch.setattr(gpu_check, "check_synthetic", stage("synthetic", 150))
    monkeypatch.setattr(gpu_check, "check_batched", stage("batched", 60))
    monkeypatch.setattr(gpu_check, "run_tests", lambda timeout: calls.append(("tests", timeout)) or {"ok": True})

    out = tmp_path / "gpu-check.json"
    assert gpu_check.main(["--out", str(out)]) == 0
    assert calls == ["models", "synthetic", "batched", ("tests", gpu_check.BUDGET_S - 310)]

    calls.clear()
    monkeypatch.setattr(gpu_check, "check_synthetic", stage("synthetic", gpu_check.BUDGET_S))
    assert gpu_check.main(["--out", str(out)]) == 0
    assert calls == ["models", "synthetic", "batched"]
    assert json.loads(out.read_text())["tests"]["skipped"].startswith("out of time")


def test_the_golden_protocol_and_the_comparison_with_the_cpu_run_on_smollm2():
    """gpu_check's golden stage and its CPU comparison, run here with the CPU path in CUDA's
    place: llama.cpp's agreement as the CPU's golden test finds it, and equal logits compare
    as equal."""
    model = gpu_check.load(gpu_check.MODELS["smollm2"], "cpu")
    kept = []
    result = gpu_check.golden("smollm2", model, kept)
    assert result["ok"] and result["agreement"] >= gpu_check.MIN_AGREEMENT
    assert result["steps"] == sum(len(logits) for logits in kept) == 514
    same = gpu_check.compare_with_cpu("smollm2", kept, model, deadline=gpu_check.time.perf_counter() + 600)
    assert same == {"rows": 12, "argmax_agreement": 1.0, "mean_abs_logit_diff": 0.0, "max_rel_logit_diff": 0.0}
    assert gpu_check.compare_with_cpu("smollm2", kept, model, deadline=0) == {"skipped": "out of time"}
    assert gpu_check.compare_with_cpu("smollm2", [], model, deadline=gpu_check.time.perf_counter() + 600) == {
        "skipped": "no CUDA logits to compare"}  # the golden stage failed


def test_the_cpu_warm_up_process_loads_and_runs_each_model(tmp_path):
    path = gpu_check.write_synthetic(tmp_path / "tiny.gguf", "tiny")
    warm_up = gpu_check.CpuWarmUp([path])
    assert warm_up.wait_s(timeout=600) >= 0 and warm_up.proc.returncode == 0
    assert gpu_check.CpuWarmUp([]).wait_s() == 0


def test_a_device_arrays_free_waits_in_the_queue_release_device_memory_clears(monkeypatch):
    """numba-cuda (without the simulator, no GPU needed) queues a device allocation's free on
    its memory manager's deallocations, the queue release_device_memory clears."""
    import subprocess
    import sys

    from numba import cuda

    from cuda_env import environment_for_ptx_check

    probe = ("from numba.cuda.cudadrv import driver\n"
             "driver.driver = type('Driver', (), {'cuMemFree': 'cuMemFree'})()\n"
             "class Pending(list):\n"
             "    def add_item(self, *item): self.append(item)\n"
             "class Manager:\n"
             "    allocations, deallocations = {'key': 1}, Pending()\n"
             "driver._alloc_finalizer(Manager, 'ptr', 'key', 64)()\n"
             "assert Manager.deallocations == [('cuMemFree', 'ptr', 64)] and not Manager.allocations\n")
    subprocess.run([sys.executable, "-c", probe], env=environment_for_ptx_check(), check=True)

    cleared = []
    queue = type("Pending", (), {"clear": lambda self: cleared.append("device frees")})()
    context = type("Context", (), {"memory_manager": type("Manager", (), {"deallocations": queue})()})()
    monkeypatch.setattr(cuda, "current_context", lambda: context)
    gpu_check.release_device_memory()
    assert cleared == ["device frees"]
