"""`minillm serve --replicas N`: the single server's model and scheduler as N replicas on Ray
Serve, which places them, restarts the ones that die and scales their number.

    client -> Ray's HTTP proxy -> Gateway -> Replica (xN)      Replica -> Board (every second)

- Replica: one resident model and Scheduler (ServerState, as in `serve`), answering the requests
  forwarded to it with serving/app.py's own Starlette app, so routes, errors, streaming and the
  API key are the single server's.
- Gateway: the ingress. It reads a request's body, attaches its prompt's prefix blocks for
  PrefixRouter (the replicas' request router) and relays the replica's ASGI messages as they
  come. It answers /health and /metrics itself, from Board.
- Board: every replica's status, load and metrics, as each last reported them.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import ray
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse

from ..errors import MinillmError
from .app import RETRY_AFTER_S, ServerState, Settings, build_app, check_key, error_response, read_body
from .metrics import Metrics
from .prefix_router import PrefixRouter, prefix_blocks, prompt_text
from .protocol import ApiError, sse

APP = "minillm"
REPORT_EVERY_S = 1.0
STALE_AFTER_S = 5.0      # a replica silent this long is not counted as live
STOP_WAIT_S = 5.0        # at shutdown, how long streams get to end with their finish reason
QUIET = {"log_level": "WARNING", "enable_access_log": False}
# Ray Serve's policy, quicker than its defaults (30 s, 30 s, 600 s): a generation queue that builds
# for seconds is real demand, and a model loads in seconds
AUTOSCALING = {"look_back_period_s": 10, "upscale_delay_s": 5, "downscale_delay_s": 120}


@dataclass
class Forwarded:
    """An HTTP request on its way from the gateway to a replica; `prefix` is what PrefixRouter reads."""
    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prefix: tuple[bytes, ...] = field(default=())


class Board:
    """What each replica last reported: {replica id: (monotonic time, report)}."""

    def __init__(self):
        self.reports: dict[str, tuple[float, dict]] = {}
        self.stopping = False

    def report(self, replica: str, report: dict) -> bool:
        """Store a replica's report; answers whether replicas are to end their requests (shutdown)."""
        self.reports[replica] = (time.monotonic(), report)
        return self.stopping

    def stop(self) -> None:
        self.stopping = True

    def live(self) -> list[dict]:
        now = time.monotonic()
        return [{"id": replica, **{k: v for k, v in r.items() if k != "metrics"}}
                for replica, (at, r) in sorted(self.reports.items()) if now - at < STALE_AFTER_S]

    def health(self) -> tuple[int, dict]:
        live = self.live()
        if self.stopping:
            status = "stopping"
        elif any(r["status"] == "ok" for r in live):
            status = "ok"
        else:
            status = "loading"
        return (200 if status == "ok" else 503), {"status": status, "replicas": live}

    def metrics(self) -> str:
        """Every replica's counters and histograms added up (the gone ones' too, so counters never
        go back), the live ones' gauges."""
        total = Metrics()
        for _, report in self.reports.values():
            total.merge(report["metrics"])
        live = self.live()
        return total.render(sum(r["running"] for r in live), sum(r["queued"] for r in live),
                            extra=(("replicas", "Replicas reporting now.", len(live)),))


