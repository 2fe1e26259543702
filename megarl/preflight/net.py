"""The network half of a check: listen where the real run listens, and connect where it connects.

A listener binds a plain TCP socket on the exact address and port the real server would (trainer rank 0's
rendezvous and weight-sync stores, a replica's HTTP port), accepts connections and closes them at once; a probe is a
plain TCP connect with a short timeout and a few tries. Both name what failed in one line."""

from __future__ import annotations

import selectors
import socket
import threading
import time
from typing import Any


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class Listeners:
    """Listening sockets served by one daemon thread until `close()`. A connection is closed once its prober has
    hung up, so the TIME_WAIT is the prober's (an ephemeral port), never the listening port's: the real job's
    stores must be able to bind it right after a preflight. `add` records each endpoint (ok or the
    error) in `endpoints`, the list a step's hello publishes."""

    def __init__(self) -> None:
        self.endpoints: list[dict[str, Any]] = []
        self._selector = selectors.DefaultSelector()
        self._sockets: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, what: str, host: str, port: int) -> dict[str, Any]:
        """Listen on host:port (port 0: one the kernel picks) for `what` (e.g. "weight-sync store")."""
        endpoint: dict[str, Any] = {"what": what, "host": host, "port": port, "ok": False, "error": None}
        sock = socket.socket(_family(host), socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's stores and vLLM's server do
        try:
            sock.bind((host, port))
            sock.listen(64)
        except OSError as err:
            sock.close()
            endpoint["error"] = err.strerror or str(err)
        else:
            sock.setblocking(False)
            endpoint |= {"ok": True, "port": sock.getsockname()[1]}
            self._sockets.append(sock)
            self._selector.register(sock, selectors.EVENT_READ)
        self.endpoints.append(endpoint)
        return endpoint

    def start(self) -> None:
        if self._sockets:
            self._thread = threading.Thread(target=self._serve, name="preflight-listeners", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.2):
                sock = key.fileobj
                if key.data == "conn":  # the prober hung up (or sent something): close our end after it
                    self._selector.unregister(sock)
                    sock.close()  # type: ignore[union-attr]
                    continue
                try:
                    conn, _ = sock.accept()  # type: ignore[union-attr]
                except OSError:
                    continue
                conn.setblocking(False)
                self._selector.register(conn, selectors.EVENT_READ, "conn")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()


def _describe(err: OSError, timeout_s: float) -> str:
    if isinstance(err, TimeoutError):
        return f"no answer within {timeout_s:g} s (a firewall dropping packets?)"
    return err.strerror or str(err) or type(err).__name__


def probe(what: str, host: str, port: int, to: str, timeout_s: float = 2.0, tries: int = 3,
          pause_s: float = 0.5) -> dict[str, Any]:
    """Connect to host:port (`what` there, owned by step `to`); the record says whether it worked, the last
    error, and the seconds spent."""
    start = time.monotonic()
    error = None
    for attempt in range(tries):
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                error = None
                break
        except OSError as err:
            error = _describe(err, timeout_s)
            if attempt + 1 < tries:
                time.sleep(pause_s)
    return {"what": what, "to": to, "target": f"{host}:{port}", "ok": error is None, "error": error,
            "seconds": round(time.monotonic() - start, 3)}
