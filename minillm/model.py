"""The engine's entry point: load a GGUF model and evaluate it."""
from __future__ import annotations

import os
import time
from pathlib import Path

import numba
import numpy as np

from .arch import get_architecture
from .backends import load_backend, resolve_device
from .errors import MinillmError
from .gguf_file import GGUFFile
from .hub import resolve_model
from .kv_cache import F16_CACHE, KVCache, check_cache_types
from .memory import release_compiler_pages
from .sequence import Result

DEFAULT_BATCH = 512
def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


class Model:
    """A loaded model. `logits(ids)` evaluates a fresh sequence."""

    def __init__(self, path: str | os.PathLike, threads: int | None = None, progress=None, device: str = "cpu",
                 cache_types: tuple[str, str] = F16_CACHE, on_compile=None):
        """on_compile: as warm_up's, for the kernels that compile while the weights load (the
        products of the model's formats, on a first run)."""
        t0 = time.perf_counter()
        release_compiler_pages()  # the compiler is initialized (by the imports): drop it before the weights
        self.path = resolve_model(path)  # a file, or REPO[:QUANT] fetched from the hub
        self.threads = threads or default_threads()
        self.use_threads()
        self.gguf = GGUFFile(self.path)
        self.arch = get_architecture(self.gguf.architecture)(self.gguf)
        self.hp = self.arch.hp
        self.device, self.device_notice = resolve_device(device)  # a notice when a GPU went unused
        self.cache_types = check_cache_types(cache_types, self.hp.head_dim)  # (K, V): -ctk, -ctv
        self.backend = load_backend(self.arch, self.device, self.cache_types, progress, on_compile)  # the weights
        self.backend.adapt_threads(min(self.threads, numba.config.NUMBA_NUM_THREADS))
        self.gguf.release_pages()
        self._tokenizer = None
        self._own_template = None  # the model's chat template, compiled on first use
        self.load_seconds = time.perf_counter() - t0

    def use_threads(self) -> None:
        """Numba's thread count is per calling thread: a thread that runs the kernels (the
        scheduler's) calls this first."""
        numba.set_num_threads(min(self.threads, numba.config.NUMBA_NUM_THREADS))

    def warm_up(self, on_compile=None) -> None:
        """Run one token through the model so that the compiled kernels are ready. The first run
        on a machine compiles the kernels (a few minutes): then the warm-up runs inside
        `on_compile()`, a context manager the caller supplies to show progress (the CLI's
        spinner); the engine itself never draws."""
        self.backend.warm_up(on_compile)

    @property
    def n_vocab(self) -> int:
        return self.hp.n_vocab

    def new_cache(self, n_ctx: int, n_keep: int = 0, batch_size: int = DEFAULT_BATCH) -> KVCache:
        """A KV cache of n_ctx positions (ring buffers: see kv_cache.py); n_keep sink tokens."""
        return self.backend.new_cache(n_ctx, n_keep, batch_size)

    def eval(self, ids, cache: KVCache, logits_from: int = 0, batch_size: int = DEFAULT_BATCH) -> np.ndarray:
        """Append ids to cache in batches; logits (len(ids) - logits_from, n_vocab)."""
        ids = self.check_ids(ids)
        forward = self.backend.forward
        out = []
        for b0 in range(0, len(ids), batch_size):
            chunk = ids[b0:b0 + batch_size]
            first = max(0, logits_from - b0)
            logits = forward(chunk, cache, min(first, len(chunk)))
            if logits.shape[0]:
                out.append(logits)
        if not out:
            return np.empty((0, self.n_vocab), np.float32)
        return out[0] if len(out) == 1 else np.concatenate(out)

    def logits(self, ids, start: int = 0, batch_size: int = DEFAULT_BATCH) -> np.ndarray:
        """Logits (len(ids) - start, n_vocab) of a fresh sequence, for positions start.. ."""
        ids = self.check_ids(ids)
        cache = self.new_cache(max(1, len(ids)))
        return self.eval(ids, cache, start, batch_size)

    # -- text ------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from .tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_gguf(self.gguf)
        return self._tokenizer

    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]:
        return self.tokenizer.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, ids) -> str:
        return self.tokenizer.detokenize(ids)

    def chat_template(self, override_path=None):
        """The model's chat template (or --chat-template FILE, or the plain format). The model's
        own is compiled once (2.5 ms for SmolLM2's: a server would pay it per request)."""
        from .chat_template import ChatTemplate

        if override_path is not None:
            return ChatTemplate.for_model(self.tokenizer, override_path)
        if self._own_template is None:
            self._own_template = ChatTemplate.for_model(self.tokenizer)
        return self._own_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            template_path=None) -> str:
        return self.chat_template(template_path).render(messages, add_generation_prompt=add_generation_prompt)

    def prompt_ids(self, prompt: str | list[dict], template_path=None) -> list[int]:
        """Token ids for a raw prompt (str) or a conversation (list of {role, content}), with
        the model's default BOS and special tokens parsed, as llama.cpp does."""
        if not isinstance(prompt, str):
            prompt = self.apply_chat_template(prompt, template_path=template_path)
        return self.tokenize(prompt, special=True)

    def generate(self, prompt: str | list[dict], max_tokens: int = 128, stream: bool = False,
                 stop: list[str] = (), n_ctx: int | None = None, truncate: bool = False,
                 draft: "Model | None" = None, lookup: bool = False, speculation: dict | None = None,
                 **sampling):
        """Generate from a prompt or a conversation. stream=True yields Chunk objects as they
        come; otherwise returns a Result with the whole text. sampling: SamplingParams fields.
        Speculative decoding (same tokens, or same distribution when sampling): draft, a smaller
        Model of the same vocabulary, or lookup=True (guesses copied from the prompt and text);
        speculation: SpeculationParams fields (draft_max, draft_min, p_min, lookup_ngram)."""
        from .generate import Session
        from .sampling import SamplingParams
        from .speculative import SpeculationParams, make_speculation

        session = Session(self, n_ctx=n_ctx)
        guessing = make_speculation(self, session.n_ctx, draft, lookup, SpeculationParams(**(speculation or {})))
        chunks = session.generate(self.prompt_ids(prompt), max_tokens, SamplingParams(**sampling),
                                  stop=list(stop), truncate=truncate, speculation=guessing)
        return chunks if stream else Result.collect(chunks)

    def scheduler(self, parallel: int = 4, n_ctx: int | None = None, batch: int | None = None,
                  kv_cells: int | None = None, policy: str = "priority", kv_memory: int | None = None,
                  draft: "Model | None" = None, speculation: dict | None = None):
        """A continuous-batching Scheduler over this model (see scheduler.py): submit() requests,
        iterate their handles for Chunks; `parallel` sequences decode in one pass. The KV pool
        holds kv_cells cells, or as many as kv_memory bytes hold (default: every slot's context).
        draft: a smaller Model of the same vocabulary, for requests with draft=True;
        speculation: SpeculationParams fields for requests that guess (lookup or draft)."""
        from .serving.scheduler import DEFAULT_CHUNK, Scheduler
        from .speculative import SpeculationParams

        return Scheduler(self, parallel, n_ctx, batch or DEFAULT_CHUNK, kv_cells, policy, kv_memory, draft,
                         SpeculationParams(**(speculation or {})))

    def generate_batch(self, prompts, max_tokens: int = 128, parallel: int = 4, n_ctx: int | None = None,
                       stop: list[str] = (), **sampling) -> list:
        """Results (in order) for many prompts generated together. Each prompt is text, a
        conversation, or a dict with `prompt` or `messages` and its own max_tokens, stop,
        priority and sampling fields (batch_input.FIELDS); the arguments are the defaults."""
        from .serving.batch_input import make_request
        from .sampling import SamplingParams

        scheduler = self.scheduler(parallel, n_ctx)
        defaults = SamplingParams(**sampling)
        handles = [scheduler.submit(make_request(p, max_tokens, defaults, stop)) for p in prompts]
        return [h.result() for h in handles]

    def check_ids(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_vocab):
            bad = int(ids[(ids < 0) | (ids >= self.n_vocab)][0])
            raise MinillmError(f"token id {bad} is outside the vocabulary (0..{self.n_vocab - 1})")
        return ids


def load(path: str | os.PathLike, threads: int | None = None, progress=None, device: str = "cpu") -> Model:
    """Load a GGUF model: a file, or REPO[:QUANT] on the Hugging Face Hub (downloaded once into its
    cache); device "cpu", "cuda" or "auto" (CUDA when a GPU is usable)."""
    return Model(path, threads=threads, progress=progress, device=device)
