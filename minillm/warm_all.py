"""Every architecture's CPU kernels compiled ahead (`minillm warm --all`, run by `make install`):
the attention over F16 caches, every quantized product, and each compiled layer function with
the operations it calls, on tiny synthetic models (synthetic.py). A first `generate` afterwards
loads them from Numba's cache: seconds instead of a minute. The float products (F16, BF16,
F32 weights) and the quantized caches' attention still compile when a model first uses them.

The work is cut in tasks run in parallel processes, one a core, so that each function is
compiled by one process only: a layer's task compiles its layer first, by its arguments'
types, then waits for the products and attention its first pass needs, which the other tasks
compile (weights.ProductsElsewhere(siblings=True)).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# one synthetic model per compiled layer function (arch modules' layer_function): every
# architecture runs one of these; name -> SyntheticModel's arguments
LAYER_MODELS = {
    "llama": dict(arch="llama", fmt="Q4_1"),  # llama, qwen2, qwen3, granite, phi3
    "gemma": dict(arch="gemma3", fmt="Q4_K", formats={"ffn_down": "Q6_K"}),  # gemma2, gemma3
    "qwen35": dict(arch="qwen35", fmt="Q4_K", n_layer=4, rope_dims=16,  # gated delta nets beside attention
                   keys={"rope.dimension_sections": [3, 3, 2, 0]}),
    "lfm2": dict(arch="lfm2", fmt="Q4_K", n_layer=4, formats={"ffn_down": "Q6_K"}),  # short convolutions beside attention
    "granitehybrid": dict(arch="granitehybrid", fmt="Q4_K", n_layer=3, formats={"ffn_down": "Q6_K"}),  # Mamba2 beside attention
    "mistral3": dict(arch="mistral3", fmt="Q4_K", keys={"attention.temperature_scale": 0.1}),  # q scaled by position
    "qwen3moe": dict(arch="qwen3moe", fmt="Q4_K", formats={"ffn_down_exps": "Q6_K"}),  # a mixture of experts
}
# task -> the tasks it waits for, in the order they start. On two cores: attention beside the
# lanes products; the llama layer (with the operations and wrappers every layer shares) beside
# the K-quant products; then the other layers, each after those whose kernels it shares (so
# that no two processes compile the same function): LFM2's and Granite 4.0-H's convolution is
# Qwen3.5's, Granite 4.0-H's experts Qwen3 MoE's.
TASKS = {"attention": (), "lanes products": (), "llama": (), "k-quant products": (), "qwen35": ("llama",),
         "gemma": ("llama",), "qwen3moe": ("llama",), "mistral3": ("llama",), "lfm2": ("qwen35",),
         "granitehybrid": ("qwen35", "qwen3moe")}


# what `make install` compiles (warm --all --common): the kernels of the architectures most
# models people run have; the others' compile on a model's first use (or with warm --all)
CORE_TASKS = ("attention", "lanes products", "llama", "k-quant products", "qwen35", "gemma")


def run_task(name: str) -> None:
    """Compile (or load) one task's functions, in this process."""
    import numpy as np

    if name == "attention":
        from .kernels.cpu.attention_fns import attention_fn

        attention_fn(np.uint16)
        return
    if name.endswith("products"):
        from .kernels.cpu import matmul as mm
        from .weights import compile_products

        lanes = {mm.PRODUCT_LANES, mm.PRODUCT_LANES_BLOCKS}
        compile_products(lanes if name == "lanes products" else set(mm.PRODUCT_IDS.values()) - lanes, {None})
        return
    from .model import Model
    from .synthetic import SyntheticModel

    with tempfile.TemporaryDirectory() as folder:
        path = SyntheticModel(**LAYER_MODELS[name], vocab=True).build().write(Path(folder) / f"{name}.gguf")
        Model(path, threads=None, device="cpu").warm_up()


def warm_all(log, tasks=tuple(TASKS)) -> float:
    """Run these tasks (every one by default), as many at once as there are cores, each in a
    process of its own, a task once those it waits for are done (those outside `tasks` count as
    done); log(line) as each ends. Seconds taken. A task that fails is logged and the others go
    on (what it did not compile compiles on first use)."""
    start = time.perf_counter()
    slots = max(1, os.cpu_count() or 1)
    waiting, running, done = [t for t in TASKS if t in tasks], {}, set(TASKS) - set(tasks)
    while waiting or running:
        ready = [t for t in waiting if set(TASKS[t]) <= done]
        while ready and len(running) < slots:
            task = ready.pop(0)
            waiting.remove(task)
            errors = tempfile.TemporaryFile()
            running[task] = (_spawn(task, errors), time.perf_counter(), errors)
        finished = _wait_any(running)
        proc, began, errors = running.pop(finished)
        done.add(finished)
        errors.seek(0)
        last = (errors.read().decode(errors="replace").strip().splitlines() or ["?"])[-1]
        errors.close()
        if proc.returncode == 0:
            log(f"  {finished}: compiled in {time.perf_counter() - began:.0f} s")
        else:
            log(f"  {finished}: failed ({last}); it compiles on first use instead")
    return time.perf_counter() - start


def _spawn(task: str, errors) -> subprocess.Popen:
    code = "import sys; from minillm.warm_all import run_task; run_task(sys.argv[1])"
    # a layer's products and attention: compiled by the other tasks, not by a process of its own
    env = dict(os.environ, MINILLM_COMPILE_ELSEWHERE="siblings")
    return subprocess.Popen([sys.executable, "-c", code, task], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=errors, env=env)


def _wait_any(running: dict) -> str:
    while True:
        for task, (proc, _, _) in running.items():
            if proc.poll() is not None:
                return task
        time.sleep(0.05)

