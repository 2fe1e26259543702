"""A guarded fleet: every route of a vLLM server except `/health` requires the job's secret.

vLLM's own `--api-key` guards only `/v1`, `/v2`, `/inference` and `/cohere`; the RL routes (`/pause`,
`/update_weights`, ...) and `/collective_rpc` would stay open to anyone who can reach the server.
`FleetAuthMiddleware` is loaded into each server with `--middleware megarl.rollout.fleet_auth.FleetAuthMiddleware`
and reads the secret from the file named by `MEGARL_FLEET_SECRET_FILE`; clients send
`Authorization: Bearer <secret>`. Standard library only: the server imports this module, and so does the trainer.
The secret itself is never logged, echoed or put in an error message.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import stat
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

SECRET_ENV = "MEGARL_FLEET_SECRET_FILE"  # path of the file holding the job's secret (mode 0600)
SECRET_FILENAME = "fleet_secret"  # the name `new_fleet_secret` gives the file
OPEN_PATHS = frozenset({"/health"})  # the only routes served without the secret

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

logger = logging.getLogger(__name__)


class FleetSecretError(RuntimeError):
    """The secret file is missing, unreadable, empty or readable by other users."""


def new_fleet_secret(directory: Path) -> Path:
    """Write a fresh per-job secret to `directory/fleet_secret`, created with mode 0600 (never overwriting an
    existing file: `FileExistsError`), and return its path."""
    path = Path(directory) / SECRET_FILENAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32))
    return path.resolve()


def read_secret(path: Path | str) -> str:
    """The secret stored in `path`; raises `FleetSecretError` if the file cannot be read, is empty, or other
    users may read it (group/other permission bits set)."""
    try:
        mode = os.stat(path).st_mode
        text = Path(path).read_text().strip()
    except OSError as err:
        raise FleetSecretError(f"cannot read the fleet secret file {path} ({err.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise FleetSecretError(f"the fleet secret file {path} is accessible to other users "
                               f"(mode {stat.S_IMODE(mode):o}); make it 0600")
    if not text:
        raise FleetSecretError(f"the fleet secret file {path} is empty")
    return text


def bearer_header(secret: str) -> dict[str, str]:
    """The HTTP header that carries `secret`."""
    return {"Authorization": f"Bearer {secret}"}


class FleetAuthMiddleware:
    """Pure ASGI middleware: HTTP and WebSocket requests to any path but `/health` need
    `Authorization: Bearer <secret>` (401 otherwise). Fails closed: without a usable secret file every such
    request gets 503. Other scopes (lifespan) pass through. vLLM adds it with `app.add_middleware(cls)`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._secret: bytes | None = None
        self._problem = ""
        path = os.environ.get(SECRET_ENV)
        if not path:
            self._problem = f"{SECRET_ENV} is not set"
        else:
            try:
                self._secret = read_secret(path).encode()
            except FleetSecretError as err:
                self._problem = f"{SECRET_ENV}: {err}"
        if self._secret is None:
            logger.error("megarl fleet guard: refusing every request but /health: %s", self._problem)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "") or "")
        if path in OPEN_PATHS:
            await self.app(scope, receive, send)
        elif self._secret is None:
            # the reason (which names a file path) goes to the server log only
            await _refuse(scope, send, 503, f"this server has no usable fleet secret ({SECRET_ENV} unset or its file "
                                            "unreadable; see the server log), so it refuses every request but /health")
        elif not _authorized(scope, self._secret):
            await _refuse(scope, send, 401, "missing or wrong fleet secret (Authorization: Bearer <secret from "
                                            f"the file named by {SECRET_ENV}>)")
        else:
            await self.app(scope, receive, send)


def _authorized(scope: Scope, secret: bytes) -> bool:
    """Exactly one `Authorization: Bearer <token>` header, with the token equal to `secret` (constant time)."""
    values = [v for k, v in scope.get("headers", []) if k.lower() == b"authorization"]
    if len(values) != 1:
        return False
    scheme, _, token = values[0].partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), secret)


async def _refuse(scope: Scope, send: Send, status: int, message: str) -> None:
    """Answer `status` with `{"error": {"message": ...}}` (a WebSocket is closed before it is accepted)."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
        return
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
