"""The checks that need a real NVIDIA GPU, in one run of a few minutes (make gpu-check):

    python -m minillm.cli.gpu_check --out gpu-check.json

  golden  both real models teacher-forced on llama.cpp's greedy runs (tests/data/greedy_*) on
          CUDA: agreement and mean |logit diff| over llama.cpp's top-10, as
          tests/test_golden_forward.py measures them on the CPU; then the same logits from the
          CPU (its kernels compiled meanwhile by another process), compared with CUDA's
  bench   prefill (pp512) and decode (tg128) speed of both models on CUDA and on the CPU, and
          the device memory the weights take against the file's tensor bytes
  large   Llama-shaped models of random Q4_0 weights written on the machine (1B and 7B shapes:
          no upload), their speed on CUDA (and the 1B's on the CPU) and device memory; on the
          1B, decode steps replayed each way (a CUDA graph, prepared launches, direct, none):
          the same logits from each, and each one's time a step
  mma     quantized products on the tensor cores (MINILLM_CUDA_MMA) and off: pp512 and the
          scheduler's S_TG at 32 sequences each way, and whether the logits are the same
          (SmolLM2 and the 7B shape)
  batched the batching scheduler on CUDA (SmolLM2 and the 7B shape): aggregate prefill and
          decode (S_PP, S_TG) at 1, 8, 32 and 64 sequences, as `minillm bench --parallel`, and
          batch invariance: a request's tokens and logprobs alone and among 2, 7 and 16
  tests   the CUDA tests on the GPU (MINILLM_CUDA_REAL=1 pytest -m cuda): every kernel against
          the CPU kernels and compiled to PTX, the CUDA backend against the CPU path

The stages run in the order of what a GPU's few minutes are most wanted for: the real models'
golden agreement and speed, the large shapes' speed (and the replay modes), the batched and
tensor-core stages, and the CUDA tests last, in the time left (their kernels are checked
under the simulator in every CI run). Writes every result as JSON to --out (after each stage,
so a cut-short run keeps what it measured). Exits 1 when there is no GPU (with the reason),
when a test fails or when an agreement falls below the CPU test's floor. Run from a checkout;
the real models are checked where `make models` (or `make gpu-parts`' pieces, joined) put
them, after their sha256, and skipped (said so) where they are missing or differ.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]  # the checkout: minillm/cli/gpu_check.py
DATA = ROOT / "tests" / "data"
MODELS = {
    "smollm2": ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": ROOT / "models" / "gemma-3-270m-q4_k_m.gguf",
}
# Llama shapes for random-weight models written on the machine (write_synthetic)
SYNTHETIC_SHAPES = {
    "7b": dict(n_embd=4096, n_layer=32, n_ff=11008, n_head=32, n_head_kv=32, n_vocab=32000),
    "1b": dict(n_embd=2048, n_layer=16, n_ff=8192, n_head=32, n_head_kv=8, n_vocab=32000),
    "tiny": dict(n_embd=256, n_layer=2, n_ff=512, n_head=4, n_head_kv=2, n_vocab=512),
}
MIN_AGREEMENT = 0.94    # tests/test_golden_forward.py's floor on the CPU
MEASURE_UNTIL_S = 330   # no measuring stage starts after this
BUDGET_S = 440          # the CUDA tests (last) end by then: the whole run stays under 8 minutes
TESTS_TIMEOUT_S = 240
TESTS_MIN_S = 30        # less time left than this: the tests are skipped (said so)


class NoGPU(Exception):
    pass


def gpu_facts() -> dict:
    """The GPU numba.cuda sees; raises NoGPU (with the reason) when there is none."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") not in (None, "", "0"):
        raise NoGPU("NUMBA_ENABLE_CUDASIM is set: this check needs a real GPU, not the simulator")
    if importlib.util.find_spec("numba_cuda") is None:  # NVIDIA's CUDA target: the `cuda` extra
        raise NoGPU("numba-cuda is not installed: pip install -e '.[cuda]'")
    from numba import cuda

    if not cuda.is_available():
        raise NoGPU("numba.cuda finds no usable CUDA GPU (no NVIDIA driver or device)")
    device = cuda.get_current_device()
    name = device.name.decode() if isinstance(device.name, bytes) else str(device.name)
    free, total = cuda.current_context().get_memory_info()
    return {"name": name, "compute_capability": list(device.compute_capability),
            "memory_gib": round(total / 2**30, 1), "free_gib": round(free / 2**30, 1)}


