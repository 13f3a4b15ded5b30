"""Facts about a model file for `minillm info`, without loading any weights."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from ..arch import ARCHITECTURES, get_architecture
from ..errors import UnsupportedError
from ..gguf_file import GGUFFile


def describe(path: Path) -> dict:
    """Parse and validate the file; return what a person or a script wants to know."""
    with GGUFFile(path) as g:
        arch_name = g.architecture
        facts = {
            "file": str(path),
            "file_size_bytes": g.file_size,
            "gguf_version": g.version,
            "architecture": arch_name,
            "name": g.get("general.name"),
            "supported": arch_name in ARCHITECTURES,
            "n_tensors": len(g.tensors),
            "n_params": sum(t.n_elements for t in g.tensors.values()),
            "tensor_types": dict(Counter(t.format.name for t in g.tensors.values()).most_common()),
        }
        arch = None
        if facts["supported"]:
            try:  # validates the metadata and tensors against what the module computes
                arch = get_architecture(arch_name)(g)
            except UnsupportedError as e:
                facts["supported"] = False
                facts["unsupported"] = str(e)
        if arch is not None:
            hp = arch.hp
            facts["needs"] = arch.features()
            facts.update({
                "n_layer": hp.n_layer, "n_embd": hp.n_embd, "n_head": hp.n_head,
                "n_head_kv": hp.n_head_kv, "head_dim": hp.head_dim, "n_ff": hp.n_ff,
                "n_vocab": hp.n_vocab, "context_length": hp.n_ctx_train,
            })
        facts["tokenizer"] = g.get("tokenizer.ggml.model")
        facts["tokenizer_pre"] = g.get("tokenizer.ggml.pre")
        facts["chat_template"] = isinstance(g.get("tokenizer.chat_template"), str)
        return facts
