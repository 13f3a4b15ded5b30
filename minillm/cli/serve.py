"""`minillm serve`: an OpenAI-compatible HTTP server over one resident model (minillm/server/).
Starlette and uvicorn are imported here only, so the other commands start as fast as ever."""
from __future__ import annotations

import gc
import os
import socket
import tempfile
import threading
from pathlib import Path
from typing import Optional

import typer

from .common import err
from .options import CACHE_TYPE_K, CACHE_TYPE_V, CTX, DRAFT, DRAFT_MAX, DRAFT_MIN, DRAFT_P_MIN, MODEL, THREADS
from ..errors import MinillmError
from .models import takes_model


def listen(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free one), or a clear error."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as exc:
        raise MinillmError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def serve_replicas(settings, replicas: str, sock: socket.socket, ray_address: str | None, verbose: bool) -> None:
    """`serve --replicas`: the same server as replicas on Ray Serve (serving/cluster.py)."""
    from ..arch import get_architecture
    from ..gguf_file import GGUFFile
    from ..model import default_threads
    from ..serving.ray_env import local_ray_environment

    host, port = sock.getsockname()[:2]
    sock.close()  # Ray Serve's proxy listens there: the port was checked free (and chosen, for --port 0)
    for path in (settings.model, settings.draft):
        if path is not None:  # a file replicas could not load is refused here, not retried by Ray
            with GGUFFile(path) as gguf:
                get_architecture(gguf.architecture)(gguf)
    with tempfile.TemporaryDirectory(prefix="minillm-ray-") as scratch:
        if ray_address is None:  # before Ray is imported: it reads them then
            for name, value in local_ray_environment(scratch).items():
                os.environ.setdefault(name, value)
        try:
            from ..serving import cluster
        except ImportError as exc:
            raise MinillmError(f"serve --replicas needs Ray Serve ({exc.name} is missing): "
                               "pip install 'minillm[cluster]'") from None
        count = cluster.ReplicaCount.parse(replicas)
        threads = settings.threads or max(1, default_threads() // count.high)
        settings.threads = threads
        cluster.run(settings, count, threads, host, port, ray_address, log=err, verbose=verbose)


def register(app: typer.Typer) -> None:
    @app.command()
    @takes_model()
    def serve(
        model: Optional[Path] = MODEL,
        host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
        port: int = typer.Option(8080, "--port", min=0, max=65535, help="Port (0: any free one, printed)."),
        parallel: int = typer.Option(4, "--parallel", min=1, max=256, help="Sequences decoded at once."),
        ctx: Optional[int] = CTX,
        batch: int = typer.Option(512, "--batch", min=1, max=1 << 16, help="Prompt tokens evaluated a step, at most."),
        max_queue: int = typer.Option(64, "--max-queue", min=0, max=1 << 20,
                                      help="Requests waiting for a slot, at most (then 503 with Retry-After)."),
        api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MINILLM_API_KEY",
                                              help="Require Authorization: Bearer KEY (not for /health)."),
        scheduling: str = typer.Option("priority", "--scheduling",
                                       help="priority (the request's `priority` field, preempting) or fcfs."),
        threads: Optional[int] = THREADS,
        device: str = typer.Option("auto", "--device", help="cpu, cuda, or auto (CUDA where it is the faster)."),
        cache_type_k: str = CACHE_TYPE_K,
        cache_type_v: str = CACHE_TYPE_V,
        kv_memory: Optional[float] = typer.Option(
            None, "--kv-memory", metavar="MIB", min=1,
            help="The KV pool's size in MiB (default: every slot's full context). A quantized cache "
                 "(-ctk/-ctv q8_0) fits about twice the tokens in the same memory, so fewer preemptions."),
        draft: Optional[Path] = DRAFT,
        draft_max: int = DRAFT_MAX,
        draft_min: int = DRAFT_MIN,
        draft_p_min: float = DRAFT_P_MIN,
        verbose: bool = typer.Option(False, "-v", "--verbose", help="Log every request on stderr."),
        replicas: Optional[str] = typer.Option(
            None, "--replicas", metavar="N|MIN:MAX",
            help="Serve N copies of the model on Ray Serve (pip install 'minillm[cluster]'), requests routed "
                 "by prompt prefix; MIN:MAX scales with the queue. --threads is then per replica "
                 "(default: the cores shared out)."),
        ray_address: Optional[str] = typer.Option(
            None, "--ray-address", metavar="ADDR",
            help="With --replicas: join this Ray cluster (several machines) instead of starting Ray here."),
    ):
        """Serve the model over HTTP with OpenAI's API (chat/completions, completions, models)."""
        gc.enable()  # a long-running process (main turns collection off while commands start)
        try:
            import uvicorn

            from ..serving.app import Server, ServerState, Settings, build_app
        except ImportError as exc:
            raise MinillmError(f"minillm serve needs starlette and uvicorn ({exc.name} is missing): "
                               "pip install 'minillm[server]'") from None
        from ..serving.scheduler import POLICIES

        if scheduling not in POLICIES:
            raise typer.BadParameter(f"--scheduling is one of {', '.join(POLICIES)}, not {scheduling!r}")
        for path in (model, draft):
            if path is not None and not path.is_file():
                raise MinillmError(f"no model file at {path}")
        sock = listen(host, port)
        settings = Settings(model, parallel, ctx, batch, max_queue, api_key or None, scheduling, threads,
                            (cache_type_k, cache_type_v), int(kv_memory * 2**20) if kv_memory else None,
                            draft, dict(draft_max=draft_max, draft_min=draft_min, p_min=draft_p_min), device)
        if replicas is not None or ray_address is not None:
            return serve_replicas(settings, replicas or "1", sock, ray_address, verbose)
        state = ServerState(settings)
        config = uvicorn.Config(build_app(state), lifespan="off", log_level="info" if verbose else "warning",
                                access_log=verbose, timeout_graceful_shutdown=3, timeout_keep_alive=5)
        server = Server(config, state)
        bound_host, bound_port = sock.getsockname()[:2]
        url = f"http://{bound_host if ':' not in bound_host else f'[{bound_host}]'}:{bound_port}"
        err(f"minillm serve: {url} (loading {model.name}; /health answers 503 until it is ready)")

        def ready(state) -> None:
            s = state.scheduler
            m = state.model
            if m.device_notice:
                err(f"notice: {m.device_notice}")
            where = "CUDA GPU" if m.device == "cuda" else f"{m.threads} threads"
            err(f"minillm serve: ready: {state.model_name}, {len(s.slots)} sequences at once, context {s.n_ctx}, "
                f"{where}, KV cache {s.pool.nbytes / 2**20:.1f} MiB "
                f"({'/'.join(m.cache_types)}, {s.pool.n_cells} cells)"
                + (f", draft {s.draft.path.name}" if s.draft is not None else ""))

        def failed(exc) -> None:
            server.should_exit = True

        state.on_ready, state.on_failure = ready, failed
        threading.Thread(target=state.load, name="minillm-load", daemon=True).start()
        try:
            server.run(sockets=[sock])
        finally:
            state.close()
        if isinstance(state.error, MinillmError):  # names the file and what is wrong with it
            raise state.error
        if state.error is not None:
            raise MinillmError(f"cannot load {model}: {type(state.error).__name__}: {state.error}")
        err("minillm serve: stopped")

