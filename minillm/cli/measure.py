"""`minillm bench` and `minillm perplexity`: a model's speed, as llama-bench and
llama-batched-bench measure it, and its perplexity and KL divergence, as llama-perplexity's."""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Optional

import typer

from .common import compile_notice, err, load_model
from .models import takes_model
from .options import CACHE_TYPE_K, CACHE_TYPE_V, MODEL
from ..errors import MinillmError


def register_bench(app: typer.Typer) -> None:
    """Add the `bench` command to `app`."""
    app.command("bench")(takes_model()(bench_command))


def register_perplexity(app: typer.Typer) -> None:
    """Add the `perplexity` command to `app`."""
    app.command("perplexity")(takes_model()(perplexity_command))


def bench_command(
    model: Optional[Path] = MODEL,
    n_prompt: Optional[int] = typer.Option(None, "-p", "--n-prompt", min=0, max=1 << 16,
                                           help="Prompt tokens (prefill) [default: 512; 128 with --parallel]."),
    n_gen: int = typer.Option(128, "-n", "--n-gen", min=0, max=1 << 16, help="Tokens to decode."),
    reps: int = typer.Option(1, "-r", "--reps", min=1, max=100, help="Repetitions (best is reported; with "
                             "--parallel the levels run in turn and each reports its median)."),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", min=1, max=1024, help="Threads."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda, or auto."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    parallel: Optional[str] = typer.Option(
        None, "--parallel", help="Sequences at once, e.g. 1,2,4,8,16: aggregate throughput of batched "
        "generation, as llama-batched-bench (prompt -p, default 128; -n tokens each)."),
    draft: Optional[Path] = typer.Option(None, "-md", "--draft", help="Speculative decoding with this draft "
                                         "model beside plain decoding, on built-in chat prompts.", show_default=False),
    lookup: bool = typer.Option(False, "--lookup", help="Speculative decoding by prompt lookup beside plain "
                                "decoding, on built-in chat prompts."),
    depth: int = typer.Option(0, "-d", "--depth", min=0, max=1 << 20,
                              help="Tokens already in the cache before each test, as llama-bench -d."),
    cache_type_k: str = CACHE_TYPE_K,
    cache_type_v: str = CACHE_TYPE_V,
):
    """Measure load time, prefill (pp) and decode (tg) speed, like llama-bench."""
    gc.enable()  # off while commands start (main); bench times no start, and may run long
    if draft is not None or lookup:
        _bench_speculative(model, draft, lookup, n_gen, reps, threads, as_json)
        return
    if parallel is not None:
        _bench_parallel(model, parallel, 128 if n_prompt is None else n_prompt, n_gen, reps, threads, device, as_json)
        return
    n_prompt = 512 if n_prompt is None else n_prompt
    from .bench import run_bench

    result = run_bench(model, n_prompt, n_gen, reps, threads, on_compile=compile_notice, device=device,
                       cache_types=(cache_type_k, cache_type_v), depth=depth)
    if as_json:
        print(json.dumps(result))
    else:
        at = f" @ d{depth}" if depth else ""
        print(f"model {result['model']}  threads {result['threads']}  load {result['load_s']:.2f} s  "
              f"KV cache {cache_type_k}/{cache_type_v} {result['kv_cache_bytes'] / 2**20:.2f} MiB")
        if n_prompt:
            print(f"pp{n_prompt}{at}: {result['pp_tokens_per_s']:.1f} tokens/s")
        if n_gen:
            print(f"tg{n_gen}{at}: {result['tg_tokens_per_s']:.1f} tokens/s")


def _bench_speculative(model: Path, draft: Optional[Path], lookup: bool, n_gen: int, reps: int, threads,
                       as_json: bool) -> None:
    from .bench_speculative import load, print_result, run_speculative_bench

    if draft is not None and lookup:
        raise typer.BadParameter("--draft and --lookup: choose one")
    draft_model = load(draft, threads, compile_notice) if draft is not None else None
    result = run_speculative_bench(load(model, threads, compile_notice), n_gen, max(reps, 2), draft_model, lookup)
    if as_json:
        print(json.dumps(result))
    else:
        print_result(result)


