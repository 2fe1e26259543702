"""A guarded fleet: on the session's real vLLM server every route but `/health` (every one the server's own
OpenAPI schema lists, and the ones it leaves out) refuses requests without the job's secret and keeps its state;
the secret file is private and never logged. The middleware's fail-closed behaviour is driven directly through
its ASGI interface."""

from __future__ import annotations

import asyncio
import json
import re
import stat
from pathlib import Path
from typing import Any

import pytest
import requests

from megarl.rollout.client import RolloutClient, RolloutServerError
from megarl.rollout.fleet_auth import (
    SECRET_ENV,
    FleetAuthMiddleware,
    FleetSecretError,
    bearer_header,
    new_fleet_secret,
    read_secret,
)

# routes the server has that its schema does not list (mounted apps, the docs, and no route at all)
UNLISTED = [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/metrics"),
            ("GET", "/metrics/"), ("GET", "/no_such_route"), ("OPTIONS", "/pause"), ("GET", "/health/extra")]
# routes that must be among the guarded ones (the RL lifecycle, the RPC and generation routes)
MUST_HAVE = {"/pause", "/resume", "/is_paused", "/start_weight_update", "/update_weights", "/finish_weight_update",
             "/init_weight_transfer_engine", "/weight_info", "/collective_rpc", "/inference/v1/generate",
             "/v1/models", "/tokenize"}
# a POST body that would change the served version if any route accepted it
BODY = {"weight_version": "999", "new_version": "999", "method": "megarl_sync_report"}
HTTP_METHODS = {"get", "post", "put", "delete", "patch", "head", "options"}


def _routes(url: str, secret: str) -> list[tuple[str, str]]:
    """Every (method, path) of the server's OpenAPI schema (path parameters filled in), plus `UNLISTED`."""
    reply = requests.get(f"{url}/openapi.json", headers=bearer_header(secret), timeout=60)
    assert reply.status_code == 200, reply.text
    listed = [(method.upper(), re.sub(r"\{[^}]*\}", "x", path))
              for path, ops in reply.json()["paths"].items() for method in ops if method in HTTP_METHODS]
    return listed + UNLISTED


def test_every_route_but_health_needs_the_secret(moe_fleet):
    url, secret = moe_fleet.base_url, read_secret(moe_fleet.secret_file)
    client = RolloutClient(url, timeout_s=120, secret_file=moe_fleet.secret_file)
    version = client.weight_version()
    routes = _routes(url, secret)
    assert MUST_HAVE <= {path for _, path in routes}
    refused = 0
    for headers in ({}, bearer_header("wrong"), bearer_header(secret + "x"), bearer_header(secret[:-1]),
                    {"Authorization": f"Basic {secret}"}, {"Authorization": secret}):
        for method, path in routes:
            if path == "/health":
                continue
            r = requests.request(method, f"{url}{path}", headers=headers, json=BODY if method == "POST" else None,
                                 params={"mode": "abort"}, timeout=60)
            assert r.status_code == 401, f"{method} {path} answered {r.status_code} without the secret: {r.text[:200]}"
            assert method == "HEAD" or SECRET_ENV in r.json()["error"]["message"]
            assert secret not in r.text
            refused += 1
    assert refused > 6 * len(MUST_HAVE)
    assert requests.get(f"{url}/health", timeout=30).status_code == 200  # the health probe stays open
    # nothing the refused requests asked for happened: same version, not paused, and generation works
    assert client.weight_version() == version
    paused = requests.get(f"{url}/is_paused", headers=bearer_header(secret), timeout=30)
    assert paused.status_code == 200 and paused.json()["is_paused"] is False
    groups = client.generate([[6, 23, 7, 24]], n=2, max_tokens=3, seed=0)
    assert [len(g) for g in groups] == [2] and all(s.response_ids for s in groups[0])


def test_client_names_a_refused_secret(moe_fleet, tmp_path, monkeypatch):
    secret = read_secret(moe_fleet.secret_file)
    wrong = new_fleet_secret(tmp_path)
    with pytest.raises(RolloutServerError, match=rf"refused this job's fleet secret \(401\).*{SECRET_ENV}") as err:
        RolloutClient(moe_fleet.base_url, timeout_s=60, secret_file=wrong).weight_version()
    assert secret not in str(err.value) and read_secret(wrong) not in str(err.value)
    monkeypatch.delenv(SECRET_ENV)  # set by the fleet fixture
    with pytest.raises(RolloutServerError, match=rf"requires a fleet secret and none was sent.*{SECRET_ENV}"):
        RolloutClient(moe_fleet.base_url, timeout_s=60).pause()
    monkeypatch.setenv(SECRET_ENV, str(moe_fleet.secret_file))  # the variable alone is enough
    assert RolloutClient(moe_fleet.base_url, timeout_s=60).weight_version() is not None


