"""`StubApiserver`: an HTTP server on localhost that answers the real `kubernetes` client like the
apiserver, from the routes a test sets; for the adapters' request paths, queries, bodies, error
mapping and watch streaming.

Every request is recorded in `requests` (`method`, `path`, `query`, `body`, `content_type`). A route
answers (status, JSON payload), fixed or computed from (query, body); anything else is a 404
`Status`. A GET with ``watch=true`` on a `watch_path` streams `watch_events` (one JSON line each),
then ends the stream, or (`hold`) holds it open until `release` is set. HTTP/1.0, so every
response is ``Connection: close``.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kubernetes import client as k8s

Query = dict[str, list[str]]
Answer = tuple[int, Any]
Route = Answer | Callable[[Query, Any], Answer]


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    """A failure `Status` object, as the apiserver sends with an error code."""
    return {
        "kind": "Status",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }


class StubApiserver:
    """Routes, recorded requests and watch streams of one stub server (see the module docs)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.routes: dict[tuple[str, str], Route] = {}
        self.watch_paths: set[str] = set()
        self.watch_events: list[dict[str, Any]] = []
        self.hold = False
        self.release = threading.Event()
        self.client: k8s.ApiClient | None = None

    def route(self, method: str, path: str, answer: Route) -> None:
        """Answer `method` `path` with (status, payload), or a function of (query, body)."""
        self.routes[(method, path)] = answer

    @classmethod
    @contextlib.contextmanager
    def running(cls) -> Iterator[StubApiserver]:
        """A stub listening on a free port, with `client` pointing at it; stopped afterwards."""
        stub = cls()
        server = ThreadingHTTPServer(("127.0.0.1", 0), stub._handler())
        thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
        thread.start()
        configuration = k8s.Configuration()
        configuration.host = f"http://127.0.0.1:{server.server_address[1]}"
        stub.client = k8s.ApiClient(configuration)
        try:
            yield stub
        finally:
            stub.release.set()
            stub.client.close()  # type: ignore[no-untyped-call]
            server.shutdown()
            server.server_close()
            thread.join()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _answer(self) -> None:
                url = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                query = parse_qs(url.query)
                stub.requests.append(
                    {
                        "method": self.command,
                        "path": url.path,
                        "query": query,
                        "body": body,
                        "content_type": self.headers.get("Content-Type"),
                    }
                )
                if (
                    self.command == "GET"
                    and url.path in stub.watch_paths
                    and query.get("watch") == ["true"]
                ):
                    self._stream()
                    return
                route = stub.routes.get((self.command, url.path.rstrip("/") or "/"))
                if route is None:
                    code, payload = 404, status(404, "NotFound", f"{url.path} not found")
                elif callable(route):
                    code, payload = route(query, body)
                else:
                    code, payload = route
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                for event in stub.watch_events:
                    self.wfile.write(json.dumps(event).encode() + b"\n")
                    self.wfile.flush()
                if stub.hold:
                    stub.release.wait(10)

            def do_GET(self) -> None:
                self._answer()

            def do_POST(self) -> None:
                self._answer()

            def do_PUT(self) -> None:
                self._answer()

            def do_DELETE(self) -> None:
                self._answer()

            def do_PATCH(self) -> None:
                self._answer()

        return Handler
