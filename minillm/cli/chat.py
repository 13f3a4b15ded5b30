"""`minillm chat`: the terminal chat (or, with stdin not a terminal, one answer to the piped text)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from .options import (
    API_KEY, CACHE_TYPE_K, CACHE_TYPE_V, CHAT_TEMPLATE, CTX, DEVICE, DRAFT, DRAFT_MAX, DRAFT_MIN, DRAFT_P_MIN,
    FREQUENCY_PENALTY, LOOKUP, LOOKUP_NGRAM, MIN_P, MODEL_OR_SERVER, PRESENCE_PENALTY, REPEAT_LAST_N, REPEAT_PENALTY,
    SEED, SERVER, SYSTEM, TEMP, THREADS, TOP_K, TOP_P, Guessing, need_model, sampling_params,
)
from .common import load_model
from .models import takes_model
from ..params import SpeculationParams


def register(app: typer.Typer) -> None:
    @app.command()
    @takes_model(required=False)
    def chat(
        model: Optional[Path] = MODEL_OR_SERVER,
        n_predict: int = typer.Option(512, "-n", "--n-predict", min=1, max=1 << 24, help="Tokens per reply at most."),
        temp: float = TEMP,
        top_k: int = TOP_K,
        top_p: float = TOP_P,
        min_p: float = MIN_P,
        repeat_penalty: float = REPEAT_PENALTY,
        repeat_last_n: int = REPEAT_LAST_N,
        presence_penalty: float = PRESENCE_PENALTY,
        frequency_penalty: float = FREQUENCY_PENALTY,
        seed: Optional[int] = SEED,
        ctx: Optional[int] = CTX,
        threads: Optional[int] = THREADS,
        device: str = DEVICE,
        cache_type_k: str = CACHE_TYPE_K,
        cache_type_v: str = CACHE_TYPE_V,
        system: Optional[str] = SYSTEM,
        chat_template: Optional[Path] = CHAT_TEMPLATE,
        verbose: bool = typer.Option(False, "-v", "--verbose", help="Show tokens/s after each reply."),
        server: Optional[str] = SERVER,
        api_key: Optional[str] = API_KEY,
        draft: Optional[Path] = DRAFT,
        draft_max: int = DRAFT_MAX,
        draft_min: int = DRAFT_MIN,
        draft_p_min: float = DRAFT_P_MIN,
        lookup: bool = LOOKUP,
        lookup_ngram: int = LOOKUP_NGRAM,
    ):
        """Chat with a model in the terminal (loaded here, or running in `minillm serve`)."""
        from .repl import Chat, LocalReplies, RemoteReplies, repl

        need_model(model, server, {"--ctx": ctx is not None, "--threads": threads is not None,
                                   "--device": device != "auto", "--chat-template": chat_template is not None,
                                   "--draft": draft is not None, "--lookup": lookup,
                                   "--cache-type-k": cache_type_k != "f16", "--cache-type-v": cache_type_v != "f16"})
        params = sampling_params(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, presence_penalty,
                                 frequency_penalty, seed)
        if server is not None:
            from .remote import ServerClient

            replies = RemoteReplies(ServerClient(server, api_key))
        else:
            replies = LocalReplies(load_model(model, threads, device, (cache_type_k, cache_type_v)), ctx, chat_template)
            guessing = Guessing(draft, lookup, SpeculationParams(draft_max, draft_min, draft_p_min, lookup_ngram))
            replies.speculation = guessing.speculation_for(replies.model, replies.session.n_ctx, threads)
        session = Chat(replies, params, n_predict=n_predict, system=system, verbose=verbose)
        if not sys.stdin.isatty():
            text = sys.stdin.read().strip()
            if text:
                session.reply(text)
            return
        repl(session)
