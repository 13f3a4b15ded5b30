import signal
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cuda_env  # noqa: E402

cuda_env.use_simulator_unless_real()  # before numba.cuda is imported; MINILLM_CUDA_REAL=1: a real GPU

# The Ctrl+C tests send SIGINT to child processes. A shell's background job starts with SIGINT
# ignored, and an ignored signal stays ignored in every child: with a handler here, the children
# start with the default (Python's KeyboardInterrupt) whatever started the test run.
signal.signal(signal.SIGINT, signal.default_int_handler)

MODELS = {
    "smollm2": ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": ROOT / "models" / "gemma-3-270m-q4_k_m.gguf",
}


def model_path(name: str) -> Path:
    path = MODELS[name]
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make models` (make test does it)")
    return path


def golden_rows(model: str) -> list[dict]:
    """llama.cpp's greedy runs for a model, as llama.cpp computes them on a CPU of this kind:
    tests/data/greedy_<model>_dev.jsonl (the shared reference, from an AVX-512 machine) or, on
    an AVX2 one, greedy_<model>_avx2.jsonl (the same prompts and protocol, recorded with
    tests/llama_ref/record_greedy.py). ggml's AVX2 and AVX-512 builds round differently, and
    minillm computes as the build for the CPU it runs on (kernels/cpu/ops.py GGML_AVX512)."""
    import json

    from minillm.kernels.cpu.ops import GGML_AVX512

    with open(DATA / f"greedy_{model}_{'dev' if GGML_AVX512 else 'avx2'}.jsonl") as f:
        return [json.loads(line) for line in f]


_loaded = {}


def loaded_model(name: str):
    """One loaded Model per real model for the whole test session."""
    import minillm

    if name not in _loaded:
        _loaded[name] = minillm.load(model_path(name))
    return _loaded[name]


@pytest.fixture
def tiny_llama(tmp_path):
    from synthetic import SyntheticModel

    return SyntheticModel("llama", "Q8_0", n_layer=1, n_embd=64, n_head=2, n_head_kv=1,
                          head_dim=32, n_ff=128, n_vocab=40).build().write(tmp_path / "tiny.gguf")


@pytest.fixture(scope="session")
def smollm2_f16(tmp_path_factory):
    """SmolLM2's Q4_1 file requantized to F16 (bit-identical to llama-quantize's, test_quantize)."""
    from minillm.quantize import quantize

    out = tmp_path_factory.mktemp("quant") / "smollm2-f16.gguf"
    summary = quantize(model_path("smollm2"), out, "F16", allow_requantize=True)
    assert summary.n_requantized == 211
    return out


# Files handed to the workers first, before the others (most tests first, xdist's own rule).
# Under pytest-xdist (make test) a worker takes the next file in collection order when it runs
# low, so test_avx2_build.py (one test, about 250 s on 2 cores) started last and ran alone for 4
# minutes. Its child pytest compiles for another CPU (Haswell), none of the kernels the workers
# compile, so starting it first makes neither worker compile anything twice. (Moving the other
# long files to the front as well balanced the workers, but their work grew by about as much.)
FIRST_FILES = ("test_avx2_build.py",)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist's own order (most tests first) would undo ours
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    """FIRST_FILES first, in their order; the other files after them, most tests first (xdist's
    own rule); each file's tests in their own order."""
    counts = Counter(item.path.name for item in items)

    def rank(item):
        name = item.path.name
        return (FIRST_FILES.index(name), 0) if name in FIRST_FILES else (len(FIRST_FILES), -counts[name])

    items.sort(key=rank)


# lines that tests want shown in the run's output (measured figures), printed at the end
REPORT: list[str] = []


def pytest_sessionfinish(session):
    """Under pytest-xdist (make test), a worker hands its REPORT lines to the controller."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["report"] = REPORT


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a plain pytest (a bare GPU machine's) has none
def pytest_testnodedown(node, error):
    REPORT.extend(getattr(node, "workeroutput", {}).get("report", []))


def pytest_terminal_summary(terminalreporter):
    if REPORT:
        terminalreporter.section("measured")
        for line in REPORT:
            terminalreporter.write_line(line)
