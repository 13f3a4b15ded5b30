"""`minillm generate`: one-shot generation that shell scripts can rely on. stdout carries only
the generated text (streamed); notices and timings go to stderr; --json prints one object."""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import List, Optional

import typer

from .common import err, load_model
from .models import takes_model
from .options import (
    API_KEY, CACHE_TYPE_K, CACHE_TYPE_V, CHAT_TEMPLATE, CTX, DEVICE, DRAFT, DRAFT_MAX, DRAFT_MIN, DRAFT_P_MIN,
    FREQUENCY_PENALTY, LOOKUP, LOOKUP_NGRAM, MIN_P, MODEL_OR_SERVER, PRESENCE_PENALTY, REPEAT_LAST_N, REPEAT_PENALTY,
    SEED, SERVER, SYSTEM, TEMP, THREADS, TOP_K, TOP_P, Guessing, need_model, sampling_params,
)
from ..params import SamplingParams, SpeculationParams


@dataclass
class Ask:
    """What a generation asks for in every mode: -n, the sampling options, --stop, --ignore-eos."""
    n_predict: int
    sampling: SamplingParams
    stop: List[str]
    ignore_eos: bool


def read_prompt(prompt: Optional[str], file: Optional[Path]) -> str:
    from ..errors import MinillmError

    if prompt is not None and file is not None:
        raise typer.BadParameter("give either -p or -f, not both")
    if prompt is not None:
        return prompt
    if file is not None:
        try:
            return file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise MinillmError(f"cannot read prompt file {file}: {exc}") from None
    if sys.stdin is None or sys.stdin.isatty():
        raise typer.BadParameter("no prompt: give -p TEXT, -f FILE, or pipe text on stdin")
    return sys.stdin.read()


def chat_messages(text: str, system: Optional[str]) -> list[dict]:
    """text as one user message, after the system message if there is one."""
    return ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": text}]


def _check_modes(prompt, file, beams: int, truncate: bool, batch_file, guessing: Guessing) -> None:
    """The options that do not go together: speculation with beams, or with both guessers;
    --batch-file with a prompt or the options of one prompt."""
    if (guessing.draft is not None or guessing.lookup) and beams > 1:
        raise typer.BadParameter("--draft and --lookup apply to sampling and greedy generation, not --beams")
    if guessing.draft is not None and guessing.lookup:
        raise typer.BadParameter("--draft and --lookup: choose one")
    if batch_file is not None and (prompt is not None or file is not None or beams > 1 or truncate):
        raise typer.BadParameter("--batch-file takes its prompts from the file: no -p, -f, --beams or --truncate")


def _write_stream(chunks):
    """Write each chunk's text to stdout as it comes, and a newline after any text; the last chunk."""
    last, wrote = None, False
    for last in chunks:
        if last.text:
            sys.stdout.write(last.text)
            sys.stdout.flush()
            wrote = True
    if wrote:
        sys.stdout.write("\n")
        sys.stdout.flush()
    return last


def _generate_batch_file(model, batch_file: Path, parallel: int, ctx: Optional[int], batch: int, ask: Ask,
                         guessing: Guessing, threads: Optional[int], as_messages) -> int:
    """--batch-file: every line's request through the scheduler on the loaded model; the exit
    status. as_messages: makes a line's prompt text into chat messages (None: sent as text)."""
    from .batch import run_batch_file

    defaults = dict(max_tokens=ask.n_predict, sampling=ask.sampling, stop=ask.stop, ignore_eos=ask.ignore_eos,
                    lookup=guessing.lookup, draft=guessing.draft is not None)
    return run_batch_file(model, batch_file, parallel, ctx, batch, defaults, as_messages,
                          guessing.load_draft(threads), asdict(guessing.params))