class Replica:
    """One model and its scheduler (see the module's docstring)."""

    async def __init__(self, settings: Settings, board):
        self.state = ServerState(settings)
        self.state.load()
        if self.state.error is not None:
            raise self.state.error
        self.app = build_app(self.state)
        self.id = serve.get_replica_context().replica_id.unique_id
        self.board = board
        self.reporter = asyncio.ensure_future(self._report_loop())

    async def _report_loop(self) -> None:
        while True:
            stats = self.state.scheduler.stats()
            report = {"pid": os.getpid(), "status": self.state.status, "running": stats["running"],
                      "queued": stats["queued"], "slots": stats["slots"], "metrics": self.state.metrics.state()}
            try:
                if await self.board.report.remote(self.id, report) and self.state.status == "ok":
                    self.state.stop()  # the deployment is being shut down: streams end with "abort"
            except RayError:
                pass  # the board restarts; the next report goes through
            await asyncio.sleep(REPORT_EVERY_S)

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose scheduler thread stopped is replaced."""
        if not self.state.scheduler.alive:
            raise RuntimeError("the scheduler thread has stopped")

    def __del__(self):
        state = getattr(self, "state", None)
        if state is not None:
            state.stop()
            state.close()

    async def handle(self, request: Forwarded):
        """Answer one request with the server's app; yields lists of its ASGI messages (what is
        ready at once goes as one list). Cancelled when the client leaves: the app sees it so."""
        sent: asyncio.Queue = asyncio.Queue()
        body = [{"type": "http.request", "body": request.body, "more_body": False}]

        async def receive():
            if body:
                return body.pop()
            await asyncio.Event().wait()  # the body is read; a disconnect arrives as cancellation

        async def send(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-minillm-replica", self.id.encode())]}
            await sent.put(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
                 "method": request.method, "path": request.path, "raw_path": request.path.encode(),
                 "query_string": request.query, "root_path": "", "headers": request.headers,
                 "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
        async def answer():
            try:
                await self.app(scope, receive, send)
            finally:
                sent.put_nowait(None)  # the app is over

        task = asyncio.ensure_future(answer())
        try:
            while True:
                batch = [await sent.get()]
                while not sent.empty():
                    batch.append(sent.get_nowait())
                messages = [m for m in batch if m is not None]
                if messages:
                    yield messages
                if batch[-1] is None:
                    await task  # re-raises what the app raised
                    return
        finally:
            task.cancel()


class Gateway:
    """The ingress (see the module's docstring): a plain ASGI app."""

    def __init__(self, replicas, board, api_key: str | None):
        self.replicas, self.board, self.api_key = replicas, board, api_key

    def __serve_build_asgi_app__(self):
        async def app(scope, receive, send):  # a function, so that uvicorn sees ASGI 3
            await self.asgi(scope, receive, send)
        return app

    async def asgi(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":  # nothing to start or stop
            while True:
                phase = (await receive())["type"].removeprefix("lifespan.")
                await send({"type": f"lifespan.{phase}.complete"})
                if phase == "shutdown":
                    return
        path, method = scope["path"], scope["method"]
        try:
            if path == "/health" and method == "GET":
                status, payload = await self.board.health.remote()
                response = JSONResponse(payload, status)
            elif path == "/metrics" and method == "GET":
                check_key(self.api_key, _header(scope, b"authorization"))
                response = PlainTextResponse(await self.board.metrics.remote(), media_type="text/plain; version=0.0.4")
            else:
                return await self.forward(scope, receive, send)
        except ApiError as exc:
            response = error_response(exc)
        await response(scope, receive, send)

    async def forward(self, scope, receive, send) -> None:
        try:
            body = await read_body(HttpRequest(scope, receive))
        except ApiError as exc:
            return await error_response(exc)(scope, receive, send)
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None  # the replica answers it with the right error
        request = Forwarded(scope["method"], scope["path"], scope.get("query_string", b""),
                            list(scope.get("headers", [])), body, prefix_blocks(prompt_text(parsed)))
        if not await self._relay(request, scope, send, retry=True):
            await self._relay(request, scope, send, retry=False)

    async def _relay(self, request: Forwarded, scope, send, retry: bool) -> bool:
        """Send the request to a replica and its answer to the client. False: the replica died
        before it answered anything, so the request can go to another (when retry)."""
        response = self.replicas.options(stream=True).handle.remote(request)
        started = False
        try:
            async for messages in response:
                for message in messages:
                    started = started or message["type"] == "http.response.start"
                    await send(message)
            return True
        except asyncio.CancelledError:  # the client left: so does the replica's work
            response.cancel()
            raise
        except BackPressureError:
            error = ApiError(503, "every replica's queue is full; retry shortly",
                             headers={"Retry-After": str(RETRY_AFTER_S)})
        except (ActorDiedError, ActorUnavailableError) as exc:
            if retry and not started:
                return False
            error = ApiError(503, f"the replica answering this request stopped ({type(exc).__name__})",
                             headers={"Retry-After": str(RETRY_AFTER_S)})
        except RayError as exc:  # a bug in the replica: its log has the traceback
            error = ApiError(500, f"internal error: {type(exc).__name__}")
        if not started:
            await error_response(error)(scope, None, send)
        else:  # a stream had begun: one error event ends it, as the single server does
            await send({"type": "http.response.body", "body": sse(error.body()), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True


def _header(scope, name: bytes) -> str:
    return next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == name), "")


# -- the deployment ---------------------------------------------------------------------------
@dataclass
class ReplicaCount:
    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> "ReplicaCount":
        """N, or MIN:MAX for autoscaling."""
        low, _, high = text.partition(":")
        try:
            count = cls(int(low), int(high or low))
        except ValueError:
            raise MinillmError(f"--replicas is N or MIN:MAX, not {text!r}") from None
        if not 1 <= count.low <= count.high <= 1024:
            raise MinillmError(f"--replicas {text}: need 1 <= MIN <= MAX <= 1024")
        return count


def replica_resources(settings: Settings, threads: int) -> dict:
    """What Ray reserves for a replica: its threads' CPUs, and with --device cuda a GPU of its
    own (Ray sets each replica's CUDA_VISIBLE_DEVICES; a cluster without a free GPU leaves the
    replica pending, as Ray Serve does)."""
    return {"num_cpus": threads, **({"num_gpus": 1} if settings.device == "cuda" else {})}


def application(settings: Settings, count: ReplicaCount, threads: int):
    """The Serve application: Gateway over the Replica deployment and Board."""
    board = serve.deployment(Board, name="Board", max_ongoing_requests=1024, logging_config=QUIET,
                             ray_actor_options={"num_cpus": 0}).bind()
    scale = ({"num_replicas": count.low} if count.low == count.high else
             {"autoscaling_config": {"min_replicas": count.low, "max_replicas": count.high,
                                     "initial_replicas": count.low, "target_ongoing_requests": settings.parallel,
                                     **AUTOSCALING}})
    replicas = serve.deployment(
        Replica, name="Replica", **scale, logging_config=QUIET,
        max_ongoing_requests=2 * settings.parallel,  # a slot's next request waits in its replica, not in Ray
        max_queued_requests=max(settings.max_queue, 1),
        ray_actor_options=replica_resources(settings, threads), health_check_period_s=2, health_check_timeout_s=30,
        graceful_shutdown_timeout_s=STOP_WAIT_S,
        request_router_config=RequestRouterConfig(request_router_class=PrefixRouter),
    ).bind(settings, board)
    gateway = serve.deployment(serve.ingress()(Gateway), name="Gateway", max_ongoing_requests=4096,
                               logging_config=QUIET, ray_actor_options={"num_cpus": 0})
    return gateway.bind(replicas, board, settings.api_key)


def run(settings: Settings, count: ReplicaCount, threads: int, host: str, port: int, ray_address: str | None,
        log, verbose: bool = False) -> None:
    """Start Ray (or join ADDRESS), deploy, serve until SIGINT/SIGTERM or until the application is
    deleted from outside (`serve shutdown`), then take everything down. The replicas' and Ray's
    logs reach stderr with verbose; else they stay in Ray's log folder (/tmp/ray/session_latest)."""
    local = ray_address is None
    try:
        if local:
            ray.init(num_cpus=max(os.cpu_count() or 1, count.high * threads), include_dashboard=False,
                     logging_level="WARNING", log_to_driver=verbose)
        else:
            ray.init(address=ray_address, logging_level="WARNING", log_to_driver=verbose)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise MinillmError(f"cannot {'start Ray' if local else f'join the Ray cluster at {ray_address}'}: "
                           f"{exc}") from None
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    deployed = False
    try:
        serve.start(http_options={"host": host, "port": port}, logging_config=QUIET)
        log(f"minillm serve: starting {count.low} replica{'s' * (count.low > 1)} of {settings.model.name} "
            f"({threads} thread{'s' * (threads > 1)}{' and a GPU' * (settings.device == 'cuda')} each) on Ray "
            f"{'(local)' if local else ray_address}")
        try:
            serve.run(application(settings, count, threads), name=APP, route_prefix="/", logging_config=QUIET)
        except Exception as exc:  # noqa: BLE001 (Serve reports a replica that cannot start this way)
            raise MinillmError(f"the replicas could not start: {exc}") from None
        deployed = True
        url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        log(f"minillm serve: ready: {url}, {count.low}{f' to {count.high}' * (count.high > count.low)} "
            f"replica{'s' * (count.high > 1)}, "
            f"{settings.parallel} sequences at once each")
        while not stop.wait(1.0):
            if APP not in serve.status().applications:
                log("minillm serve: the application was shut down from outside")
                deployed = False
                break
    finally:
        _take_down(local, deployed)
    log("minillm serve: stopped")


def _take_down(local: bool, deployed: bool) -> None:
    """End every request (streams get finish_reason "abort"), remove the application (and a
    local Serve), stop Ray here. A terminal's Ctrl-C also reaches a local Ray's own processes,
    so the polite part has a deadline, then Ray's processes are ended regardless."""
    async def end_requests():  # in a loop of its own: Ray's fast mode routes handles in the caller's loop
        board = serve.get_deployment_handle("Board", APP)
        await board.stop.remote()
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline and any(
                r["running"] or r["queued"] or r["status"] == "ok" for r in await board.live.remote()):
            await asyncio.sleep(0.2)

    def polite():
        if deployed:
            asyncio.run(end_requests())
        if local:
            serve.shutdown()
        elif APP in serve.status().applications:
            serve.delete(APP)

    done = threading.Thread(target=_quietly(polite), name="minillm-stop", daemon=True)
    done.start()
    done.join(3 * STOP_WAIT_S)
    ray.shutdown()


def _quietly(work):
    def run():
        try:
            work()
        except Exception as exc:  # noqa: BLE001 (Ray is going anyway: ray.shutdown follows)
            print(f"minillm serve: stopping: {type(exc).__name__}: {exc}", file=sys.stderr)
    return run
