"""The options several commands share (typer Option objects can serve several commands), and
what they ask for as the engine's parameters. The commands import these; none imports another."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from .common import err, load_model
from ..params import SamplingParams, SpeculationParams


SAMPLING, SPECULATION = SamplingParams(), SpeculationParams()  # the defaults the options show

# options shared by `generate` and `chat` (typer Option objects can serve several commands)
MODEL = typer.Argument(None, help="A .gguf model file, or REPO[:QUANT] on the Hugging Face Hub.", show_default=False)
MODEL_OR_SERVER = typer.Argument(None, help="A .gguf model file, or REPO[:QUANT] on the Hugging Face Hub (none "
                                 "with --server).", show_default=False)
SERVER = typer.Option(None, "--server", help="URL of a running `minillm serve`: generate there, loading no model.")
API_KEY = typer.Option(None, "--api-key", envvar="MINILLM_API_KEY", help="With --server: its API key.")
TEMP = typer.Option(SAMPLING.temperature, "--temp", min=0.0, max=100.0, help="Temperature; 0 is greedy.")
TOP_K = typer.Option(SAMPLING.top_k, "--top-k", min=0, help="Top-k (0: off).")
TOP_P = typer.Option(SAMPLING.top_p, "--top-p", min=0.0, max=1.0, help="Top-p (1: off).")
MIN_P = typer.Option(SAMPLING.min_p, "--min-p", min=0.0, max=1.0, help="Min-p (0: off).")
REPEAT_PENALTY = typer.Option(SAMPLING.repeat_penalty, "--repeat-penalty", min=0.0,
                              help="Repetition penalty (1: off).")
REPEAT_LAST_N = typer.Option(SAMPLING.repeat_last_n, "--repeat-last-n", min=-1,
                             help="Tokens the penalties look back (-1: all).")
PRESENCE_PENALTY = typer.Option(SAMPLING.presence_penalty, "--presence-penalty", help="Presence penalty.")
FREQUENCY_PENALTY = typer.Option(SAMPLING.frequency_penalty, "--frequency-penalty", help="Frequency penalty.")
SEED = typer.Option(SAMPLING.seed, "--seed", min=0, max=2**63 - 1, help="Random seed (default: random).")
CTX = typer.Option(None, "-c", "--ctx", min=16, max=1 << 20, help="Context size (default: min(4096, the model's)).")
THREADS = typer.Option(None, "-t", "--threads", min=1, max=1024, help="Threads (default: all cores).")
SYSTEM = typer.Option(None, "--system", help="System message.")
CACHE_TYPE_K = typer.Option("f16", "-ctk", "--cache-type-k", help="KV cache type for K: f16, q8_0 or q4_0 "
                            "(llama.cpp's arithmetic; q8_0 halves the cache).")
CACHE_TYPE_V = typer.Option("f16", "-ctv", "--cache-type-v", help="KV cache type for V: f16, q8_0 or q4_0.")
DEVICE = typer.Option("auto", "--device", help="cpu, cuda, or auto (CUDA when numba-cuda finds a GPU).")
CHAT_TEMPLATE = typer.Option(None, "--chat-template", help="Jinja chat template file to use instead of the model's.")
DRAFT = typer.Option(None, "-md", "--draft", help="Speculative decoding: a smaller model of the same vocabulary "
                     "guesses tokens (output unchanged).", show_default=False)
DRAFT_MAX = typer.Option(SPECULATION.draft_max, "--draft-max", min=1, max=256,
                         help="Speculative decoding: tokens guessed a step, at most.")
DRAFT_MIN = typer.Option(SPECULATION.draft_min, "--draft-min", min=0, max=256,
                         help="Speculative decoding: fewer guesses than this are dropped.")
DRAFT_P_MIN = typer.Option(SPECULATION.p_min, "--draft-p-min", min=0.0, max=1.0,
                           help="Speculative decoding: the draft stops below this probability of its best token.")
LOOKUP = typer.Option(False, "--lookup", help="Speculative decoding by prompt lookup: guesses copied from the "
                      "prompt and the text so far (output unchanged).")
LOOKUP_NGRAM = typer.Option(SPECULATION.lookup_ngram, "--lookup-ngram", min=1, max=16,
                            help="With --lookup: the longest run of last tokens matched (down to 2; 1: single tokens).")


def sampling_params(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, presence_penalty,
                    frequency_penalty, seed) -> SamplingParams:
    return SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                          repeat_last_n=repeat_last_n, presence_penalty=presence_penalty,
                          frequency_penalty=frequency_penalty, seed=seed)


@dataclass
class Guessing:
    """Speculative decoding as the options ask for it: a draft model (-md) or prompt lookup
    (--lookup), guessing as params say."""
    draft: Optional[Path]
    lookup: bool
    params: SpeculationParams

    def load_draft(self, threads: Optional[int]):
        """The draft Model, loaded (None without -md)."""
        return load_model(self.draft, threads, "cpu") if self.draft is not None else None

    def speculation_for(self, model, n_ctx: int, threads: Optional[int]):
        """The Speculation for generations on model (None for plain decoding); loads the draft."""
        from ..speculative import make_speculation

        speculation = make_speculation(model, n_ctx, self.load_draft(threads), self.lookup, self.params)
        if speculation is not None and not speculation.active:
            err(f"notice: the draft is {speculation.guess_cost:.2f} of the model's size, too costly a guess to "
                "pay: decoding without it")
        return speculation


def need_model(model: Optional[Path], server: Optional[str], local_only: dict) -> None:
    """A model file or --server, not both; with --server, none of the options in local_only
    (option name -> whether it was given)."""
    if server is None:
        if model is None:
            raise typer.BadParameter("give a model file, or --server URL")
        return
    if model is not None:
        raise typer.BadParameter("give a model file or --server, not both")
    given = [name for name, used in local_only.items() if used]
    if given:
        raise typer.BadParameter(f"{given[0]} does not apply with --server (the server has its own settings)")