# ---- stages ------------------------------------------------------------------------------

def run_tests(timeout: float) -> dict:
    """pytest -m cuda on the two CUDA test files, on the GPU; counts and failing tests."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
               f"--junitxml={report}", "tests/test_cuda_kernels.py", "tests/test_cuda_model.py"]
        env = dict(os.environ, MINILLM_CUDA_REAL="1")
        env.pop("NUMBA_ENABLE_CUDASIM", None)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:  # what ran so far, from pytest's progress lines
            output = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
            return {"ok": False, "error": f"timed out after {timeout:.0f} s", **_progress_counts(output),
                    "output_tail": output[-4000:]}
        result = {"returncode": proc.returncode, "seconds": round(time.perf_counter() - t0, 1)}
        if report.exists():
            result.update(_junit_summary(report))
        result["ok"] = proc.returncode == 0
        if not result["ok"]:
            result["output_tail"] = (proc.stdout + proc.stderr)[-4000:]
        return result


def _progress_counts(output: str) -> dict:
    """Tests passed and failed so far, from pytest -q's progress lines ("..F.s  [ 12%]")."""
    marks = "".join(line.split("[")[0].strip() for line in output.splitlines()
                    if re.fullmatch(r"[.FEsxX]+\s*(\[\s*\d+%\])?", line.strip()))
    return {"passed_so_far": marks.count("."), "failed_so_far": marks.count("F") + marks.count("E")}


def _junit_summary(path: Path) -> dict:
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return {**counts, "failed": failed}


def load(path: Path, device: str):
    from ..model import Model

    model = Model(path, device=device)
    model.warm_up()
    return model


def load_measured(path: Path, device: str) -> tuple:
    """(model, its facts): load and warm-up seconds and, on CUDA, whether the kernels were in
    numba-cuda's on-disk cache and the device memory it took against the file's tensor bytes
    (the weights and the warm-up's small caches)."""
    from ..gguf_file import GGUFFile

    free_before = _free_device_bytes() if device == "cuda" else 0
    facts = {}
    if device == "cuda":  # on-disk kernel cache: loaded from it (fast) or compiled (first run)
        from ..backends.cuda import CudaBackend

        facts["kernels_cached_before_load"] = CudaBackend.kernels_cached()
    t0 = time.perf_counter()
    model = load(path, device)
    facts[f"{device}_load_and_warm_up_s"] = round(time.perf_counter() - t0, 1)
    if device == "cuda":
        with GGUFFile(path) as g:
            tensor_bytes = sum(t.n_bytes for t in g.tensors.values())
        used = free_before - _free_device_bytes()
        facts.update(device_bytes=used, tensor_bytes=tensor_bytes, device_over_file=round(used / tensor_bytes, 3))
    return model, facts


def _free_device_bytes() -> int:
    from numba import cuda

    return cuda.current_context().get_memory_info()[0]


