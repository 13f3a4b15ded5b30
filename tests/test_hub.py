"""Models by name (-hf REPO[:QUANT], pull, ls, rm) against a stand-in for the Hugging Face Hub
on 127.0.0.1 (fake_hub.py): no network. The repositories hold the two real models, a split
copy of SmolLM2, and small files for the faults."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import model_path
from fake_hub import TOKEN, FakeHub, HubRepo

from minillm.errors import MinillmError
from minillm.hub import HubFile, ModelRef, check_quant, choose_file, parse_ref, quant_tag

SMOL = "test-org/SmolLM2-135M-Instruct-GGUF"
GEMMA = "test-org/gemma-3-270m-it-GGUF"
SPLIT = "test-org/SmolLM2-135M-Instruct-split-GGUF"
FAKE_GGUF = b"GGUF" + b"\0" * 60  # listed, never downloaded: a test fails if it is


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from split_gguf import split_gguf

    parts = split_gguf(model_path("smollm2"), tmp_path_factory.mktemp("split"), 3, stem="SmolLM2-135M-Instruct-Q4_1")
    repos = {
        SMOL: HubRepo({"README.md": b"# SmolLM2\n", "SmolLM2-135M-Instruct-IQ4_XS.gguf": FAKE_GGUF,
                       "SmolLM2-135M-Instruct-Q4_1.gguf": model_path("smollm2")}, architecture="llama"),
        GEMMA: HubRepo({"gemma-3-270m-it-Q8_0.gguf": FAKE_GGUF, "gemma-3-270m-it-Q4_K_M.gguf": model_path("gemma3"),
                        "mmproj-gemma-3-270m-it-F16.gguf": FAKE_GGUF}, architecture="gemma3"),
        SPLIT: HubRepo({f"Q4_1/{p.name}": p for p in parts}, architecture="llama"),
        "test-org/safetensors-only": HubRepo({"config.json": b"{}", "model.safetensors": b"\0" * 64}),
        "test-org/mamba-GGUF": HubRepo({"mamba-Q4_K_M.gguf": FAKE_GGUF}, architecture="mamba"),
        "test-org/iq-only-GGUF": HubRepo({"m-IQ2_XS.gguf": FAKE_GGUF, "m-TQ1_0.gguf": FAKE_GGUF}),
        "test-org/gated-GGUF": HubRepo({"smol-Q4_1.gguf": model_path("smollm2")}, architecture="llama", gated=True),
        "test-org/corrupt-GGUF": HubRepo({"smol-Q4_1.gguf": model_path("smollm2")}, architecture="llama",
                                         corrupt={"smol-Q4_1.gguf"}),
        "test-org/flaky-GGUF": HubRepo({"smol-Q4_1.gguf": model_path("smollm2")}, architecture="llama"),
    }
    with FakeHub(repos) as server:
        yield server


@pytest.fixture
def cli(hub, tmp_path):
    """Runs `minillm ARGS` against the fake hub with a cache of its own (HF_HOME in tmp_path)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_TELEMETRY="1")

    def run(*args, cwd=None, **extra_env):
        return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True,
                              timeout=300, cwd=cwd, env={**env, **extra_env})

    run.cache = tmp_path / "hf" / "hub"
    return run


def _ok(out):
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    return out


def _error(out, *words):
    last = out.stderr.splitlines()[-1] if out.stderr else ""  # after the download's log lines, if any
    assert out.returncode == 1 and last.startswith("error: ") and "Traceback" not in out.stderr, out.stderr
    for word in words:
        assert word in out.stderr, out.stderr
    return out.stderr


def _complete_blobs(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("blobs/*") if not p.name.endswith(".incomplete")]


