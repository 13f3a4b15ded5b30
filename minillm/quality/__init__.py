"""Measuring a model's quality as llama.cpp's tools do: perplexity and KL divergence
(llama-perplexity), importance matrices (llama-imatrix) and what a quantization or a pruned
layer costs (quantize --eval, --prune-layers auto:N). Built on the engine; the engine never
imports it."""