def write_synthetic(path: Path, shape: str) -> Path:
    """A Llama-shaped GGUF (SYNTHETIC_SHAPES) of random Q4_0 weights and float32 norms near 1:
    speed and memory at a real model's size without uploading one."""
    import gguf

    from ..synthetic import write_vocab  # a SentencePiece vocabulary of n_vocab tokens

    s = SYNTHETIC_SHAPES[shape]
    rng = np.random.default_rng(0)
    E, F = s["n_embd"], s["n_ff"]
    kv_dim = s["n_head_kv"] * (E // s["n_head"])
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", s["n_layer"]), ("context_length", 4096), ("embedding_length", E),
                       ("feed_forward_length", F), ("attention.head_count", s["n_head"]),
                       ("attention.head_count_kv", s["n_head_kv"])):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    write_vocab(writer, s["n_vocab"])

    def matrix(name: str, rows: int, cols: int) -> None:  # Q4_0 blocks: a small f16 scale, random codes
        blocks = rows * cols // 32
        raw = rng.integers(0, 256, size=(blocks, 18), dtype=np.uint8)
        scales = (rng.random(blocks, dtype=np.float32) * 0.004 + 0.002).astype(np.float16)
        raw[:, :2] = scales.view(np.uint8).reshape(blocks, 2)
        raw = raw.reshape(rows, -1)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_0)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(E)).astype(np.float32))

    matrix("token_embd.weight", s["n_vocab"], E)
    norm("output_norm.weight")
    matrix("output.weight", s["n_vocab"], E)
    for il in range(s["n_layer"]):
        for name, rows, cols in (("attn_q", E, E), ("attn_k", kv_dim, E), ("attn_v", kv_dim, E),
                                 ("attn_output", E, E), ("ffn_gate", F, E), ("ffn_up", F, E), ("ffn_down", E, F)):
            matrix(f"blk.{il}.{name}.weight", rows, cols)
        norm(f"blk.{il}.attn_norm.weight")
        norm(f"blk.{il}.ffn_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def golden_rows(name: str) -> list[dict]:
    with open(DATA / f"greedy_{name}_dev.jsonl") as f:
        return [json.loads(line) for line in f]


def teacher_forced(row: dict) -> tuple[list[int], int]:
    """A golden row's ids (its prompt and llama.cpp's greedy tokens but the last) and the first
    position whose logits predict one of those tokens."""
    return row["prompt_ids"] + [s["next"] for s in row["steps"]][:-1], len(row["prompt_ids"]) - 1


def golden(name: str, gpu_model, logits_kept: list) -> dict:
    """Teacher-forced agreement with llama.cpp on CUDA; each row's logits appended to logits_kept
    (for compare_with_cpu)."""
    agree = steps = 0
    diffs = []
    t0 = time.perf_counter()
    for row in golden_rows(name):
        ids, start = teacher_forced(row)
        logits = gpu_model.logits(ids, start=start)
        for i, step in enumerate(row["steps"]):
            agree += int(np.argmax(logits[i]) == step["next"])
            diffs.extend(abs(float(logits[i][tok]) - val) for tok, val in step["top"])
        steps += len(row["steps"])
        logits_kept.append(logits)
    rate = agree / steps
    return {"steps": steps, "agreement": round(rate, 4), "mean_abs_logit_diff_top10": round(float(np.mean(diffs)), 4),
            "ok": rate >= MIN_AGREEMENT, "min_agreement": MIN_AGREEMENT, "seconds": round(time.perf_counter() - t0, 1)}


def compare_with_cpu(name: str, gpu_logits: list, cpu_model, deadline: float) -> dict:
    """The CPU's logits for golden's rows (while time is left) against CUDA's: the argmax
    agreement, the mean |difference| and the largest one relative to the largest logit."""
    agree = steps = 0
    diffs, rel = [], []
    for row, logits in zip(golden_rows(name), gpu_logits):
        if time.perf_counter() > deadline:
            break
        ids, start = teacher_forced(row)
        want = cpu_model.logits(ids, start=start)
        agree += int(np.sum(want.argmax(-1) == logits.argmax(-1)))
        steps += len(want)
        diffs.append(float(np.abs(logits - want).mean()))
        rel.append(float(np.abs(logits - want).max() / np.abs(want).max()))
    if not diffs:
        return {"skipped": "out of time" if gpu_logits else "no CUDA logits to compare"}
    return {"rows": len(diffs), "argmax_agreement": round(agree / steps, 4),
            "mean_abs_logit_diff": round(float(np.mean(diffs)), 5), "max_rel_logit_diff": float(f"{max(rel):.3g}")}


def bench(model, n_prompt: int = 512, n_gen: int = 128) -> dict:
    """Prefill and decode tokens/s as `minillm bench` measures them (best of two)."""
    from ..timing import time_decode, time_prefill

    rng = np.random.default_rng(0)
    prefill = min(time_prefill(model, rng, n_prompt) for _ in range(2))
    decode = min(time_decode(model, rng, n_gen) for _ in range(2))
    return {f"pp{n_prompt}_tokens_per_s": round(n_prompt / prefill, 1),
            f"tg{n_gen}_tokens_per_s": round(n_gen / decode, 1)}


BATCH_LEVELS = (1, 8, 32, 64)


def compare_mma(model, n_prompt: int = 512, n_logits: int = 16, n_seq: int = 32, seq_tokens: int = 32) -> dict:
    """The quantized products on the tensor cores and off: prefill tokens/s (pp, best of two),
    the scheduler's aggregate decode at n_seq sequences of seq_tokens prompt tokens and
    seq_tokens generated (S_TG: its rows' products), and whether a prompt of n_logits tokens
    gets the same logits (it should: the MMA's integer sums are exact and the float terms are
    added in the same order); ok within 1e-3 of the largest logit."""
    from ..kernels.cuda import matmul
    from .bench import _parallel_run
    from ..timing import time_prefill

    ids = np.random.default_rng(2).integers(0, model.n_vocab, size=n_logits)
    result, logits = {}, {}
    saved = matmul.MMA
    try:
        for name, on in (("tiled", False), ("mma", True)):
            matmul.MMA = on
            rng = np.random.default_rng(0)
            result[f"{name}_pp{n_prompt}_tokens_per_s"] = round(
                n_prompt / min(time_prefill(model, rng, n_prompt) for _ in range(2)), 1)
            # (the prefill step compiles the rows' kernels: S_PP would count it, S_TG does not)
            _, t_tg = _parallel_run(model, rng, n_seq, seq_tokens, seq_tokens)
            result[f"{name}_s_tg{n_seq}_tokens_per_s"] = round(n_seq * seq_tokens / t_tg, 1)
            logits[name] = model.logits(ids)
    finally:
        matmul.MMA = saved
    result["same_logits"] = bool(np.array_equal(logits["tiled"], logits["mma"]))
    result["max_abs_diff"] = float(np.abs(logits["tiled"] - logits["mma"]).max())
    # equal unless the GPU compiler contracted the two kernels' float terms into FMAs differently
    result["ok"] = result["max_abs_diff"] <= 1e-3 * float(np.abs(logits["tiled"]).max())
    return result


def batched(model, levels=BATCH_LEVELS, n_prompt: int = 32, n_gen: int = 32) -> dict:
    """The scheduler's aggregate speed at each level (S_PP, S_TG as llama-batched-bench) and
    its batch invariance (batch_invariance)."""
    from .bench import _parallel_run

    rng = np.random.default_rng(0)
    result = {"n_prompt": n_prompt, "n_gen": n_gen, "levels": []}
    for n_seq in levels:
        t_pp, t_tg = _parallel_run(model, rng, n_seq, n_prompt, n_gen)
        result["levels"].append({"parallel": n_seq, "s_pp": round(n_seq * n_prompt / t_pp, 1),
                                 "s_tg": round(n_seq * n_gen / t_tg, 1)})
    result["batch_invariant"] = batch_invariance(model)
    result["ok"] = result["batch_invariant"]
    return result


def batch_invariance(model, sizes=(2, 7, 16), max_tokens: int = 16, prompt_tokens: int = 8, n_ctx: int = 64,
                     parallel: int = 8) -> bool:
    """Whether a request (sampled, with logprobs) gets the same tokens and logprobs alone and in
    batches of each size (of requests with prompts of prompt_tokens + 0, 1, 2 tokens, on at most
    `parallel` slots: the rest join later)."""
    from ..sampling import SamplingParams
    from ..serving.scheduler import Request

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model.n_vocab, size=prompt_tokens + i % 3).tolist() for i in range(max(sizes))]

    def first_request(n: int) -> list:
        scheduler = model.scheduler(parallel=min(n, parallel), n_ctx=n_ctx)
        handles = [scheduler.submit(Request(p, max_tokens, SamplingParams(temperature=0.8, seed=i), ignore_eos=True,
                                            logprobs=2)) for i, p in enumerate(prompts[:n])]
        return [(c.token, c.logprobs) for c in handles[0] if c.token is not None]

    alone = first_request(1)
    return len(alone) == max_tokens and all(first_request(n) == alone for n in sizes)


