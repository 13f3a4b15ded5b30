"""Every architecture against llama.cpp b11434, bit for bit: small models (tests/arch_cases.py)
regenerated from their seeds, compared with the logits and greedy tokens llama.cpp produced
on the same files (tests/data/arch_reference.npz, from tests/llama_ref/record_archs.py)."""
import hashlib
import json

import numpy as np
import pytest

import minillm
from arch_cases import CASES, N_CTX, N_GREEDY, N_PROMPT, build, token_ids
from conftest import DATA
from minillm.arch import ARCHITECTURES
from minillm.arch.base import COMMON_KEYS, NEUTRAL_VALUES
from minillm.generate import Session
from minillm.kernels.cpu.ops import ggml_build
from minillm.sampling import SamplingParams
from synthetic import SyntheticModel

REFERENCE = np.load(DATA / "arch_reference.npz")
HOST_BUILD = ggml_build(bf16=True)   # BF16 products differ where the CPU has AVX512_BF16
# llama.cpp's logits as ggml's build for this kind of CPU computes them, else another build's
REF_BUILD = HOST_BUILD if any(k.startswith(HOST_BUILD + "/") for k in REFERENCE) else "avx2"


def first_difference(ours: np.ndarray, ref: np.ndarray) -> str:
    row, col = np.argwhere(ours != ref)[0]
    step = "the prompt batch" if row == 0 else f"single token {row}"
    return (f"after {step}: logit {col} is {ours[row, col]!r}, llama.cpp's {ref[row, col]!r}; "
            f"{int((ours != ref).sum())} of {ref.size} differ, largest by {np.abs(ours - ref).max():.3g}")


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_tokens_match_llama_cpp(tmp_path, name):
    path = build(name).write(tmp_path / f"{name}.gguf")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == str(REFERENCE[f"{name}/sha256"]), "the regenerated file is not the one llama.cpp read"
    model = minillm.load(path)
    ids = token_ids(name)
    cache = model.new_cache(N_CTX)
    rows = [model.eval(ids[:N_PROMPT], cache, logits_from=N_PROMPT - 1)[0]]
    rows += [model.eval(ids[t:t + 1], cache)[0] for t in range(N_PROMPT, len(ids))]
    ours, ref = np.stack(rows), REFERENCE[f"{REF_BUILD}/{name}/logits"]
    if REF_BUILD != HOST_BUILD:
        # ggml's AVX2 and AVX-512 builds round a few steps differently (docs/fidelity.md), and
        # minillm computes as the build for this CPU: close to the other build, not equal
        assert np.abs(ours - ref).max() < 0.1, first_difference(ours, ref)
        return
    assert np.array_equal(ours, ref), first_difference(ours, ref)

    chunks = Session(model, n_ctx=N_CTX).generate(list(ids[:N_PROMPT]), N_GREEDY, SamplingParams(temperature=0),
                                                  ignore_eos=True)
    greedy = [c.token for c in chunks if c.token is not None]
    assert greedy == REFERENCE[f"{REF_BUILD}/{name}/greedy"].tolist()


# ---- what a module does not compute is refused, by name ----------------------------------------

def load_error(tmp_path, **model) -> str:
    path = SyntheticModel(n_layer=1, n_embd=64, head_dim=16, n_ff=64, n_vocab=40, **model).build().write(
        tmp_path / "m.gguf")
    with pytest.raises(minillm.MinillmError) as e:
        minillm.load(path)
    return str(e.value)


@pytest.mark.parametrize("model,named", [
    # a tensor the module has no use for: an FFN bias (llama), rope_freqs on Qwen2, LongRoPE without its type
    (dict(arch="llama", extra_tensors={"blk.0.ffn_up.bias": [0.0] * 64}), "blk.0.ffn_up.bias"),
    (dict(arch="qwen2", extra_tensors={"rope_freqs.weight": [1.0] * 8}), "rope_freqs.weight"),
    (dict(arch="llama", extra_tensors={"rope_factors_long.weight": [1.0] * 8}), "rope_factors_long.weight"),
    # keys that change the arithmetic and that the module does not read
    (dict(arch="llama", keys={"attn_logit_softcapping": 50.0}), "llama.attn_logit_softcapping"),
    (dict(arch="qwen2", keys={"attention.scale": 0.1}), "qwen2.attention.scale"),
    (dict(arch="llama", keys={"expert_count": 8}), "llama.expert_count"),
    (dict(arch="llama", keys={"rope.scaling.type": "su"}), "llama.rope.scaling.type"),
    (dict(arch="granite", keys={"logit_scale": 2.0, "rope.scaling.finetuned": False}), "rope.scaling.finetuned"),
    # a factor tensor of the wrong size, one LongRoPE set without the other
    (dict(arch="llama", extra_tensors={"rope_freqs.weight": [1.0] * 4}), "rope_freqs.weight"),
    (dict(arch="phi3", extra_tensors={"rope_factors_long.weight": [1.0] * 8}), "rope_factors_short.weight"),
])
def test_what_a_module_does_not_compute_is_refused_by_name(tmp_path, model, named):
    assert named in load_error(tmp_path, fmt="F32", **model)


