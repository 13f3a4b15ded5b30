"""`minillm generate`: one-shot generation that shell scripts can rely on. stdout carries only
the generated text (streamed); notices and timings go to stderr; --json prints one object."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from .common import err
from ..params import SamplingParams, SpeculationParams


SAMPLING, SPECULATION = SamplingParams(), SpeculationParams()  # the defaults the options show

# options shared by `generate` and `chat` (typer Option objects can serve several commands)
MODEL = typer.Argument(..., help="Path to a .gguf model file.", show_default=False)
MODEL_OR_SERVER = typer.Argument(None, help="Path to a .gguf model file (none with --server).", show_default=False)
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


def sampling_options(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, presence_penalty,
                     frequency_penalty, seed) -> dict:
    return dict(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                repeat_last_n=repeat_last_n, presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty, seed=seed)


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


def _print_beam_search(model, ids, n_predict, beams, ctx, ignore_eos, as_json) -> None:
    from ..generate import beam_search

    tokens, logp = beam_search(model, ids, n_predict, beams, n_ctx=ctx, ignore_eos=ignore_eos)
    text = model.detokenize(tokens)
    if as_json:
        print(json.dumps({"text": text, "tokens": tokens, "logprob": logp, "beams": beams,
                          "prompt_tokens": len(ids), "generated_tokens": len(tokens)}, ensure_ascii=False))
    elif text:
        print(text)


def speculation_for(model, n_ctx: int, draft: Optional[Path], lookup: bool, draft_max: int, draft_min: int,
                    draft_p_min: float, lookup_ngram: int, threads: Optional[int]):
    """The Speculation the flags ask for (None for plain decoding); loads the draft model."""
    from .app import load_model
    from ..speculative import SpeculationParams, make_speculation

    params = SpeculationParams(draft_max, draft_min, draft_p_min, lookup_ngram)
    draft_model = load_model(draft, threads, "cpu") if draft is not None else None
    speculation = make_speculation(model, n_ctx, draft_model, lookup, params)
    if speculation is not None and not speculation.active:
        print(f"notice: the draft is {speculation.guess_cost:.2f} of the model's size, too costly a guess to pay: "
              "decoding without it", file=sys.stderr)
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


def _generate_on_server(server, api_key, prompt, n_predict, params, stop, ignore_eos, as_json, verbose) -> None:
    """generate's output contract, with the work done by a running server."""
    from .remote import ServerClient, request_body

    client = ServerClient(server, api_key)
    if as_json:
        chat = not isinstance(prompt, str)
        body = dict(request_body(prompt, n_predict, params, stop, ignore_eos), return_tokens=True)
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
    last, wrote = None, False
    for last in client.chunks(prompt, n_predict, params, stop, ignore_eos):
        if last.text:
            sys.stdout.write(last.text)
            sys.stdout.flush()
            wrote = True
    if wrote:
        sys.stdout.write("\n")
        sys.stdout.flush()
    if verbose:
        t = last.timings
        err(f"prompt: {t.n_prompt} tokens; generated {t.n_generated} tokens; finish: {last.finish_reason}; "
            f"seed {params.seed}; on {server}")