# -- choosing the file ------------------------------------------------------------------------
def test_refs_and_the_choice_of_file():
    assert parse_ref("bartowski/Qwen2.5-7B-Instruct-GGUF:q4_k_m") == ModelRef("bartowski/Qwen2.5-7B-Instruct-GGUF",
                                                                              "q4_k_m")
    assert parse_ref("hf.co/org/name:Q8_0") == ModelRef("org/name", "Q8_0")
    for bad in ("nothing", "a/b/c", "org/name.gguf", "org/name:Q4:K"):
        with pytest.raises(MinillmError, match="neither a file nor a model on the hub"):
            parse_ref(bad)
    with pytest.raises(MinillmError, match="IQ4_XS: minillm does not run this format"):
        parse_ref("org/name:IQ4_XS")
    check_quant("Q4_K_L")  # bartowski's Q4_K with Q8_0 embeddings: runnable
    assert [quant_tag(n) for n in ("a/M-Q4_K_M.gguf", "m.q8_0.gguf", "M-Q5_K_S-00002-of-00003.gguf")] == \
        ["Q4_K_M", "Q8_0", "Q5_K_S"]
    files = [HubFile(n, 1, None) for n in ("mmproj-m-F16.gguf", "m-Q2_K.gguf", "m-Q8_0.gguf", "m-Q4_K_M-00002-of-00002.gguf",
                                           "m-Q4_K_M-00001-of-00002.gguf", "m-IQ3_XXS.gguf")]
    assert choose_file(files, ModelRef("o/m")).path == "m-Q4_K_M-00001-of-00002.gguf"
    assert choose_file(files[:3], ModelRef("o/m")).path == "m-Q8_0.gguf"
    assert choose_file(files[:2] + files[5:], ModelRef("o/m")).path == "m-Q2_K.gguf"
    assert choose_file(files, ModelRef("o/m", "q2_k")).path == "m-Q2_K.gguf"
    with pytest.raises(MinillmError, match="has no Q6_K file: it has m-Q2_K.gguf"):
        choose_file(files, ModelRef("o/m", "Q6_K"))


# -- running and pulling by name --------------------------------------------------------------
def test_generate_by_name_equals_the_local_file(hub, cli):
    prompt = ["-p", "The capital of France is", "-n", "12", "--temp", "0"]
    local = _ok(cli("generate", str(model_path("smollm2")), *prompt))
    first = _ok(cli("generate", "-hf", f"{SMOL}:q4_1", *prompt))
    assert first.stdout == local.stdout and f"downloading {SMOL}/SmolLM2-135M-Instruct-Q4_1.gguf" in first.stderr
    assert len(hub.downloads(SMOL)) == 1 and not hub.downloads("IQ4_XS")
    again = _ok(cli("generate", f"{SMOL}:Q4_1", *prompt))  # a bare REPO:QUANT, now from the cache
    assert again.stdout == local.stdout and len(hub.downloads(SMOL)) == 1 and "downloading" not in again.stderr
    probe = ("import sys, minillm; m = minillm.load(sys.argv[1]); print(m.path.name, m.hp.n_layer)")
    out = _ok(subprocess.run([sys.executable, "-c", probe, f"{SMOL}:Q4_1"], capture_output=True, text=True,
                             env={**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(cli.cache.parent)}))
    assert out.stdout.split() == ["SmolLM2-135M-Instruct-Q4_1.gguf", "30"]


