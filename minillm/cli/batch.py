"""`minillm generate --batch-file FILE.jsonl`: many requests through the batching scheduler.

Each line is one JSON object, `{"id": ..., "prompt": "..."}` or `{"id": ..., "messages": [...]}`,
optionally with max_tokens, temperature, top_p, top_k, min_p, seed, stop, priority (and the
penalties); the command's flags are the defaults. stdout gets one JSON line per request in input
order: id, text, tokens (count), finish_reason, prompt_tokens; or id and error for a line that
cannot run, while the others still do. A progress bar goes to stderr.
"""
from __future__ import annotations

import json
import sys

from ..errors import MinillmError


def read_lines(path) -> list[tuple[int, str]]:
    """(line number, text) of the non-blank lines of path ('-': stdin)."""
    try:
        if str(path) == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as f:
                data = f.read()
    except OSError as exc:
        raise MinillmError(f"cannot read batch file {path}: {exc.strerror or exc}") from None
    text = data.decode("utf-8", errors="replace")
    return [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]


def parse_line(line: str, lineno: int):
    """The JSON object of one line (MinillmError if it is not one)."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise MinillmError(f"line {lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(item, dict):
        raise MinillmError(f"line {lineno}: expected a JSON object")
    return item


def run_batch_file(m, path, parallel: int, n_ctx, batch: int, defaults: dict, chat_messages=None,
                   draft=None, speculation: dict | None = None) -> int:
    """Run every line; print the records in input order as they complete. Exit status 0 only
    when every line succeeded. draft, speculation: Model.scheduler's."""
    from tqdm import tqdm

    from ..serving.batch_input import make_request

    scheduler = m.scheduler(parallel, n_ctx, batch, draft=draft, speculation=speculation)
    records: list[dict | None] = []
    handles = []
    for lineno, line in read_lines(path):
        record_id = lineno
        try:
            item = parse_line(line, lineno)
            record_id = item.get("id", lineno)
            if chat_messages is not None and isinstance(item.get("prompt"), str):
                item["messages"] = chat_messages(item.pop("prompt"))
            handles.append((len(records), scheduler.submit(make_request(item, id=lineno, **defaults))))
            records.append(None)
        except MinillmError as exc:
            message = str(exc) if str(exc).startswith("line ") else f"line {lineno}: {exc}"
            records.append({"id": record_id, "error": message})
    index_of = {id(h): i for i, h in handles}
    printed = 0
    failed = sum(r is not None for r in records)
    bar = tqdm(total=len(handles), unit="req", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)

    def flush() -> None:
        nonlocal printed
        while printed < len(records) and records[printed] is not None:
            print(json.dumps(records[printed], ensure_ascii=False), flush=True)
            printed += 1

    def on_finish(handle) -> None:
        nonlocal failed
        try:
            result = handle.result()
            records[index_of[id(handle)]] = {
                "id": handle.request.id, "text": result.text, "tokens": len(result.tokens),
                "finish_reason": result.finish_reason, "prompt_tokens": len(handle.prompt_ids)}
            if handle.request.lookup or handle.request.draft:
                records[index_of[id(handle)]].update(drafted_tokens=handle.timings.n_drafted,
                                                     accepted_tokens=handle.timings.n_accepted)
        except Exception as exc:  # a kernel error in its step: the others go on
            failed += 1
            records[index_of[id(handle)]] = {"id": handle.request.id, "error": str(exc)}
        bar.update(1)
        flush()

    flush()
    scheduler.run([h for _, h in handles], on_finish)
    bar.close()
    flush()
    return 1 if failed else 0
