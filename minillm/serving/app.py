"""`minillm serve`'s HTTP side: a Starlette app over one resident model and its Scheduler.

The scheduler steps in its own thread (the kernels release the GIL); the event loop parses
requests, submits them and relays each Handle's Chunks as they come (Handle.notify wakes the
loop). A client that leaves cancels its request; stopping the server cancels every request, so
each stream ends with a finish reason ("abort") before the process exits.
"""
from __future__ import annotations

import asyncio
import hmac
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from ..errors import MinillmError
from ..kv_cache import F16_CACHE
from ..sampling import SamplingParams
from .metrics import Metrics
from .protocol import Answer, ApiError, parse_completion, parse_json, sse

MAX_BODY = 4 << 20        # bytes: far more than any prompt that fits a context
RETRY_AFTER_S = 1


@dataclass
class Settings:
    model: Path
    parallel: int = 4
    ctx: int | None = None
    batch: int = 512
    max_queue: int = 64
    api_key: str | None = None
    scheduling: str = "priority"
    threads: int | None = None
    cache_types: tuple[str, str] = F16_CACHE       # -ctk, -ctv
    kv_memory: int | None = None                   # bytes of KV pool (None: every slot's context)
    draft: Path | None = None                      # -md: a draft model for speculative decoding
    speculation: dict | None = None                # SpeculationParams fields (--draft-max ...)
    device: str = "cpu"                            # the model's: cpu, cuda or auto (the draft's: the CPU)


class ServerState:
    """What the routes share: the model once loaded, its scheduler, the live requests, metrics."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.model_name = settings.model.name
        self.model = self.scheduler = None
        self.status = "loading"           # then "ok"; "error" if loading failed; "stopping"
        self.error: BaseException | None = None
        self.metrics = Metrics()
        self.live: set = set()            # handles of requests being answered
        self.on_ready = self.on_failure = None

    def load(self) -> None:
        """Load and warm the model, then start the scheduler (in a thread: /health answers meanwhile)."""
        from ..model import Model

        s = self.settings
        try:
            model = Model(s.model, threads=s.threads, device=s.device, cache_types=s.cache_types)
            model.warm_up()
            model.tokenizer  # noqa: B018
            draft = None
            if s.draft is not None:
                draft = Model(s.draft, threads=s.threads, device="cpu")
                draft.warm_up()
            self.scheduler = model.scheduler(s.parallel, s.ctx, s.batch, policy=s.scheduling, kv_memory=s.kv_memory,
                                             draft=draft, speculation=s.speculation)
            warm_up(self.scheduler)
            self.scheduler.start()
            self.model = model
        except Exception as exc:  # noqa: BLE001 (reported to the command, which exits 1)
            self.error, self.status = exc, "error"
            if self.on_failure is not None:
                self.on_failure(exc)
            return
        if self.status == "loading":
            self.status = "ok"
        if self.on_ready is not None:
            self.on_ready(self)

    def stop(self) -> None:
        """Refuse new requests and end the live ones at the scheduler's next step."""
        self.status = "stopping"
        for handle in list(self.live):
            handle.cancel()

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()

    def require_ready(self):
        """The scheduler, or a 503 while loading or stopping."""
        if self.status == "loading":
            raise ApiError(503, "the model is loading", headers={"Retry-After": str(RETRY_AFTER_S)})
        if self.status != "ok":
            raise ApiError(503, "the server is stopping", headers={"Retry-After": str(RETRY_AFTER_S)})
        return self.scheduler


def warm_up(scheduler) -> None:
    """Two short chat requests decoded together: the batched code paths and the chat template are
    ready before /health says ok (a first real batch would otherwise wait about 2 s for them)."""
    from .batch_input import make_request

    chat = {"messages": [{"role": "user", "content": "Hello."}]}
    n = min(2, len(scheduler.slots))
    scheduler.run([scheduler.submit(make_request(chat, 4, SamplingParams(temperature=0), ignore_eos=True))
                   for _ in range(n)])