def test_secret_file_is_private_and_never_logged(moe_fleet):
    assert stat.S_IMODE(moe_fleet.secret_file.stat().st_mode) == 0o600
    secret = read_secret(moe_fleet.secret_file)
    assert moe_fleet.logs and all(secret not in log.read_text(errors="replace") for log in moe_fleet.logs)


def test_new_secret_is_private_fresh_and_never_overwritten(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = new_fleet_secret(tmp_path / "a"), new_fleet_secret(tmp_path / "b")
    assert stat.S_IMODE(a.stat().st_mode) == 0o600 and len(read_secret(a)) >= 40 and read_secret(a) != read_secret(b)
    with pytest.raises(FileExistsError):
        new_fleet_secret(tmp_path / "a")
    loose = tmp_path / "loose"
    loose.write_text("s3cret")
    loose.chmod(0o644)
    with pytest.raises(FleetSecretError, match="accessible to other users"):
        read_secret(loose)


# ---- the middleware alone, through its ASGI interface ----------------------------------------------------------
async def _server(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The app behind the guard: records lifespan scopes, answers 200 to HTTP requests."""
    if scope["type"] == "lifespan":
        scope["reached"] = True
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b'{"ok": true}'})


def _call(path: str, authorization: str | None = None, kind: str = "http") -> tuple[int, dict[str, Any]]:
    """Status and JSON body of one request through a fresh middleware (it reads the environment when made)."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    scope = {"type": kind, "method": "GET", "path": path, "root_path": "", "headers": headers}
    asyncio.run(FleetAuthMiddleware(_server)(scope, receive, send))
    if kind == "websocket":
        return (1008 if sent == [] or sent[0]["type"] == "websocket.close" else 0), {}
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


def _unusable(kind: str, tmp_path: Path) -> Path:
    path = tmp_path / kind
    if kind == "empty":
        path.touch(mode=0o600)
    elif kind == "group_readable":
        path.write_text("s3cret")
        path.chmod(0o640)
    return path  # "missing": not created


@pytest.mark.parametrize("problem", ["unset", "missing", "empty", "group_readable"])
def test_guard_fails_closed_without_a_usable_secret(problem, tmp_path, monkeypatch):
    if problem == "unset":
        monkeypatch.delenv(SECRET_ENV, raising=False)
    else:
        monkeypatch.setenv(SECRET_ENV, str(_unusable(problem, tmp_path)))
    for path, authorization in [("/v1/models", None), ("/pause", "Bearer s3cret"), ("/collective_rpc", "Bearer ")]:
        status, body = _call(path, authorization)
        assert status == 503 and SECRET_ENV in body["error"]["message"]
        assert str(tmp_path) not in body["error"]["message"]  # the reason goes to the server log, not the client
    assert _call("/health")[0] == 200
    lifespan: dict[str, Any] = {"type": "lifespan"}
    asyncio.run(FleetAuthMiddleware(_server)(lifespan, None, None))  # type: ignore[arg-type]
    assert lifespan.get("reached")


def test_guard_checks_the_bearer_secret(tmp_path, monkeypatch):
    secret_file = new_fleet_secret(tmp_path)
    secret = read_secret(secret_file)
    monkeypatch.setenv(SECRET_ENV, str(secret_file))
    assert _call("/pause", f"Bearer {secret}")[0] == 200
    assert _call("/pause", f"bearer {secret}")[0] == 200  # the scheme is case-insensitive
    for wrong in [None, "Bearer", f"Bearer {secret}x", f"Basic {secret}", secret, "Bearer " + secret.upper()]:
        status, body = _call("/pause", wrong)
        assert status == 401 and secret not in json.dumps(body)
    assert _call("/health")[0] == 200
    assert _call("/realtime", None, kind="websocket")[0] == 1008  # a WebSocket is closed before it is accepted