def compare_replay_modes(model, n_steps: int = 32, n_prompt: int = 8) -> dict:
    """Greedy-free decode steps (fixed tokens) under each way of replaying a step
    (kernels/cuda/launch.py), and with no replay: each mode's ms a step and its logits against
    the layer code's (the same kernels in the same order: bit for bit)."""
    from ..backends import cuda as cuda_backend

    backend = model.backend
    ids = np.random.default_rng(1).integers(0, model.n_vocab, n_prompt + n_steps)
    saved, results, reference = cuda_backend.REPLAY, {}, None
    try:
        for mode in ("off", "direct", "prepared", "graph"):
            cuda_backend.REPLAY = mode
            cache = backend.new_cache(n_prompt + n_steps)
            backend.forward(ids[:n_prompt], cache, n_prompt - 1)
            steps = [backend.forward(ids[n_prompt:n_prompt + 1], cache, 0)]  # recorded (not timed)
            t0 = time.perf_counter()
            steps += [backend.forward(ids[i:i + 1], cache, 0) for i in range(n_prompt + 1, n_prompt + n_steps)]
            entry = {"ms_per_step": round((time.perf_counter() - t0) * 1000 / max(1, n_steps - 1), 3)}
            plan = cache.step_plan
            if plan is not None:
                entry.update(used=plan.replay.mode, launches_per_step=len(plan.replay.launches))
                if plan.replay.fallback:
                    entry["fallback"] = plan.replay.fallback
            logits = np.concatenate(steps)
            if reference is None:
                reference = logits
            else:
                entry["max_abs_diff_vs_off"] = float(np.abs(logits - reference).max())
                entry["ok"] = entry["max_abs_diff_vs_off"] == 0.0
            results[mode] = entry
    finally:
        cuda_backend.REPLAY = saved
    results["ok"] = all(entry.get("ok", True) for entry in results.values())
    return results


