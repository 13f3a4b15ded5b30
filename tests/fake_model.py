"""A stand-in for a Model that the scheduler can run without kernels or a model file: a backend
whose forward_rows returns scripted logits, a tokenizer whose pieces name the token ids, and
a one-layer architecture for the KV pool's bookkeeping. Scheduler logic (admission, budgets,
priorities, preemption, cancel, finish reasons) is then tested in milliseconds."""
from __future__ import annotations

import numpy as np

from minillm.arch.base import HParams
from minillm.backends import NotOnThisBackend
from minillm.kv_cache import F16_CACHE

N_VOCAB = 64
EOS = 0


class FakeDecoder:
    def feed(self, token: int) -> str:
        return f" t{token}"

    def flush(self) -> str:
        return ""


class FakeTokenizer:
    eog_ids = {EOS}

    def stream_decoder(self) -> FakeDecoder:
        return FakeDecoder()


class FakeArch:
    """One layer, one KV head of 32 values: what KVPool needs to lay out its cells."""

    def __init__(self, n_ctx_train: int):
        self.hp = HParams(n_vocab=N_VOCAB, n_embd=32, n_layer=1, n_head=1, n_head_kv=1, head_dim=32, n_ff=64,
                          n_ctx_train=n_ctx_train, rms_eps=1e-6, rope_base=10000.0, rope_dims=32)

    def cache_layout(self, n_ctx: int, n_batch: int):
        return {"global": n_ctx}, ["global"]

    def cache_windows(self) -> dict:
        return {}

    def recurrent_shapes(self):
        return None  # every layer keeps a KV cache


def next_token(token: int, position: int) -> int:
    """The scripted model: after token t (at any position) comes t + 1, skipping the end token,
    except where the script says otherwise (FakeBackend.eos_after)."""
    return token % (N_VOCAB - 1) + 1


class FakeBackend:
    """forward_rows gives each row the logits whose argmax is next_token(id, position) (the
    end token after any id in eos_after); it records every call's rows and can fail once."""
    device = "fake"

    def __init__(self, arch: FakeArch):
        self.arch = arch
        self.steps: list[int] = []      # rows evaluated by each forward_rows call
        self.eos_after: set[int] = set()
        self.fail_next: Exception | None = None

    def check_supports(self, feature: str) -> None:
        if feature != "rows":
            raise NotOnThisBackend(f"{feature} does not run on the fake backend")

    def attention_address(self, cache_dtype) -> int:
        return 0  # (its passes attend nowhere)

    def pool_budget(self) -> None:
        return None

    def pool_arrays(self, row_counts: list[int], cache_type: str) -> list[np.ndarray]:
        return [np.zeros((n, 1, 32), np.uint16) for n in row_counts]

    def forward_rows(self, ids, positions, kv_of, out_from: int, n_ctx: int) -> np.ndarray:
        kv_of(0)  # the pool's views must be buildable for every row
        self.steps.append(len(ids))
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        logits = np.zeros((len(ids) - out_from, N_VOCAB), np.float32)
        for row, (token, position) in enumerate(zip(ids[out_from:], positions[out_from:])):
            logits[row, EOS if int(token) in self.eos_after else next_token(int(token), int(position))] = 1.0
        return logits


class FakeModel:
    """What Scheduler reads of a Model. Prompts are token ids; text prompts are refused."""

    def __init__(self, n_ctx_train: int = 512):
        self.arch = FakeArch(n_ctx_train)
        self.hp = self.arch.hp
        self.backend = FakeBackend(self.arch)
        self.tokenizer = FakeTokenizer()
        self.cache_types = F16_CACHE
        self.n_vocab = N_VOCAB

    def check_ids(self, ids) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        assert ids.min() >= 0 and ids.max() < N_VOCAB
        return ids

    def prompt_ids(self, prompt) -> list[int]:
        raise AssertionError("the fake model takes token ids only")

    def use_threads(self) -> None:
        pass


def continuation(prompt: list[int], n: int) -> list[int]:
    """The n tokens the scripted model generates after prompt (greedy, no end token)."""
    out, token = [], prompt[-1]
    for i in range(n):
        token = next_token(token, len(prompt) + i - 1)
        out.append(token)
    return out