def register(app: typer.Typer) -> None:
    @app.command()
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

        from .app import load_model
        from ..generate import Session
        from ..sampling import SamplingParams
        from ..speculative import guess_summary

        need_model(model, server, {"--ctx": ctx is not None, "--threads": threads is not None,
                                   "--device": device != "auto", "--chat-template": chat_template is not None,
                                   "--truncate": truncate, "--beams": beams > 1, "--batch-file": batch_file is not None,
                                   "--draft": draft is not None, "--lookup": lookup,
                                   "--cache-type-k": cache_type_k != "f16", "--cache-type-v": cache_type_v != "f16"})
        cache_types = (cache_type_k, cache_type_v)
        if (draft is not None or lookup) and beams > 1:
            raise typer.BadParameter("--draft and --lookup apply to sampling and greedy generation, not --beams")
        if draft is not None and lookup:
            raise typer.BadParameter("--draft and --lookup: choose one")

        if batch_file is not None:
            if prompt is not None or file is not None or beams > 1 or truncate:
                raise typer.BadParameter("--batch-file takes its prompts from the file: no -p, -f, --beams "
                                         "or --truncate")
            params = SamplingParams(**sampling_options(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n,
                                                       presence_penalty, frequency_penalty, seed))
            m = load_model(model, threads, "cpu" if device == "auto" else device, cache_types)
            chat_messages = None
            if chat or system is not None:
                def chat_messages(text):
                    return ([{"role": "system", "content": system}] if system is not None else []) + [
                        {"role": "user", "content": text}]
            from .batch import run_batch_file

            defaults = dict(max_tokens=n_predict, sampling=params, stop=stop, ignore_eos=ignore_eos, lookup=lookup,
                            draft=draft is not None)
            draft_model = load_model(draft, threads, "cpu") if draft is not None else None
            speculation = dict(draft_max=draft_max, draft_min=draft_min, p_min=draft_p_min, lookup_ngram=lookup_ngram)
            raise typer.Exit(run_batch_file(m, batch_file, parallel, ctx, batch, defaults, chat_messages,
                                            draft_model, speculation))

        text = read_prompt(prompt, file)
        seed = seed if seed is not None else random.SystemRandom().randrange(2**31)
        params = SamplingParams(**sampling_options(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n,
                                                   presence_penalty, frequency_penalty, seed))
        messages = None
        if chat or system is not None or chat_template is not None:
            messages = ([{"role": "system", "content": system}] if system is not None else [])
            messages.append({"role": "user", "content": text})
        if server is not None:
            _generate_on_server(server, api_key, messages or text, n_predict, params, stop, ignore_eos, as_json,
                                verbose)
            return
        m = load_model(model, threads, device, cache_types)
        ids = m.prompt_ids(messages or text, template_path=chat_template)
        if beams > 1:
            _print_beam_search(m, ids, n_predict, beams, ctx, ignore_eos, as_json)
            return
        session = Session(m, n_ctx=ctx)
        speculation = speculation_for(m, session.n_ctx, draft, lookup, draft_max, draft_min, draft_p_min,
                                      lookup_ngram, threads)
        pieces, tokens, last, wrote = [], [], None, False
        for last in session.generate(ids, n_predict, params, stop=stop, truncate=truncate,
                                     ignore_eos=ignore_eos, speculation=speculation):
            if last.token is not None:
                tokens.append(last.token)
            if as_json:
                pieces.append(last.text)
            elif last.text:
                sys.stdout.write(last.text)
                sys.stdout.flush()
                wrote = True
        t = last.timings
        if as_json:
            print(json.dumps({
                "text": "".join(pieces), "finish_reason": last.finish_reason, "seed": seed,
                "prompt_tokens": len(ids), "generated_tokens": t.n_generated, "tokens": tokens,
                "prompt_tokens_per_s": round(t.prompt_tokens_per_s, 2),
                "generate_tokens_per_s": round(t.generate_tokens_per_s, 2),
                "load_s": round(m.load_seconds, 3),
                **({"drafted_tokens": t.n_drafted, "accepted_tokens": t.n_accepted} if speculation else {}),
            }, ensure_ascii=False))
        else:
            if wrote:
                sys.stdout.write("\n")
                sys.stdout.flush()
        if verbose:
            err(f"prompt: {len(ids)} tokens ({t.n_prompt} evaluated) at {t.prompt_tokens_per_s:.1f} tok/s; "
                f"generated {t.n_generated} tokens at {t.generate_tokens_per_s:.1f} tok/s; "
                f"finish: {last.finish_reason}; seed {seed}; load {m.load_seconds:.2f} s{guess_summary(t)}")
