"""The CLI as users and scripts meet it: clean errors, stable JSON."""
import json
import os
import subprocess
import sys

import pytest

from conftest import model_path


def run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, timeout=300, **kw)


def test_help_is_fast_and_does_not_compile():
    out = run("--help")
    assert out.returncode == 0 and "info" in out.stdout and "bench" in out.stdout
    probe = subprocess.run([sys.executable, "-c", "import sys, minillm.cli.app; print('numba' in sys.modules)"],
                           capture_output=True, text=True)
    assert probe.stdout.strip() == "False"


@pytest.mark.parametrize("make_bad", [
    lambda p: p,                                              # a directory
    lambda p: p / "missing.gguf",                             # a missing path
    lambda p: (p / "t.txt").write_text("plain text " * 10) or p / "t.txt",
    lambda p: (p / "b.gguf").write_bytes(b"GGUF" + b"\xff" * 40) or p / "b.gguf",
])
def test_info_bad_input_clean_error(tmp_path, make_bad):
    out = run("info", str(make_bad(tmp_path)))
    assert out.returncode == 1
    assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr
    assert out.stdout == ""


def test_bad_flag_is_a_usage_error(tiny_llama):
    out = run("bench", str(tiny_llama), "-p", "many")
    assert out.returncode == 2 and "Traceback" not in out.stderr


def test_engine_errors_name_parameters_and_the_cli_names_flags(tiny_llama):
    """The engine's messages name the library's parameters; the CLI prints its flags instead,
    but leaves the same words alone inside a path or a quoted value."""
    from minillm.cli.common import error_message
    from minillm.errors import MinillmError
    from minillm.speculative import SpeculationParams, check_params

    with pytest.raises(MinillmError) as refused:
        check_params(SpeculationParams(draft_max=2, draft_min=5))
    assert str(refused.value).startswith("draft_min 5 and draft_max 2: need 0 <= draft_min <= draft_max")
    assert error_message(refused.value).startswith("--draft-min 5 and --draft-max 2: need 0 <= --draft-min <= ")
    base = MinillmError("kld_base.bin: not a base file (write one with kld_base FILE)", ("kld_base",))
    assert error_message(base) == "kld_base.bin: not a base file (write one with --kl-divergence-base FILE)"
    out = run("generate", str(tiny_llama), "-p", "x", "-ctk", "q5_0", "-ctv", "q5_0")
    assert out.returncode == 1 and out.stderr == "error: --cache-type-k q5_0: expected one of f16, q8_0, q4_0\n"


def test_every_parameter_an_engine_message_names_has_a_flag():
    """MinillmError(message, params) in the engine: the CLI knows a flag for each param written
    out (kv_cache's, chosen in a loop, are checked through the CLI above)."""
    import ast
    from pathlib import Path

    import minillm
    from minillm.cli.common import FLAGS

    named = set()
    for path in Path(minillm.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and len(node.args) == 2 and isinstance(node.args[1], ast.Tuple):
                if getattr(node.func, "id", None) == "MinillmError":
                    named |= {e.value for e in node.args[1].elts if isinstance(e, ast.Constant)}
    assert named and named <= set(FLAGS), named - set(FLAGS)


def test_info_json(tiny_llama):
    out = run("info", str(tiny_llama), "--json")
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout)
    assert facts["architecture"] == "llama" and facts["n_layer"] == 1 and facts["n_vocab"] == 40
    assert facts["tensor_types"] == {"Q8_0": 8, "F32": 3}


@pytest.mark.slow
def test_info_real_model_human_readable():
    out = run("info", str(model_path("gemma3")), env={**os.environ, "COLUMNS": "40"})  # piped: nothing cut
    assert out.returncode == 0, out.stderr
    for text in ("gemma3", "262144", "Q4_K", "32768"):
        assert text in out.stdout
    lines = out.stdout.splitlines()
    assert "needs            per-head q/k norms; sliding window of 512 on 15 of 18 layers" in lines
    assert f"file             {model_path('gemma3')}" in lines


@pytest.mark.slow
def test_bench_json_on_real_model():
    out = run("bench", str(model_path("smollm2")), "-p", "32", "-n", "8", "--json")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1  # stdout carries only the JSON object
    result = json.loads(lines[0])
    for key in ("pp_tokens_per_s", "tg_tokens_per_s", "load_s"):
        assert result[key] > 0