def _generate_on_server(server: str, api_key: Optional[str], prompt, ask: Ask, as_json: bool, verbose: bool) -> None:
    """generate's output contract, with the work done by a running server."""
    from .remote import ServerClient, request_body

    client = ServerClient(server, api_key)
    params = ask.sampling
    if as_json:
        chat = not isinstance(prompt, str)
        body = dict(request_body(prompt, ask.n_predict, params, ask.stop, ask.ignore_eos), return_tokens=True)
        answer = client.complete("/v1/chat/completions" if chat else "/v1/completions", body)
        choice, usage, timings = answer["choices"][0], answer["usage"], answer.get("timings", {})
        print(json.dumps({
            "text": choice["message"]["content"] if chat else choice["text"],
            "finish_reason": choice["finish_reason"], "seed": params.seed,
            "prompt_tokens": usage["prompt_tokens"], "generated_tokens": usage["completion_tokens"],
            "tokens": choice.get("tokens", []),
            "prompt_tokens_per_s": round(timings.get("prompt_per_second", 0.0), 2),
            "generate_tokens_per_s": round(timings.get("predicted_per_second", 0.0), 2), "load_s": 0.0,
        }, ensure_ascii=False))
        return
    last = _write_stream(client.chunks(prompt, ask.n_predict, params, ask.stop, ask.ignore_eos))
    if verbose:
        t = last.timings
        err(f"prompt: {t.n_prompt} tokens; generated {t.n_generated} tokens; finish: {last.finish_reason}; "
            f"seed {params.seed}; on {server}")


def _print_beam_search(model, ids: list[int], ask: Ask, beams: int, ctx: Optional[int], as_json: bool) -> None:
    from ..generate import beam_search

    tokens, logp = beam_search(model, ids, ask.n_predict, beams, n_ctx=ctx, ignore_eos=ask.ignore_eos)
    text = model.detokenize(tokens)
    if as_json:
        print(json.dumps({"text": text, "tokens": tokens, "logprob": logp, "beams": beams,
                          "prompt_tokens": len(ids), "generated_tokens": len(tokens)}, ensure_ascii=False))
    elif text:
        print(text)


def _generate_here(model, ids: list[int], ask: Ask, ctx: Optional[int], truncate: bool, guessing: Guessing,
                   threads: Optional[int], as_json: bool, verbose: bool) -> None:
    """Generation on the loaded model, sampled or greedy: streamed text, or one JSON object."""
    from ..generate import Session
    from ..speculative import guess_summary

    session = Session(model, n_ctx=ctx)
    speculation = guessing.speculation_for(model, session.n_ctx, threads)
    chunks = session.generate(ids, ask.n_predict, ask.sampling, stop=ask.stop, truncate=truncate,
                              ignore_eos=ask.ignore_eos, speculation=speculation)
    if as_json:
        last = _print_json(model, ids, chunks, ask.sampling.seed, speculation is not None)
    else:
        last = _write_stream(chunks)
    if verbose:
        t = last.timings
        err(f"prompt: {len(ids)} tokens ({t.n_prompt} evaluated) at {t.prompt_tokens_per_s:.1f} tok/s; "
            f"generated {t.n_generated} tokens at {t.generate_tokens_per_s:.1f} tok/s; "
            f"finish: {last.finish_reason}; seed {ask.sampling.seed}; load {model.load_seconds:.2f} s"
            f"{guess_summary(t)}")


def _print_json(model, ids: list[int], chunks, seed: int, speculating: bool):
    """--json: the whole generation as one object once it ends; the last chunk."""
    pieces, tokens, last = [], [], None
    for last in chunks:
        if last.token is not None:
            tokens.append(last.token)
        pieces.append(last.text)
    t = last.timings
    print(json.dumps({
        "text": "".join(pieces), "finish_reason": last.finish_reason, "seed": seed,
        "prompt_tokens": len(ids), "generated_tokens": t.n_generated, "tokens": tokens,
        "prompt_tokens_per_s": round(t.prompt_tokens_per_s, 2),
        "generate_tokens_per_s": round(t.generate_tokens_per_s, 2),
        "load_s": round(model.load_seconds, 3),
        **({"drafted_tokens": t.n_drafted, "accepted_tokens": t.n_accepted} if speculating else {}),
    }, ensure_ascii=False))
    return last