# ---- driver --------------------------------------------------------------------------------

class Report:
    """The results so far, rewritten to the output file after every stage."""

    def __init__(self, path: Path):
        self.path, self.data, self.t0 = path, {"ok": True}, time.perf_counter()

    def add(self, key: str, value) -> None:
        self.data[key] = value
        if isinstance(value, dict) and value.get("ok") is False:
            self.data["ok"] = False
        self.save()

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        self.path.write_text(json.dumps(self.data, indent=2) + "\n")


def _failure(where: str, exc: Exception) -> dict:
    print(f"gpu_check: {where} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback_tail": traceback.format_exc()[-3000:]}


def _stage(report: Report, key: str, entry: dict, name: str, run, *args) -> None:
    """entry[name] = run(*args), entry["ok"] falling with the stage's "ok"; an exception is
    written down as the stage's error (the rest of the run goes on: a GPU's minutes are few)."""
    try:
        entry[name] = run(*args)
    except Exception as exc:  # noqa: BLE001 (any failure of a stage is a result to report)
        entry[name] = _failure(f"{key}.{name}", exc)
    if isinstance(entry[name], dict) and entry[name].get("ok") is False:
        entry["ok"] = False
    report.add(key, entry)


def model_problem(path: Path) -> str | None:
    """Why a real model can't be checked (missing, or not the file its sha256 names), or None."""
    if not path.exists():
        return f"{path} is missing (`make models` fetches it; `make gpu-parts` splits it for an upload)"
    spec = importlib.util.spec_from_file_location("fetch", ROOT / "models" / "fetch.py")
    fetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch)
    expected, got = fetch.MODELS[path.name][1], fetch.sha256(path)
    return None if got == expected else f"{path}: sha256 {got} is not the expected {expected}"


def check_models(report: Report, deadline: float, cpu_warm_up) -> dict:
    """Each real model's golden agreement and speed on CUDA, then on the CPU (once cpu_warm_up,
    the process compiling the CPU kernels meanwhile, is done); returns the CUDA models loaded,
    with their report entries, for the stages that come later."""
    loaded = {}
    for name, path in MODELS.items():
        problem = model_problem(path)
        if problem or time.perf_counter() > deadline:
            report.add(name, {"skipped": problem or "out of time"})
            continue
        try:
            gpu_model, entry = load_measured(path, "cuda")
        except Exception as exc:  # noqa: BLE001
            report.add(name, _failure(f"{name} loading", exc))
            continue
        entry["ok"] = True
        gpu_logits = []
        _stage(report, name, entry, "golden", golden, name, gpu_model, gpu_logits)
        _stage(report, name, entry, "bench_cuda", bench, gpu_model)
        loaded[name] = (gpu_model, entry)
        if time.perf_counter() < deadline:
            entry["cpu_warm_up_wait_s"] = cpu_warm_up.wait_s()
            _stage(report, name, entry, "cpu", run_on_cpu, name, path, gpu_logits, deadline)
    return loaded


def run_on_cpu(name: str, path: Path, gpu_logits: list, deadline: float) -> dict:
    """The model on the CPU: its logits against CUDA's (compare_with_cpu) and its speed."""
    t0 = time.perf_counter()
    model = load(path, "cpu")
    result = {"load_and_warm_up_s": round(time.perf_counter() - t0, 1),
              "vs_cuda": compare_with_cpu(name, gpu_logits, model, deadline)}
    if time.perf_counter() < deadline:
        result["bench"] = bench(model)
    return result


