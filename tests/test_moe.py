"""Mixtures of experts (kernels/cpu/moe.py; arch/qwen3moe.py, granitehybrid.py) wherever a model runs: the batching
scheduler (each token's experts as alone), perplexity and quantization as llama.cpp's tools give
them, and what is refused by name. The logits themselves are checked against llama.cpp in
test_architectures.py ("qwen3moe", "qwen3moe-q4_0")."""
import json

import numpy as np
import pytest

import minillm
from arch_cases import build
from conftest import DATA
from llama_ref.record_hybrid import PPL_CHUNKS, PPL_CTX, QUANT_TYPE, hybrid_text, tensor_hashes
from minillm.kernels.cpu.target import GGML_AVX512
from minillm.sampling import SamplingParams
from minillm.serving.scheduler import Request
from synthetic import SyntheticModel, load_error

REFERENCE = json.loads((DATA / "moe_reference.json").read_text())


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build("qwen3moe").write(tmp_path_factory.mktemp("moe") / "qwen3moe.gguf")


@pytest.fixture(scope="module")
def model(model_path):
    return minillm.load(model_path)


@pytest.mark.parametrize("case", ["qwen3moe", "granitehybrid-moe"])
def test_the_scheduler_gives_each_request_its_tokens_alone(case, tmp_path):
    """Requests batched in one pass (their tokens routed to experts together, prompts in chunks)
    get the tokens each gets alone; Granite 4.0-H's experts beside its recurrent state too."""
    model = minillm.load(build(case).write(tmp_path / f"{case}.gguf"))
    greedy = SamplingParams(temperature=0)
    requests = [Request([int(i) for i in np.random.default_rng(s).integers(3, 300, 5 + 20 * s)], 6,
                        greedy if s % 2 else SamplingParams(temperature=0.9, seed=s), ignore_eos=True, id=s)
                for s in range(5)]
    scheduler = model.scheduler(parallel=3, n_ctx=256, batch=64)
    together = [h.result().tokens for h in [scheduler.submit(r) for r in requests]]
    alone = [model.scheduler(parallel=1, n_ctx=256, batch=64).submit(r).result().tokens for r in requests]
    assert together == alone


def test_perplexity_equals_llama_perplexity(model):
    from minillm.quality.perplexity import perplexity

    result = perplexity(model, hybrid_text(), n_ctx=PPL_CTX, n_chunks=PPL_CHUNKS)
    ref = REFERENCE["qwen3moe"]["ppl"]["avx512" if GGML_AVX512 else "avx2"]
    assert f"{result.ppl:.4f}" == f"{ref:.4f}"


def test_quantize_equals_llama_quantize(model_path, tmp_path):
    """The expert tensors (3-D) get llama-quantize's types and bytes too."""
    out = tmp_path / "q.gguf"
    minillm.quantize(model_path, out, QUANT_TYPE, allow_requantize=True)
    assert tensor_hashes(out) == REFERENCE["qwen3moe"]["quantized"]


def test_an_importance_matrix_is_refused_by_name(model):
    from minillm.quality.imatrix import compute_imatrix

    with pytest.raises(minillm.MinillmError, match="does not run qwen3moe models yet"):
        compute_imatrix(model, "some text " * 200, "t.txt", n_ctx=64)


def small(**changes) -> SyntheticModel:
    return SyntheticModel(arch="qwen3moe", fmt="Q8_0", n_layer=1, n_embd=64, head_dim=16, n_ff=64, n_vocab=40,
                          moe=dict(X=4, K=2, F=32), **changes).build()


@pytest.mark.parametrize("keys,drop,named", [
    ({"expert_used_count": 5}, None, "qwen3moe.expert_used_count"),
    ({"expert_count": 0}, None, "qwen3moe.expert_count"),
    ({}, "blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_inp.weight"),
    ({}, "blk.0.ffn_down_exps.weight", "blk.0.ffn_down_exps.weight"),
])
def test_a_bad_file_gets_one_error_naming_the_key_or_tensor(tmp_path, keys, drop, named):
    assert named in load_error(small(keys=keys), tmp_path, drop)


def test_float_experts_are_refused_by_name(tmp_path):
    path = small(formats={"ffn_gate_exps": "F16", "ffn_up_exps": "F16", "ffn_down_exps": "F16"}).write(
        tmp_path / "f16.gguf")
    with pytest.raises(minillm.MinillmError, match="experts in F16 are not supported"):
        minillm.load(path)
