"""The OpenAI API as `minillm serve` speaks it: a JSON body checked field by field into a
scheduler Request (ApiError names the bad field), and the answers built from Chunks: whole
completions, stream chunks, usage, errors. Plain data in and out: no HTTP here."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, replace

from .batch_input import SAMPLING_FIELDS, is_integer
from ..sampling import SamplingParams
from .scheduler import Request

MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20
# fields that would change what an answer means, which this server does not implement
UNSUPPORTED = ("tools", "functions", "logit_bias", "suffix", "echo")
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}


class ApiError(Exception):
    """An answer other than 200: its status, the OpenAI error object, extra headers."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
             503: "unavailable_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"malformed JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


@dataclass
class Completion:
    """A parsed completion request: what to run and how to answer."""
    request: Request
    chat: bool
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    return_tokens: bool = False    # llama-server's extra: the generated token ids in the answer


def parse_completion(body: dict, chat: bool, defaults: SamplingParams, n_ctx: int, draft: bool = False) -> Completion:
    """A Completion from a /v1/chat/completions (chat) or /v1/completions body. draft: whether
    the server has a draft model (then requests use it unless they say "draft": false or ask
    for "lookup")."""
    for name in UNSUPPORTED:
        if body.get(name):
            raise ApiError(400, f"'{name}' is not supported by this server", name)
    if body.get("best_of", 1) != 1:
        raise ApiError(400, "'best_of' must be 1", "best_of")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise ApiError(400, "only the 'text' response_format is supported", "response_format")
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise ApiError(400, f"'n' must be 1 (one choice per request), not {n!r}", "n")
    if not isinstance(body.get("model", ""), str):
        raise ApiError(400, "'model' must be a string", "model")
    prompt = _messages(body) if chat else _prompt(body)
    out = Completion(Request(prompt), chat)
    out.stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    out.include_usage = out.stream and bool((options or {}).get("include_usage"))
    out.return_tokens = _flag(body, "return_tokens")
    out.request.logprobs = _logprobs(body, chat)
    out.logprobs = out.request.logprobs is not None
    out.request.max_tokens = _max_tokens(body, n_ctx)
    out.request.stop = _stops(body.get("stop"))
    out.request.sampling = _sampling(body, defaults)
    priority = body.get("priority", 0)
    if not is_integer(priority) or abs(priority) > 1 << 31:
        raise ApiError(400, f"'priority' must be an integer, not {priority!r}", "priority")
    out.request.priority = priority
    out.request.ignore_eos = _flag(body, "ignore_eos")
    out.request.lookup = _flag(body, "lookup")  # prompt lookup (speculative decoding), as generate --lookup
    out.request.draft = _flag(body, "draft", draft and not out.request.lookup)  # the server's draft model
    return out


def _flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false, not {value!r}", name)
    return value


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", "messages")
        out.append({"role": message["role"], "content": _content(message.get("content"), i)})
    return out