class CpuWarmUp:
    """The CPU path's kernels compiled into Numba's on-disk cache by another process, while this
    one measures the GPU: a cold machine compiles them for a minute or two, and the CPU models
    then load from the cache. The process only warms the cache, so its failure costs time, not
    results (the CPU models compile for themselves)."""

    def __init__(self, paths: list[Path]):
        code = ("import sys\nfrom minillm.cli.gpu_check import load\n"  # as the CPU stage loads, and a batch
                "for path in sys.argv[1:]:\n    load(path, 'cpu').logits(list(range(1, 80)))")
        self.proc = subprocess.Popen([sys.executable, "-c", code, *map(str, paths)], cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if paths else None

    def wait_s(self, timeout: float = 180) -> float:
        """Wait for it (at most timeout seconds, then stop it); the seconds waited."""
        t0 = time.perf_counter()
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.stop()
        return round(time.perf_counter() - t0, 1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def check_batched(report: Report, loaded: dict, deadline: float) -> None:
    """SmolLM2's scheduler on CUDA and its products on the tensor cores (the newest kernels, last)."""
    if "smollm2" not in loaded:
        return
    model, entry = loaded["smollm2"]
    for stage, run in (("batched_cuda", batched), ("mma_cuda", compare_mma)):
        if time.perf_counter() < deadline:
            _stage(report, "smollm2", entry, stage, run, model)


def release_device_memory() -> None:
    """Free the device memory of what is no longer referenced now, not when numba-cuda's deferred
    frees would (up to a fifth of the GPU's memory can wait there), before the next large model
    or the tests' own process. (A device array's free waits in its memory manager's queue; the
    context's own holds streams and events.)"""
    import gc

    from numba import cuda

    gc.collect()
    cuda.current_context().memory_manager.deallocations.clear()


def check_synthetic(report: Report, deadline: float, shapes=("1b", "7b")) -> None:
    """The large shapes, written to a temporary folder one at a time: CUDA speed and memory, and
    the 1B's CPU speed (the 7B's would take minutes)."""
    for shape in shapes:
        key = f"synthetic_{shape}"
        if time.perf_counter() > deadline:
            report.add(key, {"skipped": "out of time"})
            continue
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            path = write_synthetic(Path(tmp) / f"{shape}.gguf", shape)
            entry = {"write_s": round(time.perf_counter() - t0, 1), "file_bytes": path.stat().st_size, "ok": True}
            try:
                model, facts = load_measured(path, "cuda")
            except Exception as exc:  # noqa: BLE001
                report.add(key, {**entry, **_failure(f"{key} loading", exc)})
                continue
            entry.update(facts)
            if shape != "7b":
                _stage(report, key, entry, "replay_modes", compare_replay_modes, model)
            _stage(report, key, entry, "bench_cuda", bench, model, 512, 128 if shape != "7b" else 64)
            if shape == "7b":
                for stage, run in (("batched_cuda", batched), ("mma_cuda", compare_mma)):
                    if time.perf_counter() < deadline:
                        _stage(report, key, entry, stage, run, model)
            del model
            release_device_memory()
            if shape != "7b" and time.perf_counter() < deadline:
                _stage(report, key, entry, "bench_cpu", lambda: bench(load(path, "cpu"), 512, 64))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the results")
    parser.add_argument("--skip-tests", action="store_true", help="no CUDA tests, only the measurements")
    args = parser.parse_args(argv)
    report = Report(args.out)
    t0 = time.perf_counter()
    try:
        report.add("gpu", gpu_facts())
    except NoGPU as exc:
        report.add("gpu", {"ok": False, "error": str(exc)})
        print(f"gpu_check: no GPU to check: {exc}", file=sys.stderr)
        return 1
    print(f"gpu_check: {report.data['gpu']['name']}", file=sys.stderr)
    measure_deadline = t0 + MEASURE_UNTIL_S
    cpu_warm_up = CpuWarmUp([path for path in MODELS.values() if path.exists()])
    try:
        loaded = check_models(report, measure_deadline, cpu_warm_up)
    finally:
        cpu_warm_up.stop()
    check_synthetic(report, measure_deadline)
    check_batched(report, loaded, measure_deadline)
    loaded.clear()
    release_device_memory()
    if not args.skip_tests:
        left = t0 + BUDGET_S - time.perf_counter()
        report.add("tests", run_tests(min(TESTS_TIMEOUT_S, left)) if left >= TESTS_MIN_S
                   else {"skipped": f"out of time ({left:.0f} s left)"})
        print(f"gpu_check: tests {report.data['tests']}", file=sys.stderr)
    report.save()
    print(json.dumps(report.data, indent=2))
    return 0 if report.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