class Server(uvicorn.Server):
    """uvicorn's server, whose first SIGINT/SIGTERM also ends every live request (each stream
    gets its finish reason at the scheduler's next step), so that stopping never waits for
    generations to run out."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        self.state.stop()
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # a clean stop exits 0: uvicorn would re-raise the signal


def build_app(state: ServerState) -> Starlette:
    async def health(request):
        code = 200 if state.status == "ok" else 503
        return JSONResponse({"status": state.status}, code)

    async def models(request):
        path = state.settings.model
        meta = {"n_ctx": state.scheduler.n_ctx if state.scheduler else None, "parallel": state.settings.parallel}
        if state.model is not None:
            meta.update(n_ctx_train=state.model.hp.n_ctx_train, n_vocab=state.model.n_vocab)
        return JSONResponse({"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(path.stat().st_mtime),
            "owned_by": "minillm", "meta": meta}]})

    async def metrics(request):
        stats = state.scheduler.stats() if state.scheduler else {"running": 0, "queued": 0}
        return PlainTextResponse(state.metrics.render(stats["running"], stats["queued"]),
                                 media_type="text/plain; version=0.0.4")

    async def tokenize(request):
        state.require_ready()
        body = parse_json(await read_body(request))
        content = body.get("content")
        if not isinstance(content, str):
            raise ApiError(400, "'content' must be a string", "content")
        add_special, with_pieces = (_bool(body, "add_special"), _bool(body, "with_pieces"))
        ids = state.model.tokenize(content, add_bos=add_special, special=True)
        if with_pieces:
            piece = state.model.tokenizer.token_piece
            return JSONResponse({"tokens": [{"id": t, "piece": piece(t).decode("utf-8", "replace")} for t in ids]})
        return JSONResponse({"tokens": ids})

    async def detokenize(request):
        state.require_ready()
        body = parse_json(await read_body(request))
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ApiError(400, "'tokens' must be a list of token ids", "tokens")
        state.model.check_ids(ids)
        return JSONResponse({"content": state.model.detokenize(ids)})

    async def chat_completions(request):
        return await complete(state, request, chat=True)

    async def completions(request):
        return await complete(state, request, chat=False)

    routes = [
        Route("/health", endpoint(state, health, auth=False), methods=["GET"]),
        Route("/v1/models", endpoint(state, models), methods=["GET"]),
        Route("/metrics", endpoint(state, metrics), methods=["GET"]),
        Route("/tokenize", endpoint(state, tokenize), methods=["POST"]),
        Route("/detokenize", endpoint(state, detokenize), methods=["POST"]),
        Route("/v1/chat/completions", endpoint(state, chat_completions), methods=["POST"]),
        Route("/v1/completions", endpoint(state, completions), methods=["POST"]),
    ]

    async def not_found(request, exc: HTTPException):
        state.metrics.add("requests_rejected")
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return error_response(ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail))))

    return Starlette(routes=routes, exception_handlers={HTTPException: not_found})


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false", name)
    return value


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), error.status, headers=error.headers)


def endpoint(state: ServerState, handler, auth: bool = True):
    """handler with the API key checked and every failure turned into an OpenAI error object."""
    async def wrapped(request: HttpRequest):
        try:
            if auth:
                check_key(state.settings.api_key, request.headers.get("authorization", ""))
            return await handler(request)
        except ApiError as exc:
            error = exc
        except MinillmError as exc:
            error = ApiError(400, str(exc))
        except Exception as exc:  # noqa: BLE001 (a bug: logged, answered as a 500)
            traceback.print_exc(file=sys.stderr)
            error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}")
        if error.status != 500:
            state.metrics.add("requests_rejected")
        return error_response(error)

    return wrapped


def check_key(key: str | None, header: str) -> None:
    if key is None:
        return
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise ApiError(401, "a valid API key is needed: Authorization: Bearer KEY", code="invalid_api_key")


async def read_body(request: HttpRequest) -> bytes:
    """The body, at most MAX_BODY bytes (413 beyond; the rest is read and dropped)."""
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size <= MAX_BODY:
            parts.append(part)
    if size > MAX_BODY:
        raise ApiError(413, f"the body is {size} bytes, more than the {MAX_BODY} allowed")
    return b"".join(parts)


# -- completions -----------------------------------------------------------------------------
async def complete(state: ServerState, request: HttpRequest, chat: bool):
    scheduler = state.require_ready()
    settings = state.settings
    body = parse_json(await read_body(request))
    completion = parse_completion(body, chat, SamplingParams(), scheduler.n_ctx, scheduler.draft is not None)
    if scheduler.stats()["queued"] >= settings.max_queue:
        raise ApiError(503, f"the queue is full ({settings.max_queue} requests waiting); retry shortly",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
    arrival = time.perf_counter()
    handle = scheduler.submit(completion.request)
    answer = Answer(completion, state.model_name, state.model.tokenizer.token_piece)
    relay = Relay(state, handle, arrival)
    if completion.stream:
        return EventStream(relay, answer)
    return await relay.whole(request, answer)


class Relay:
    """A submitted request seen from the event loop: its Chunks as they come, the metrics they
    make, and its cancellation when the client leaves."""

    def __init__(self, state: ServerState, handle, arrival: float):
        self.state, self.handle, self.arrival = state, handle, arrival
        self.last = None
        state.live.add(handle)
        state.metrics.add("prompt_tokens", len(handle.prompt_ids))
        if state.status != "ok":  # stopping began while this one was submitted
            handle.cancel()

    async def chunks(self):
        """The handle's Chunks, waiting without blocking the loop."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def notify():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop has closed: nobody is listening any more
                pass

        self.handle.notify = notify
        while True:
            wake.clear()
            ready = self.handle.poll()
            for chunk in ready:
                self._observe(chunk)
                yield chunk
                if chunk.finish_reason is not None:
                    return
            if not ready:
                await wake.wait()

    def _observe(self, chunk) -> None:
        if chunk.token is None:
            return
        now, metrics = time.perf_counter(), self.state.metrics
        if self.last is None:
            metrics.observe_ttft(now - self.arrival)
        else:
            metrics.observe_gap(now - self.last)
        self.last = now
        metrics.add("generated_tokens")

    def close(self) -> None:
        """The answer is over (sent, failed or abandoned): account for it, free its slot."""
        handle = self.handle
        self.state.live.discard(handle)
        if handle.finish_reason in ("stop", "length"):
            self.state.metrics.add("requests_finished")
        else:
            handle.cancel()
            self.state.metrics.add("requests_cancelled")

    async def whole(self, request: HttpRequest, answer: Answer):
        """The non-streamed answer; a client that leaves meanwhile cancels the request."""
        async def collect():
            return [chunk async for chunk in self.chunks()]

        collecting = asyncio.ensure_future(collect())
        watch = asyncio.ensure_future(_until_disconnect(request.receive))
        try:
            await asyncio.wait([collecting, watch], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (collecting, watch):
                task.cancel()
            self.close()
        if not collecting.done() or collecting.cancelled():
            return PlainTextResponse("", 499)  # nobody is there to read it
        try:
            chunks = collecting.result()
        except MinillmError as exc:
            raise ApiError(500, str(exc)) from None
        tokens = [c.token for c in chunks if c.token is not None]
        return JSONResponse(answer.whole("".join(c.text for c in chunks), chunks, len(self.handle.prompt_ids),
                                         tokens))


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream:
    """A streamed answer (server-sent events), itself an ASGI response: it relays the chunks
    while watching for the client leaving, and always closes the relay."""

    def __init__(self, relay: Relay, answer: Answer):
        self.relay, self.answer = relay, answer

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait([pump, watch], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, watch):
                task.cancel()
            self.relay.close()
        if not pump.done() or pump.cancelled():
            return  # the client left
        if pump.exception() is not None:  # a bug: the stream just ends, the log says why
            traceback.print_exception(pump.exception(), file=sys.stderr)
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump(self, send) -> None:
        answer, relay = self.answer, self.relay

        async def event(data) -> None:
            await send({"type": "http.response.body", "body": sse(data), "more_body": True})

        try:
            if answer.chat:
                await event(answer.chunk(None, role=True))
            async for chunk in relay.chunks():
                for data in answer.events(chunk, len(relay.handle.prompt_ids)):
                    await event(data)
            await event("[DONE]")
        except MinillmError as exc:  # the request failed after its stream began: one error event
            await event(ApiError(500, str(exc)).body())