def _content(content, i: int) -> str:
    """A message's text: a string, null (an assistant turn without text) or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")


def _prompt(body: dict):
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(is_integer(t) for t in prompt):
        return prompt  # token ids (checked against the vocabulary on submit)
    raise ApiError(400, "'prompt' must be a string, or a list of token ids (one prompt per request)", "prompt")


def _max_tokens(body: dict, n_ctx: int) -> int:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return n_ctx  # until an end token or the end of the context
    if not is_integer(value) or value < 0:
        raise ApiError(400, f"'{name}' must be an integer >= 0, not {value!r}", name)
    if value > n_ctx:
        raise ApiError(400, f"'{name}' is {value}, more than the context of {n_ctx} tokens", name)
    return value


def _stops(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOPS} strings", "stop")
    return stops


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's logprobs list (None: no logprobs)."""
    value = body.get("logprobs")
    if chat:
        wanted = _flag(body, "logprobs")
        top = body.get("top_logprobs")
        if top is None:
            return 0 if wanted else None
        if not is_integer(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
        if not wanted:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return top
    if value is None:
        return None
    if not is_integer(value) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
    return value


def _sampling(body: dict, defaults: SamplingParams) -> SamplingParams:
    overrides = {}
    for key, (ok, what) in SAMPLING_FIELDS.items():
        value = body.get(key)
        if value is not None:
            if not ok(value):
                raise ApiError(400, f"'{key}' must be {what}, not {value!r}", key)
            overrides[key] = value
    return replace(defaults, **overrides)


# -- answers -----------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(n_prompt: int, n_generated: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_generated, "total_tokens": n_prompt + n_generated}


class Answer:
    """Builds one request's response objects; the same id and creation time throughout."""

    def __init__(self, completion: Completion, model_name: str, piece):
        self.chat = completion.chat
        self.completion = completion
        self.id = new_id(self.chat)
        self.created = int(time.time())
        self.model = model_name
        self.piece = piece  # token id -> its bytes
        self.text_offset = 0

    def _object(self, kind: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def whole(self, text: str, chunks, n_prompt: int, tokens: list[int]) -> dict:
        """The non-streamed answer (chunks: all of the request's, the last with its finish reason)."""
        finish_reason, t = chunks[-1].finish_reason, chunks[-1].timings
        logprobs = self.logprobs(chunks) if self.completion.logprobs else None
        finish = FINISH_REASONS.get(finish_reason, finish_reason)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if self.completion.return_tokens:
            choice["tokens"] = tokens
        timings = {"prompt_n": t.n_prompt, "prompt_ms": t.prompt_s * 1e3, "prompt_per_second": t.prompt_tokens_per_s,
                   "predicted_n": t.n_generated, "predicted_ms": t.generate_s * 1e3,
                   "predicted_per_second": t.generate_tokens_per_s}  # as llama-server reports them
        if self.completion.request.lookup or self.completion.request.draft:
            timings.update(draft_n=t.n_drafted, draft_n_accepted=t.n_accepted)
        return self._object("chat.completion" if self.chat else "text_completion", [choice],
                            usage=usage(n_prompt, len(tokens)), timings=timings)

    def chunk(self, text: str | None, chunks=(), finish_reason: str | None = None, role: bool = False) -> dict:
        """One streamed chunk: new text (and its tokens' logprobs), or the finish reason."""
        logprobs = self.logprobs(chunks) if self.completion.logprobs and chunks else None
        finish = FINISH_REASONS.get(finish_reason, finish_reason)
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            kind = "text_completion"
        extra = {"usage": None} if self.completion.include_usage else {}
        return self._object(kind, [choice], **extra)

    def events(self, chunk, n_prompt: int) -> list[dict]:
        """The streamed objects of one Chunk: its text once (with its token's logprobs), then,
        on the last Chunk, the finish reason and the usage when asked for."""
        sampled = chunk.token is not None
        events = []
        if chunk.text or (sampled and self.completion.logprobs):
            events.append(self.chunk(chunk.text, [chunk] if sampled else ()))
        if chunk.finish_reason is not None:
            events.append(self.chunk(None, finish_reason=chunk.finish_reason))
            if self.completion.include_usage:
                events.append(self.usage_chunk(n_prompt, chunk.timings.n_generated))
        return events

    def usage_chunk(self, n_prompt: int, n_generated: int) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._object(kind, [], usage=usage(n_prompt, n_generated))

    def logprobs(self, chunks) -> dict:
        """OpenAI's logprobs object for the tokens of chunks (chat or completions shape)."""
        chunks = [c for c in chunks if c.logprobs is not None]
        if self.chat:
            return {"content": [dict(self._entry(c.token, c.logprobs.logprob),
                                     top_logprobs=[self._entry(t, lp) for t, lp in c.logprobs.top])
                                for c in chunks]}
        tokens, offsets = [], []
        for c in chunks:
            tokens.append(self._text(c.token))
            offsets.append(self.text_offset)
            self.text_offset += len(c.text)
        return {"tokens": tokens, "token_logprobs": [c.logprobs.logprob for c in chunks],
                "top_logprobs": [{self._text(t): lp for t, lp in c.logprobs.top} for c in chunks],
                "text_offset": offsets}

    def _text(self, token: int) -> str:
        return self.piece(token).decode("utf-8", errors="replace")

    def _entry(self, token: int, logprob: float) -> dict:
        piece = self.piece(token)
        return {"token": piece.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(piece)}


def sse(data) -> bytes:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
