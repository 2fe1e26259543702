"""A deliberately slow or dying replica: an HTTP proxy in front of a real vLLM server that holds every generate
request `delay_s` seconds before forwarding it, and after `answer` generate requests stops forwarding them and
answers 503 as a failing vLLM server does; requests to the `swallow` routes are answered 200 and never forwarded
(a replica that says yes and never does it). Everything else, and the replies, pass through unchanged."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests


@contextmanager
def slow_proxy(target: str, delay_s: float = 0.0, answer: int | None = None,
               swallow: tuple[str, ...] = ()) -> Iterator[str]:
    """The URL of a proxy to `target` that delays `/inference/v1/generate` by `delay_s`, answers 503 to every
    generate request after the first `answer` (None: never), and 200 with no body, unforwarded, to `swallow`."""
    lock, seen = threading.Lock(), [0]

    class Handler(BaseHTTPRequestHandler):
        def _forward(self, method: str) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path.split("?")[0] in swallow:
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if self.path.startswith("/inference/v1/generate"):
                with lock:
                    seen[0] += 1
                    dead = answer is not None and seen[0] > answer
                if dead:
                    self.send_error(503, "engine dead")
                    return
                time.sleep(delay_s)
            headers = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "content-type")}
            reply = requests.request(method, target + self.path, data=body or None, headers=headers, timeout=300)
            self.send_response(reply.status_code)
            self.send_header("Content-Type", reply.headers.get("Content-Type", "application/json"))
            self.send_header("Content-Length", str(len(reply.content)))
            self.end_headers()
            self.wfile.write(reply.content)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._forward("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._forward("POST")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