def test_keys_llama_cpp_leaves_unread_load(tmp_path):
    # neutral values, and keys llama.cpp's converter writes that b11434 does not read for Llama
    # (a sliding window, YaRN's betas): it computes without them, and so does minillm
    keys = {"expert_count": 0, "attention.causal": True, "rope.scaling.finetuned": True, "vocab_size": 40,
            "attention.sliding_window": 4096, "rope.scaling.yarn_beta_fast": 32.0}
    path = SyntheticModel("llama", "F32", n_layer=1, n_embd=64, head_dim=16, n_ff=64, n_vocab=40,
                          keys=keys).build().write(tmp_path / "m.gguf")
    assert minillm.load(path).n_vocab == 40


def test_info_shows_what_a_file_needs_and_what_is_refused(tmp_path):
    from minillm.cli.inspect import describe

    path = build("phi3").write(tmp_path / "phi3.gguf")
    facts = describe(path)
    assert facts["supported"] and facts["architecture"] == "phi3"
    assert "LongRoPE factors (long ones past 4096 positions)" in facts["needs"]
    assert "RoPE on 32 of 64 head dims" in facts["needs"] and "fused q/k/v" in facts["needs"]
    gemma2 = describe(build("gemma2").write(tmp_path / "gemma2.gguf"))
    assert "attention soft-capping at 5" in gemma2["needs"] and "final logit soft-capping at 3" in gemma2["needs"]
    bad = SyntheticModel("llama", "F32", n_layer=1, n_embd=64, head_dim=16, n_ff=64, n_vocab=40,
                         keys={"attn_logit_softcapping": 50.0}).build().write(tmp_path / "bad.gguf")
    facts = describe(bad)
    assert facts["supported"] is False and "llama.attn_logit_softcapping" in facts["unsupported"]


CONVERTER_LAYOUTS = json.loads((DATA / "converter_layouts.json").read_text())
# the small model shaped as tests/llama_ref/convert_check.py's configuration of each architecture
CONVERTED_AS = {"llama": "llama-rope-freqs", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma2": "gemma2",
                "granite": "granite", "qwen35": "qwen35", "lfm2": "lfm2", "granitehybrid": "granitehybrid",
                "smollm3": "smollm3", "mistral3": "mistral3", "qwen3moe": "qwen3moe"}


@pytest.mark.parametrize("arch", sorted(CONVERTED_AS))
def test_small_models_have_the_layout_of_llama_cpps_converter(tmp_path, arch):
    """The small models hold the tensors (names and shapes) that llama.cpp's convert_hf_to_gguf.py
    writes for a model of transformers' own configuration class with the same dimensions, and the
    converter's keys are ones minillm reads (tests/llama_ref/convert_check.py, which also showed
    minillm's logits on those converted and llama-quantized files equal llama.cpp's)."""
    import gguf

    converted = dict(CONVERTER_LAYOUTS[arch]["tensors"])
    if arch == "phi3":  # Phi-3's configuration keeps its own output matrix; the small model ties it
        assert converted.pop("output.weight") == converted["token_embd.weight"]
    n_layer = max(int(name.split(".")[1]) for name in converted if name.startswith("blk.")) + 1
    reader = gguf.GGUFReader(build(CONVERTED_AS[arch]).write(tmp_path / "m.gguf"))
    ours = {t.name: [int(d) for d in reversed(t.shape)] for t in reader.tensors
            if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < n_layer}
    assert ours == converted
    read = COMMON_KEYS | ARCHITECTURES[arch].handled_keys | set(NEUTRAL_VALUES)
    keys = [k.removeprefix(f"{arch}.") for k in CONVERTER_LAYOUTS[arch]["keys"] if k.startswith(f"{arch}.")]
    assert keys and [k for k in keys if k not in read] == []
