"""Small models of every architecture, each with the features its module must get right, and the
token sequences llama.cpp was run on (tests/llama_ref/record_archs.py records its logits into
tests/data/arch_reference.npz; test_architectures.py compares). The files are regenerated from
their seeds, byte for byte the ones llama.cpp read (the recorded sha256 says so)."""
from __future__ import annotations

import numpy as np

from synthetic import SyntheticModel

N_PROMPT = 70    # one batch of 70 tokens (ggml's tiled attention from 64), then
N_DECODE = 10    # 10 single tokens (its one-chunk attention); greedy after the prompt alone:
N_GREEDY = 8
N_CTX = 128      # the context minillm evaluates with (LongRoPE picks its factors by it, as llama.cpp)


def _llama3_factors(half: int) -> list[float]:
    """Frequency factors shaped as Llama 3.1's: 1 for the fast pairs, up to 8 for the slow ones."""
    return [float(f) for f in np.linspace(1.0, 8.0, half) ** 1.5 / 8.0 ** 0.5]


def _longrope(half: int, seed: int) -> list[float]:
    return [float(f) for f in 1.0 + np.random.default_rng(seed).random(half) * 3.0]


# name -> SyntheticModel arguments. Formats mixed per matrix, as llama-quantize's mixes do; in
# "llama-q4_0" the tied output matrix (300 rows) is one llama.cpp does not repack, the others it does.
CASES = {
    "llama-rope-freqs": dict(arch="llama", fmt="Q4_1", formats={"attn_v": "Q8_0"},
                             extra_tensors={"rope_freqs.weight": _llama3_factors(32)}),
    "llama-linear": dict(arch="llama", fmt="Q8_0", keys={"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}),
    "llama-yarn": dict(arch="llama", fmt="Q5_0",
                       keys={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                             "rope.scaling.original_context_length": 256}),
    "qwen2": dict(arch="qwen2", fmt="Q4_K", formats={"attn_v": "Q6_K", "ffn_down": "Q6_K"}),
    "qwen3": dict(arch="qwen3", fmt="Q8_0", formats={"ffn_gate": "Q4_K", "ffn_up": "Q4_K"}),
    "phi3": dict(arch="phi3", fmt="Q5_1", rope_dims=32, formats={"ffn_down": "Q8_0"},
                 keys={"rope.scaling.original_context_length": 4096, "rope.scaling.attn_factor": 1.1902380714238083,
                       "attention.sliding_window": 2047},
                 extra_tensors={"rope_factors_long.weight": _longrope(16, 1),
                                "rope_factors_short.weight": _longrope(16, 2)}),
    "phi3-long": dict(arch="phi3", fmt="Q8_0", rope_dims=32,
                      keys={"rope.scaling.original_context_length": 32, "rope.scaling.attn_factor": 1.1902380714238083},
                      extra_tensors={"rope_factors_long.weight": _longrope(16, 3),
                                     "rope_factors_short.weight": _longrope(16, 4)}),
    "gemma2": dict(arch="gemma2", fmt="Q4_K", n_layer=3, formats={"ffn_down": "Q6_K"},
                   keys={"attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "llama-f16": dict(arch="llama", fmt="F16"),
    "qwen3-bf16": dict(arch="qwen3", fmt="BF16", formats={"ffn_down": "F32"}),
    "llama-q4_0": dict(arch="llama", fmt="Q4_0", formats={"attn_v": "Q4_1", "token_embd": "Q4_0"}),
    "llama-q5_k_m": dict(arch="llama", fmt="Q5_K", formats={"attn_v": "Q6_K", "ffn_down": "Q6_K"}),
    "qwen2-q3_k_m": dict(arch="qwen2", fmt="Q3_K", formats={"attn_v": "Q5_K", "ffn_down": "Q4_K"}),
    "qwen3-q2_k": dict(arch="qwen3", fmt="Q2_K", formats={"attn_v": "Q3_K", "ffn_down": "Q3_K"}),
    # three gated delta-net layers, then gated attention with partial IMROPE (a fourth section)
    "qwen35": dict(arch="qwen35", fmt="Q8_0", n_layer=4, rope_dims=16,
                   formats={"ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ssm_alpha": "F32", "ssm_beta": "F32"},
                   keys={"rope.dimension_sections": [3, 3, 1, 1]}),
    # llama-quantize's Q4_K_M mix for it: the 4-row ssm_alpha/ssm_beta Q4_K that llama.cpp does not repack
    "qwen35-q4_k_m": dict(arch="qwen35", fmt="Q4_K", n_layer=4, rope_dims=16,
                          formats={"attn_qkv": "Q6_K", "attn_v": "Q6_K", "ffn_down": "Q6_K"},
                          keys={"rope.dimension_sections": [3, 3, 2, 0]}),
    # two short-convolution layers, attention (q/k norms), a short-convolution layer; the FFN in
    # K-quants as llama-quantize's Q4_K_M mix would have it
    "lfm2": dict(arch="lfm2", fmt="Q8_0", n_layer=4, formats={"ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}),
    # the attention layer with a sliding window of 8 (LFM2's sliding_window key), Q4_0 repacked
    "lfm2-swa": dict(arch="lfm2", fmt="Q4_0", n_layer=4, keys={"attention.sliding_window": 8},
                     formats={"shortconv.in_proj": "Q8_0"}),
    # Granite 4.0-H: Mamba2 (two groups of 64 states: ggml's SIMD scan), attention without RoPE;
    # ssm_out in F16 (its input not quantized: the scan's last bits reach the logits)
    "granitehybrid": dict(arch="granitehybrid", fmt="Q8_0", n_layer=4,
                          formats={"ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ssm_out": "F16"},
                          keys={"logit_scale": 0.5, "residual_scale": 0.5, "embedding_scale": 2.0,
                                "attention.scale": 0.0078125}),
    # Bamba's shape: one group of 16 states (ggml's scalar scan), RoPE, a state of 16 per head
    "granitehybrid-rope": dict(arch="granitehybrid", fmt="Q5_K", n_layer=3, ssm=dict(N=16, G=1, Hs=4),
                               keys={"rope.scaling.finetuned": True}, formats={"ssm_out": "F32"}),
    # layer 3 without RoPE; Q4_K_M's mix
    "smollm3": dict(arch="smollm3", fmt="Q4_K", n_layer=4, formats={"attn_v": "Q6_K", "ffn_down": "Q6_K"}),
    # Ministral 3: YaRN from 8 positions with its own betas and log multiplier, the attention
    # temperature from position 8 on
    "mistral3": dict(arch="mistral3", fmt="Q8_0", formats={"ffn_gate": "Q4_K", "ffn_up": "Q4_K"},
                     keys={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                           "rope.scaling.original_context_length": 8, "rope.scaling.yarn_beta_fast": 16.0,
                           "rope.scaling.yarn_beta_slow": 2.0, "rope.scaling.yarn_log_multiplier": 0.8,
                           "attention.temperature_scale": 0.1}),
    # 2 of 8 experts a token: Q4_K gate/up (repacked) and Q6_K down, as llama-quantize's Q4_K_M
    "qwen3moe": dict(arch="qwen3moe", fmt="Q8_0", formats={"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K",
                                                           "ffn_down_exps": "Q6_K"}),
    # 4 of 16 experts: the 32-block formats (Q4_0 repacked, Q5_1, Q8_0)
    "qwen3moe-q4_0": dict(arch="qwen3moe", fmt="Q4_0", moe=dict(X=16, K=4, F=128),
                          formats={"ffn_up_exps": "Q5_1", "ffn_down_exps": "Q8_0"}),
    # Granite 4.0-H Tiny's shape: 2 of 8 experts (Q4_K, Q6_K down) beside a shared expert
    "granitehybrid-moe": dict(arch="granitehybrid", fmt="Q8_0", n_layer=3, moe=dict(X=8, K=2, S=256),
                              formats={"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q6_K"},
                              keys={"logit_scale": 0.5, "residual_scale": 0.5, "embedding_scale": 2.0}),
    "granite": dict(arch="granite", fmt="Q4_1",
                    keys={"logit_scale": 8.0, "residual_scale": 0.22, "embedding_scale": 12.0,
                          "attention.scale": 0.0078125}),
}


def build(name: str) -> SyntheticModel:
    return SyntheticModel(seed=sum(map(ord, name)), vocab=True, **CASES[name]).build()


def token_ids(name: str) -> np.ndarray:
    """The N_PROMPT + N_DECODE token ids of the case (never the three special ids)."""
    return np.random.default_rng(len(name)).integers(3, 300, N_PROMPT + N_DECODE)
