"""The parameters of a generation, with their defaults written once: the library (Model.generate,
Session, the scheduler), the server's requests and the CLI's options all read them here. Only
dataclasses: the CLI imports this module to show its defaults, and stays fast to start."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class SamplingParams:
    """How the next token is drawn (sampling.Sampler, in llama.cpp's default order)."""
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class SpeculationParams:
    """How speculative decoding guesses (speculative.Speculation)."""
    draft_max: int = 16     # tokens guessed a step, at most
    draft_min: int = 0      # fewer guesses than this are not worth a pass: evaluate plainly
    p_min: float = 0.75     # a draft model stops guessing below this probability of its best token
    lookup_ngram: int = 3   # prompt lookup: the longest run of last tokens matched (down to 2)