def test_default_quant_ls_and_rm(hub, cli):
    pulled = _ok(cli("pull", GEMMA))  # Q8_0 is listed first, mmproj too: Q4_K_M is the default
    path = Path(pulled.stdout.strip())
    assert path.name == "gemma-3-270m-it-Q4_K_M.gguf" and path.stat().st_size == model_path("gemma3").stat().st_size
    _ok(cli("pull", f"{SMOL}:Q4_1", "--json"))
    listed = json.loads(_ok(cli("ls", "--json")).stdout)
    assert [(m["ref"], m["architecture"], m["quantization"]) for m in listed] == [
        (f"{SMOL}:Q4_1", "llama", "Q4_1"), (f"{GEMMA}:Q4_K_M", "gemma3", "Q4_K_M")]  # most recent first
    assert listed[1]["size"] == model_path("gemma3").stat().st_size
    info = json.loads(_ok(cli("info", GEMMA, "--json")).stdout)  # a use: gemma is now the most recent
    assert info["architecture"] == "gemma3"
    assert [m["repo"] for m in json.loads(_ok(cli("ls", "--json")).stdout)] == [GEMMA, SMOL]
    table = _ok(cli("ls", COLUMNS="60")).stdout.splitlines()  # piped: whole names, however narrow the screen
    assert [line.split()[:2] for line in table] == [["model", "file"], [f"{GEMMA}:Q4_K_M", "gemma-3-270m-it-Q4_K_M.gguf"],
                                                    [f"{SMOL}:Q4_1", "SmolLM2-135M-Instruct-Q4_1.gguf"]]
    assert {line.index("gemma3" if GEMMA in line else "llama") for line in table[1:]} == {table[0].index("architecture")}
    assert "gemma3" in table[1] and "Q4_K_M" in table[1] and table[1].endswith("just now")
    _error(cli("rm", f"{GEMMA}:Q8_0"), "is not in the local store")
    assert "deleted gemma-3-270m-it-Q4_K_M.gguf" in _ok(cli("rm", f"{GEMMA}:q4_k_m")).stderr
    assert [m["repo"] for m in json.loads(_ok(cli("ls", "--json")).stdout)] == [SMOL]
    _ok(cli("rm", SMOL))
    assert json.loads(_ok(cli("ls", "--json")).stdout) == [] and not _complete_blobs(cli.cache)
    _error(cli("rm", SMOL), "is not in the local store")


def test_split_model_by_name_and_by_file(hub, cli):
    prompt = ["-p", "Once upon a time", "-n", "8", "--temp", "0"]
    local = _ok(cli("generate", str(model_path("smollm2")), *prompt))
    assert _ok(cli("generate", "-hf", f"{SPLIT}:Q4_1", *prompt)).stdout == local.stdout
    assert len(hub.downloads(SPLIT)) == 3
    first = "Q4_1/SmolLM2-135M-Instruct-Q4_1-00001-of-00003.gguf"
    tokens = _ok(cli("tokenize", "-hf", SPLIT, "-hff", first, "-p", "Hello", "--ids"))
    assert json.loads(tokens.stdout) == json.loads(_ok(cli("tokenize", str(model_path("smollm2")), "-p", "Hello",
                                                           "--ids")).stdout)
    listed = json.loads(_ok(cli("ls", "--json")).stdout)
    assert [(m["file"], m["size"]) for m in listed] == [(first, sum(hub.repos[SPLIT].size(p) for p in hub.repos[SPLIT].files))]
    _error(cli("info", "-hf", SPLIT, "-hff", "Q4_1/nothing.gguf"), "has no file Q4_1/nothing.gguf")
    assert len(_ok(cli("rm", f"{SPLIT}:Q4_1")).stderr.splitlines()) == 1 and not _complete_blobs(cli.cache)


def test_quantize_from_the_hub_writes_outside_the_cache(hub, cli, tmp_path):
    out = tmp_path / "smol-q8.gguf"
    _ok(cli("quantize", "-hf", f"{SMOL}:Q4_1", str(out), "Q8_0", "--allow-requantize"))
    reference = tmp_path / "reference-q8.gguf"
    _ok(cli("quantize", str(model_path("smollm2")), str(reference), "Q8_0", "--allow-requantize"))
    assert out.read_bytes() == reference.read_bytes()
    _ok(cli("quantize", "-hf", f"{SMOL}:Q4_1", "Q8_0", "--allow-requantize", cwd=tmp_path))  # IN TYPE
    assert (tmp_path / "ggml-model-Q8_0.gguf").read_bytes() == reference.read_bytes()
    wrong = cli("quantize", "-hf", f"{SMOL}:Q4_1", "a.gguf", "Q8_0", "extra")
    assert wrong.returncode == 2 and "with -hf, give 2 arguments, not 3" in wrong.stderr


