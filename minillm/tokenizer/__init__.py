"""Tokenizers that agree with llama.cpp token for token.

    from minillm.gguf_file import GGUFFile
    from minillm.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(GGUFFile(path))
    ids = tok.tokenize("Hello", special=True)      # model's default BOS
    text = tok.detokenize(ids)

Modules: vocab (GGUF metadata -> Vocab), pre_types + pretokenize (BPE word splitting),
bpe and spm (the two encoders), core (Tokenizer, StreamDecoder).
"""
from .core import SpecialTokenSplitter, StreamDecoder, Tokenizer
from .vocab import TokenType, Vocab, load_vocab

__all__ = ["SpecialTokenSplitter", "StreamDecoder", "TokenType", "Tokenizer", "Vocab", "load_vocab"]