def register(app: typer.Typer) -> None:
    @app.command()
    @takes_model(required=False)
    def generate(
        model: Optional[Path] = MODEL_OR_SERVER,
        prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="Prompt text."),
        file: Optional[Path] = typer.Option(None, "-f", "--file", help="Read the prompt from a file."),
        n_predict: int = typer.Option(256, "-n", "--n-predict", min=0, max=1 << 24, help="Tokens to generate at most."),
        temp: float = TEMP,
        top_k: int = TOP_K,
        top_p: float = TOP_P,
        min_p: float = MIN_P,
        repeat_penalty: float = REPEAT_PENALTY,
        repeat_last_n: int = REPEAT_LAST_N,
        presence_penalty: float = PRESENCE_PENALTY,
        frequency_penalty: float = FREQUENCY_PENALTY,
        seed: Optional[int] = SEED,
        stop: List[str] = typer.Option([], "--stop", help="Stop at this text (repeatable)."),
        ctx: Optional[int] = CTX,
        threads: Optional[int] = THREADS,
        device: str = DEVICE,
        cache_type_k: str = CACHE_TYPE_K,
        cache_type_v: str = CACHE_TYPE_V,
        chat: bool = typer.Option(False, "--chat", help="Send the prompt as one user message through the chat template."),
        system: Optional[str] = SYSTEM,
        chat_template: Optional[Path] = CHAT_TEMPLATE,
        truncate: bool = typer.Option(False, "--truncate", help="Keep the end of a prompt longer than the context."),
        ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Do not stop at end-of-generation tokens."),
        beams: int = typer.Option(1, "--beams", min=1, max=64, help="Beam search with N beams (not streamed)."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
        verbose: bool = typer.Option(False, "-v", "--verbose", help="Timings and notices on stderr."),
        batch_file: Optional[Path] = typer.Option(
            None, "--batch-file", help="Run the requests of a JSONL file ('-': stdin) together: one JSON "
            "result line each, in order."),
        parallel: int = typer.Option(4, "--parallel", min=1, max=256, help="With --batch-file: sequences at once."),
        batch: int = typer.Option(512, "--batch", min=1, max=1 << 16,
                                  help="With --batch-file: prompt tokens evaluated a step, at most."),
        server: Optional[str] = SERVER,
        api_key: Optional[str] = API_KEY,
        draft: Optional[Path] = DRAFT,
        draft_max: int = DRAFT_MAX,
        draft_min: int = DRAFT_MIN,
        draft_p_min: float = DRAFT_P_MIN,
        lookup: bool = LOOKUP,
        lookup_ngram: int = LOOKUP_NGRAM,
    ):
        """Generate text from a prompt (-p, -f or stdin), or for every line of --batch-file."""
        import random


        need_model(model, server, {"--ctx": ctx is not None, "--threads": threads is not None,
                                   "--device": device != "auto", "--chat-template": chat_template is not None,
                                   "--truncate": truncate, "--beams": beams > 1, "--batch-file": batch_file is not None,
                                   "--draft": draft is not None, "--lookup": lookup,
                                   "--cache-type-k": cache_type_k != "f16", "--cache-type-v": cache_type_v != "f16"})
        guessing = Guessing(draft, lookup, SpeculationParams(draft_max, draft_min, draft_p_min, lookup_ngram))
        _check_modes(prompt, file, beams, truncate, batch_file, guessing)
        ask = Ask(n_predict, sampling_params(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n,
                                             presence_penalty, frequency_penalty, seed), stop, ignore_eos)
        cache_types = (cache_type_k, cache_type_v)
        if batch_file is not None:  # each request without a seed draws its own
            m = load_model(model, threads, device, cache_types)
            as_messages = partial(chat_messages, system=system) if chat or system is not None else None
            raise typer.Exit(_generate_batch_file(m, batch_file, parallel, ctx, batch, ask, guessing, threads,
                                                  as_messages))
        text = read_prompt(prompt, file)
        if ask.sampling.seed is None:  # drawn here, so that the output can name it
            ask.sampling.seed = random.SystemRandom().randrange(2**31)
        as_chat = chat or system is not None or chat_template is not None
        prompt_or_messages = chat_messages(text, system) if as_chat else text
        if server is not None:
            _generate_on_server(server, api_key, prompt_or_messages, ask, as_json, verbose)
            return
        m = load_model(model, threads, device, cache_types)
        ids = m.prompt_ids(prompt_or_messages, template_path=chat_template)
        if beams > 1:
            _print_beam_search(m, ids, ask, beams, ctx, as_json)
        else:
            _generate_here(m, ids, ask, ctx, truncate, guessing, threads, as_json, verbose)
