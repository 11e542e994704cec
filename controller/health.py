"""The controller's `/healthz` (liveness) and `/readyz` (readiness), served beside `/metrics`.

Liveness: the asyncio loop ran its heartbeat within `stall_after_s` (a loop stuck in a blocking
call is restarted). Readiness: live, and every condition the parts of the controller report is
true: the apiserver answered the last Lease call (leader election), the leader's (or, without
election, the only replica's) last catalog apply succeeded. Nothing reported yet: not ready.
Both answer 200 with one `[+]name ok` line per condition, or 503 with `[-]name: reason` lines.
See docs/deployment.md, "Controller: Deployment".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import StartResponse, WSGIEnvironment

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 5.0
STALL_AFTER_S = 30.0
"""A heartbeat older than this fails liveness (the kubelet restarts after 3 failed probes)."""


@dataclass(frozen=True)
class Condition:
    ok: bool
    reason: str = ""


class ControllerHealth:
    """Liveness from a heartbeat, readiness from named conditions (thread-safe)."""

    def __init__(
        self, *, stall_after_s: float = STALL_AFTER_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._stall_after_s = stall_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._beat = clock()
        self._conditions: dict[str, Condition] = {}

    def beat(self) -> None:
        with self._lock:
            self._beat = self._clock()

    async def heartbeat(
        self, stop: asyncio.Event, interval_s: float = HEARTBEAT_INTERVAL_S
    ) -> None:
        """Beat from the event loop every `interval_s` until `stop`."""
        while not stop.is_set():
            self.beat()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)

    def set(self, name: str, ok: bool, reason: str = "") -> None:
        """Report condition `name`; a change is logged."""
        condition = Condition(ok, "" if ok else reason)
        with self._lock:
            before = self._conditions.get(name)
            self._conditions[name] = condition
        if before != condition:
            if ok:
                log.info("readiness: %s ok", name)
            else:
                log.warning("readiness: %s not ok: %s", name, reason)

    def forget(self, name: str) -> None:
        """Condition `name` no longer applies (e.g. the catalog after leadership is lost)."""
        with self._lock:
            self._conditions.pop(name, None)

    def live(self) -> tuple[bool, list[str]]:
        with self._lock:
            age = self._clock() - self._beat
        if age > self._stall_after_s:
            return False, [f"[-]event-loop: no heartbeat for {age:.0f}s"]
        return True, ["[+]event-loop ok"]

    def ready(self) -> tuple[bool, list[str]]:
        live, lines = self.live()
        with self._lock:
            conditions = sorted(self._conditions.items())
        if not conditions:
            return False, [*lines, "[-]starting: nothing reported yet"]
        lines += [f"[+]{name} ok" if c.ok else f"[-]{name}: {c.reason}" for name, c in conditions]
        return live and all(c.ok for _, c in conditions), lines


WsgiApp = Callable[[WSGIEnvironment, StartResponse], Iterable[bytes]]


def health_app(health: ControllerHealth, metrics: WsgiApp) -> WsgiApp:
    """`/healthz` and `/readyz` from `health`; every other path to `metrics`."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path not in ("/healthz", "/readyz"):
            return metrics(environ, start_response)
        ok, lines = health.live() if path == "/healthz" else health.ready()
        body = ("\n".join(lines) + "\n").encode()
        start_response(
            "200 OK" if ok else "503 Service Unavailable",
            [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))],
        )
        return [body]

    return app


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Probes every few seconds would flood the log."""


def serve_http(
    port: int,
    registry: CollectorRegistry,
    health: ControllerHealth,
    addr: str = "0.0.0.0",  # noqa: S104 (probes come from the node)
) -> WSGIServer:
    """`/metrics`, `/healthz` and `/readyz` on `port` in a daemon thread; the server (its
    `server_address` holds the bound port, `shutdown()` stops it)."""
    server = make_server(
        addr,
        port,
        health_app(health, make_wsgi_app(registry)),
        server_class=_ThreadingServer,
        handler_class=_QuietHandler,
    )
    thread = threading.Thread(target=server.serve_forever, name="http", daemon=True)
    thread.start()
    log.info("metrics, healthz and readyz on :%d", server.server_address[1])
    return server