def _bench_parallel(model: Path, levels: str, n_prompt: int, n_gen: int, reps: int, threads, device: str,
                    as_json: bool) -> None:
    from .bench import run_parallel_bench

    try:
        counts = [int(v) for v in levels.split(",")]
    except ValueError:
        counts = []
    if not counts or not all(1 <= n <= 256 for n in counts):
        raise typer.BadParameter(f"--parallel takes counts from 1 to 256 separated by commas, not {levels!r}")
    if n_prompt < 1 or n_gen < 1:
        raise typer.BadParameter("--parallel needs -p and -n of at least 1")
    result = run_parallel_bench(model, counts, n_prompt, n_gen, threads, on_compile=compile_notice, device=device,
                                reps=reps)
    if as_json:
        print(json.dumps(result))
        return
    runs = f"  medians of {reps} runs, the levels in turn" if reps > 1 else ""
    print(f"model {result['model']}  threads {result['threads']}  prompt {n_prompt}  generate {n_gen} a sequence"
          + runs)
    print(f"{'parallel':>8} {'t_pp s':>8} {'S_PP t/s':>9} {'t_tg s':>8} {'S_TG t/s':>9}")
    for level in result["levels"]:
        print(f"{level['parallel']:>8} {level['t_pp']:>8.3f} {level['s_pp']:>9.1f} {level['t_tg']:>8.3f} "
              f"{level['s_tg']:>9.1f}")
    a = result["admission"]
    print(f"a stream while a {a['prompt']}-token prompt is admitted beside it: gaps median {a['median_ms']:.1f} ms, "
          f"p99 {a['p99_ms']:.1f} ms ({a['p99_over_median']:.2f}x that median, {a['p99_over_median_alone']:.2f}x "
          f"its median alone, {a['median_alone_ms']:.1f} ms)")


def perplexity_command(
    model: Optional[Path] = MODEL,
    file: Optional[Path] = typer.Option(None, "-f", "--file", help="Text file to score.", show_default=False),
    n_ctx: int = typer.Option(512, "-c", "--ctx", min=16, max=1 << 16, help="Tokens per chunk."),
    chunks: Optional[int] = typer.Option(None, "--chunks", min=1, help="Score only the first N chunks."),
    kld_base: Optional[Path] = typer.Option(
        None, "--kl-divergence-base", metavar="FILE", show_default=False,
        help="With -f: save every scored position's log-probabilities to FILE (llama-perplexity's "
             "format). With --kl-divergence: the file to compare against."),
    kld: bool = typer.Option(False, "--kl-divergence",
                             help="Compare MODEL with --kl-divergence-base FILE over the file's own tokens: "
                                  "KL divergence, top-1 agreement, perplexity ratio."),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", min=1, max=1024, help="Threads."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda, or auto."),
    cache_type_k: str = CACHE_TYPE_K,
    cache_type_v: str = CACHE_TYPE_V,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """Perplexity of a text, with llama-perplexity's protocol; prints `PPL = X`. With
    --kl-divergence-base and --kl-divergence, how far MODEL's predictions are from a base model's."""
    if kld:
        if kld_base is None:
            raise MinillmError("--kl-divergence needs --kl-divergence-base FILE (written by a run with -f)")
        return _kl_divergence(model, kld_base, threads, device, (cache_type_k, cache_type_v), as_json)
    if file is None:
        raise MinillmError("no text to score: pass -f FILE")
    from ..quality.perplexity import perplexity as run

    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise MinillmError(f"cannot read {file}: {exc}") from None
    m = load_model(model, threads, device, (cache_type_k, cache_type_v))
    with _chunk_bar(as_json) as bar:
        def progress(done, total, ppl):
            bar.total = total
            bar.update(1)
            bar.set_postfix(ppl=f"{ppl:.4f}")

        result = run(m, text, n_ctx, progress, n_chunks=chunks, kld_base=kld_base)
    if kld_base is not None:
        err(f"saved the log-probabilities of {result.n_scored} positions to {kld_base}")
    if as_json:
        print(json.dumps({"ppl": result.ppl, "n_ctx": n_ctx, "n_chunks": result.n_chunks,
                          "n_scored": result.n_scored, "chunk_ppl": result.chunk_ppl}))
    else:
        print(f"PPL = {result.ppl:.4f}")


def _chunk_bar(quiet: bool):
    from tqdm import tqdm

    return tqdm(total=None, unit="chunk", file=sys.stderr, disable=quiet)


def _kl_divergence(model: Path, base: Path, threads, device: str, cache_types, as_json: bool) -> None:
    from ..quality.kl_divergence import BaseFile, mean_and_uncertainty
    from ..quality.perplexity import kl_divergence

    base_file = BaseFile.open(base)
    m = load_model(model, threads, device, cache_types)
    with _chunk_bar(as_json) as bar:
        def progress(done, total, sums):
            bar.total = total
            bar.update(1)
            bar.set_postfix(kld=f"{mean_and_uncertainty(sums.sum_kld, sums.sum_kld2, sums.count)[0]:.5f}",
                            same_top=f"{sums.n_same_top / sums.count:.2%}")

        result = kl_divergence(m, base_file, progress)
    if as_json:
        print(json.dumps(result.figures()))
    else:
        print("\n".join(result.report_lines()))