# -- faults -----------------------------------------------------------------------------------
def test_resumed_after_the_connection_drops(hub, cli):
    hub.drops["smol-Q4_1.gguf"] = [25 << 20]  # the first GET ends after 25 MiB
    out = _ok(cli("pull", "test-org/flaky-GGUF:Q4_1"))
    ranges = [r for _, _, r in hub.downloads("flaky")]
    assert ranges[0] == "" and ranges[1].startswith("bytes=") and 0 < int(ranges[1][6:-1]) <= 25 << 20
    assert Path(out.stdout.strip()).read_bytes() == model_path("smollm2").read_bytes()


def test_interrupted_download_leaves_no_complete_file(hub, cli):
    hub.drops["smol-Q4_1.gguf"] = [3 << 20] * 7  # more drops than huggingface_hub retries
    _error(cli("pull", "test-org/flaky-GGUF"), "downloading test-org/flaky-GGUF/smol-Q4_1.gguf failed")
    assert not _complete_blobs(cli.cache) and not list(cli.cache.rglob("*.gguf"))
    assert json.loads(_ok(cli("ls", "--json")).stdout) == []
    hub.drops.pop("smol-Q4_1.gguf", None)
    path = Path(_ok(cli("pull", "test-org/flaky-GGUF")).stdout.strip())
    assert path.read_bytes() == model_path("smollm2").read_bytes()


def test_corrupted_download_is_deleted(hub, cli):
    message = _error(cli("pull", "test-org/corrupt-GGUF"), "sha256", "the file is deleted")
    assert hub.repos["test-org/corrupt-GGUF"].commit not in message
    assert not _complete_blobs(cli.cache) and not list(cli.cache.rglob("*.gguf"))


def test_repositories_minillm_cannot_run_are_refused_before_downloading(hub, cli):
    before = len(hub.downloads())
    _error(cli("pull", "test-org/safetensors-only"), "holds no GGUF model file", "model.safetensors",
           "convert_hf_to_gguf.py")
    _error(cli("generate", "test-org/mamba-GGUF", "-p", "x"), "'mamba' model, which minillm does not run")
    _error(cli("pull", "test-org/iq-only-GGUF"), "no file in a format minillm runs", "m-IQ2_XS.gguf")
    _error(cli("pull", f"{SMOL}:IQ4_XS"), "IQ4_XS: minillm does not run this format")
    _error(cli("pull", f"{SMOL}:Q6_K"), f"{SMOL} has no Q6_K file")
    _error(cli("pull", "test-org/nothing-here"), "no model repository test-org/nothing-here on the hub")
    _error(cli("info", "nothing/here.gguf"), "no such file")
    assert len(hub.downloads()) == before


def test_gated_repository_needs_a_token(hub, cli):
    _error(cli("pull", "test-org/gated-GGUF"), "is gated", "HF_TOKEN")
    path = Path(_ok(cli("pull", "test-org/gated-GGUF", HF_TOKEN=TOKEN)).stdout.strip())
    assert path.stat().st_size == model_path("smollm2").stat().st_size


def test_offline_with_and_without_a_cached_copy(hub, cli):
    _error(cli("info", f"{SMOL}:Q4_1", HF_HUB_OFFLINE="1"), "not in the local cache", "HF_HUB_OFFLINE")
    _ok(cli("pull", f"{SMOL}:Q4_1"))
    logged = len(hub.log)
    info = json.loads(_ok(cli("info", f"{SMOL}:Q4_1", "--json", HF_HUB_OFFLINE="1")).stdout)
    assert info["architecture"] == "llama" and len(hub.log) == logged  # not one request
    unreachable = _ok(cli("info", SMOL, "--json", HF_ENDPOINT="http://127.0.0.1:9"))  # a closed port
    assert "using the cached copy" in unreachable.stderr and json.loads(unreachable.stdout)["architecture"] == "llama"
    _error(cli("info", GEMMA, HF_ENDPOINT="http://127.0.0.1:9"), "not in the local cache", "Connect")


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench", "perplexity", "info", "tokenize",
                                     "quantize", "imatrix"])
def test_every_command_that_takes_a_model_takes_one_by_name(command):
    out = subprocess.run([sys.executable, "-m", "minillm", command, "--help"], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0 and "-hf" in out.stdout and "-hff" in out.stdout and "REPO[:QUANT]" in out.stdout