@pytest.mark.slow
def test_bench_parallel_levels_in_turn():
    """--parallel with -r: each level runs r times, the levels in turn, and reports the median."""
    out = run("bench", str(model_path("smollm2")), "--parallel", "1,2", "-p", "8", "-n", "4", "-r", "3", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["reps"] == 3 and [level["parallel"] for level in result["levels"]] == [1, 2]
    for level in result["levels"]:
        runs = level["s_tg_runs"]
        assert len(runs) == 3 and all(s > 0 for s in runs)
        assert level["s_tg"] == pytest.approx(sorted(runs)[1], rel=0.01)  # the median's rate
        assert level["s_pp"] > 0
    assert result["admission"]["admission_steps"] > 0
    out = run("bench", str(model_path("smollm2")), "--parallel", "1,x")
    assert out.returncode == 2 and "--parallel takes counts" in out.stderr


def test_device_option(tiny_llama):
    out = run("bench", str(tiny_llama), "-p", "4", "-n", "2", "--device", "gpu0")
    assert out.returncode == 1 and "unknown device 'gpu0'" in out.stderr
    out = run("bench", str(tiny_llama), "-p", "4", "-n", "2", "--device", "auto", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["device"] == "cpu"  # no GPU here (or only the simulator)


def test_first_run_knows_it_compiles(tiny_llama, tmp_path):
    """The "Compiling ..." notice shows when Numba's cache (NUMBA_CACHE_DIR included) lacks the
    layer function, and not once the kernels are cached (the project's cache, which the rest of
    the suite fills: a second full compile into an empty cache would cost a minute)."""
    import os

    def kernels_cached(warm_up: str, **env):
        probe = f"import sys, minillm; m = minillm.load(sys.argv[1]); {warm_up}; print(m.backend.kernels_cached())"
        out = subprocess.run([sys.executable, "-c", probe, str(tiny_llama)], capture_output=True, text=True,
                             timeout=600, env=dict(os.environ, **env))
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert kernels_cached("pass", NUMBA_CACHE_DIR=str(tmp_path / "numba-cache")) == "False"
    assert kernels_cached("m.warm_up()") == "True"


def test_warm_compiles_ahead_and_loads_only_the_models_own_products(tiny_llama):
    """`minillm warm MODEL` readies a model's kernels (one line on stderr, nothing on stdout);
    a model loads the product kernels of its own formats only (Q8_0: the 32-block lanes')."""
    out = run("warm", str(tiny_llama))
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and "ready: tiny.gguf (llama, KV cache f16/f16)" in out.stderr
    probe = ("import sys, minillm; from minillm.kernels.cpu import quant_products as q; minillm.load(sys.argv[1]); "
             "print(sorted(source.__name__ for source in q._compiled))")
    loaded = subprocess.run([sys.executable, "-c", probe, str(tiny_llama)], capture_output=True, text=True, timeout=600)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == ["['_lanes',", "'_lanes3']"]


def test_warm_all_leaves_every_architectures_kernels_cached():
    """`minillm warm --all` (what `make install` runs) leaves in Numba's cache the layer function
    of every architecture, the F16 cache's attention and every quantized product: a first run
    of any quantized model with an F16 cache loads them without compiling."""
    out = subprocess.run([sys.executable, "-m", "minillm", "warm", "--all"], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0 and "failed" not in out.stderr, out.stderr
    assert out.stdout == "" and "ready: every architecture's kernels" in out.stderr
    probe = ("import numpy as np; from minillm.arch import ARCHITECTURES; from minillm.backends.cpu import _layer_cached; "
             "from minillm.kernels.cpu.attention_fns import attention_fn_cached; "
             "from minillm.kernels.cpu.matmul import PRODUCT_IDS; from minillm.kernels.cpu.quant_products import "
             "qproducts_cached; print(sorted(n for n, a in ARCHITECTURES.items() if not _layer_cached(a.layer_function)), "
             "attention_fn_cached(np.uint16), all(map(qproducts_cached, PRODUCT_IDS.values())))")
    cached = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert cached.stdout.split() == ["[]", "True", "True"], cached.stderr


def test_warm_all_covers_every_layer_function():
    """Each architecture runs one of the layer functions warm --all compiles on its synthetic models."""
    from minillm.arch import ARCHITECTURES
    from minillm.warm_all import LAYER_MODELS

    warmed = {ARCHITECTURES[m["arch"]].layer_function for m in LAYER_MODELS.values()}
    assert {a.layer_function for a in ARCHITECTURES.values()} == warmed


@pytest.mark.parametrize("args", [(), ("--all", "models/none.gguf")])
def test_warm_takes_a_model_or_all(args):
    out = run("warm", *args)
    assert out.returncode == 2 and "give a MODEL or --all" in out.stderr and "Traceback" not in out.stderr


def test_the_products_compile_inside_on_compile_when_they_are_not_cached(monkeypatch):
    """A first run's product kernels compile while the weights load, inside the caller's
    on_compile (the CLI's notice), once for all of them; cached, they load without it."""
    from contextlib import contextmanager

    from minillm import weights
    from minillm.formats import FORMATS_BY_NAME

    entered, asked = [], []

    @contextmanager
    def on_compile():
        entered.append(True)
        yield

    shapes = {(FORMATS_BY_NAME["Q4_K"], 64), (FORMATS_BY_NAME["Q8_0"], 64), (FORMATS_BY_NAME["Q8_0"], 60)}
    monkeypatch.setattr(weights, "qproducts", lambda product: asked.append(product) or (0, 0))
    monkeypatch.setattr(weights, "qproducts_cached", lambda product: False)
    weights.prepare_products(shapes, on_compile)
    assert entered == [True] and sorted(asked) == sorted({weights.product_id(f, rows) for f, rows in shapes})
    monkeypatch.setattr(weights, "qproducts_cached", lambda product: True)
    weights.prepare_products(shapes, on_compile)
    assert entered == [True]


def test_compile_progress_names_what_compiles():
    """A first run says it compiles and counts Numba's compilations as they finish."""
    import numba

    from minillm.cli.compile_progress import NOTICE, _CompileCounter, compile_progress

    @numba.njit
    def inner(x):
        return x + 1

    @numba.njit
    def outer(x):
        return inner(x) * 2

    shown, logged = [], []
    with compile_progress(logged.append):  # stderr is not a terminal here: start and end lines
        from numba.core import event

        with event.install_listener("numba:compile", _CompileCounter(shown.append)):
            assert outer(3) == 8
    assert logged[0] == f"{NOTICE}..." and logged[1].startswith("kernels compiled and cached (2 functions")
    assert any(text.endswith("0 done, now " + inner.__qualname__) for text in shown)
    assert shown[-1] == "Compiling kernels, first run only: 2 done"


def test_collector_is_off_while_starting_and_back_after():
    """cli.main turns Python's cycle collector off for the start (full collections over Numba's
    objects cost tens of ms); load_model turns it back on, the start's objects frozen."""
    import gc

    from minillm.cli import app as cli

    gc.disable()
    try:
        m = cli.load_model(model_path("smollm2"), None, "cpu")
        assert gc.isenabled() and gc.get_freeze_count() > 0
        assert m._tokenizer is not None  # built during the start, while the collector was off
    finally:
        gc.unfreeze()
        gc.enable()


def test_auto_device_runs_on_the_cpu_while_the_cuda_path_is_slower(monkeypatch, capsys):
    """--device auto takes a GPU only where the CUDA path is the faster (not yet): with a GPU
    present it runs on the CPU and says so once, on stderr."""
    import os

    from numba import cuda
    from numba.core import config

    from minillm import backends
    from minillm.cli.app import load_model

    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: p == "/dev/nvidiactl" or real_exists(p))
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(config, "ENABLE_CUDASIM", False)
    assert backends.resolve_device("auto") == ("cpu", backends.SLOWER_GPU_NOTICE)
    assert backends.resolve_device("cpu") == ("cpu", None)
    model = load_model(model_path("smollm2"), None, "auto")
    assert model.device == "cpu" and capsys.readouterr().err.count("CUDA path is still slower") == 1
    monkeypatch.setattr(backends, "CUDA_FASTER_THAN_CPU", True)
    assert backends.resolve_device("auto") == ("cuda", None)
