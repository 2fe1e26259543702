"""HTTP client of one vLLM rollout server: token-in/token-out generation with the engine's own
sampled-token log-probs and weight version, and the weight-update lifecycle calls. Every request carries
the job's fleet secret (`megarl.rollout.fleet_auth`) when one is given or named by `MEGARL_FLEET_SECRET_FILE`."""

from __future__ import annotations

import base64
import binascii
import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import requests

from megarl.rollout.fleet_auth import SECRET_ENV, bearer_header, read_secret
from megarl.rollout.liveness import Liveness

if TYPE_CHECKING:
    import numpy as np


class RolloutServerError(RuntimeError):
    """The rollout server is unreachable or answered with an error or a reply megarl cannot use."""


class RolloutServerLost(RolloutServerError):
    """The rollout server stopped answering: connection refused or reset, a timeout, a 5xx reply (its engine
    died or is failing), or its `/health` failing for longer than the client's `health_timeout_s` while a call
    waited. The rollout worker gives such a replica's work to the others (`RolloutWorker`)."""


class RolloutServerHung(RolloutServerLost):
    """A call was not answered within its timeout although the server's `/health` kept answering: its engine or a
    worker hangs (a stopped or wedged vLLM worker leaves the API server's `/health` at 200). The launcher cannot
    see that from `/health`: the trainer condemns such a replica (`megarl.rollout.rendezvous.condemn_replica`)."""


@dataclass
class Sample:
    """One sampled response to one prompt, as the engine produced it."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]  # the engine's log-prob of each sampled token
    finish_reason: str | None
    policy_version: int  # weight version the engine reports for every token of the response
    # [prompt + response - 1, moe_layers, top_k] experts the engine routed each forwarded token to (uint8, or int16
    # beyond 256 experts); None unless the server returns routed experts (rollout.return_routed_experts)
    routed_experts: np.ndarray | None = None


def _version_number(label: str | None) -> int:
    """vLLM labels weights loaded at start-up `"default"`: that is policy version 0; megarl labels pushes with
    the integer policy version."""
    if label in (None, "", "default"):
        return 0
    try:
        return int(label)
    except ValueError:
        raise RolloutServerError(f"weight version {label!r} was not set by megarl (expected an integer)") from None


def decode_routed_experts(encoded: str, forwarded_tokens: int) -> np.ndarray:
    """vLLM's `routed_experts` reply field (base64 of a `.npy` array `[forwarded tokens, moe_layers, top_k]`) as a
    compact integer array: uint8 stays, wider types become int16 (expert ids below 32768). `forwarded_tokens` =
    prompt + response - 1 (the engine never forwards the last sampled token); another length is an error."""
    import numpy as np

    try:
        routes = np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)
    except (ValueError, binascii.Error, OSError) as err:
        raise RolloutServerError(f"routed_experts is not a base64 .npy array: {err}") from None
    if routes.ndim != 3 or routes.shape[0] != forwarded_tokens or routes.dtype.kind not in "iu":
        raise RolloutServerError(f"routed_experts has shape {routes.shape} and dtype {routes.dtype}; expected "
                                 f"[{forwarded_tokens} (prompt + response - 1), moe_layers, top_k] integers")
    if routes.dtype == np.uint8:
        return routes
    if routes.size and (int(routes.min()) < 0 or int(routes.max()) >= 2**15):
        raise RolloutServerError(f"routed_experts holds expert ids outside [0, 32768): [{int(routes.min())}, "
                                 f"{int(routes.max())}]")
    return routes.astype(np.int16)


class RolloutClient:
    """Token-in/token-out generation and the weight-update lifecycle of one vLLM server at `base_url`.
    `secret_file`: the fleet's secret (`FleetHandle.secret_file`); None: the file named by
    `MEGARL_FLEET_SECRET_FILE` if that is set, else no secret (an unguarded server).

    `health_timeout_s` (a run's `rollout.health_timeout_s`): every call watches the server's `/health` while it
    waits (`megarl.rollout.liveness`) and raises `RolloutServerLost` once `/health` has failed that long, instead of
    waiting for `timeout_s` (the read timeout of a live but slow call: a push at 30B, a long generation). The
    abandoned request's thread ends when its connection does (the replica's launcher kills what is left of it).
    None: calls wait for `timeout_s` only."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, max_parallel: int = 32,
                 secret_file: Path | None = None, health_timeout_s: float | None = None) -> None:
        self.url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.liveness = Liveness(self.url, health_timeout_s) if health_timeout_s else None
        secret_file = secret_file or os.environ.get(SECRET_ENV) or None
        self._headers = bearer_header(read_secret(secret_file)) if secret_file else {}
        self._pool = ThreadPoolExecutor(max_parallel)

    # ---- plumbing --------------------------------------------------------------------------------------------
    def _request(self, method: str, route: str, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """One HTTP call (`timeout_s`: this call's, default the client's); a dead server or a non-200 reply raises
        naming the URL, the status and the body."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            r = self._send(method, route, timeout, **kwargs)
        except requests.ReadTimeout:
            raise RolloutServerHung(f"rollout server {self.url}{route} did not answer within {timeout:g}s") from None
        except requests.RequestException as err:
            raise RolloutServerLost(f"rollout server {self.url}{route} unreachable: {err}") from None
        if r.status_code == 401:
            sent = "refused this job's fleet secret" if self._headers else "requires a fleet secret and none was sent"
            raise RolloutServerError(f"rollout server {self.url}{route} {sent} (401): point {SECRET_ENV} (or "
                                     "RolloutClient's secret_file) at the secret file the fleet was started with")
        if r.status_code >= 500:
            raise RolloutServerLost(f"rollout server {self.url}{route} answered {r.status_code}: {_error_message(r)}")
        if r.status_code != 200:
            raise RolloutServerError(f"rollout server {self.url}{route} answered {r.status_code}: {_error_message(r)}")
        try:
            return r.json() if r.content else None
        except ValueError:
            raise RolloutServerError(f"rollout server {self.url}{route} sent non-JSON: {r.text[:500]}") from None

    def _send(self, method: str, route: str, timeout: float, **kwargs: Any) -> requests.Response:
        """The HTTP call itself; with `liveness`, made in a thread of its own while this one watches the server's
        health (a call that answers within a probe interval costs no probe)."""
        def call() -> requests.Response:
            return requests.request(method, f"{self.url}{route}", timeout=timeout, headers=self._headers, **kwargs)

        if self.liveness is None:
            return call()
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["reply"] = call()
            except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = err
            finally:
                done.set()

        threading.Thread(target=run, daemon=True, name=f"megarl-call{route.replace('/', '-')}").start()
        while not done.wait(self.liveness.every_s):
            if self.liveness.dead():
                raise RolloutServerLost(f"rollout server {self.url}{route}: gave up waiting, the replica is dead: "
                                        f"{self.liveness.why()}")
        if "error" in box:
            raise box["error"]
        return box["reply"]

    def _post(self, route: str, body: dict[str, Any] | None = None, params: dict | None = None,
              timeout_s: float | None = None) -> Any:
        return self._request("POST", route, timeout_s=timeout_s, json=body, params=params)

    def _get(self, route: str, timeout_s: float | None = None) -> Any:
        return self._request("GET", route, timeout_s=timeout_s)

    # ---- generation ------------------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], n: int, max_tokens: int | list[int],
                 temperature: float = 1.0, top_p: float = 1.0, seed: int | list[int] | None = None,
                 ignore_eos: bool = False) -> list[list[Sample]]:
        """K = n samples for each prompt (one request per prompt, sent concurrently). `seed`: the sampling seed
        of each prompt (a list), or of the first one with the others following it (an int). `max_tokens`: the
        response budget of every prompt, or of each (a list); `ignore_eos`: sample on past EOS to the budget
        (vLLM's `ignore_eos`; `megarl bench longtail` uses it to set response lengths)."""
        for name, value in (("seeds", seed), ("max_tokens", max_tokens)):
            if isinstance(value, list) and len(value) != len(prompt_token_ids):
                raise ValueError(f"{len(value)} {name} for {len(prompt_token_ids)} prompts")

        def one(i: int, prompt: list[int]) -> list[Sample]:
            budget = max_tokens[i] if isinstance(max_tokens, list) else max_tokens
            params = {"n": n, "max_tokens": budget, "temperature": temperature, "top_p": top_p, "logprobs": 0}
            if ignore_eos:
                params["ignore_eos"] = True
            if seed is not None:
                params["seed"] = seed[i] if isinstance(seed, list) else seed + i
            reply = self._post("/inference/v1/generate", {"token_ids": prompt, "sampling_params": params})
            choices = reply.get("choices") if isinstance(reply, dict) else None
            if not isinstance(choices, list) or len(choices) != n:
                raise RolloutServerError(f"{self.url}/inference/v1/generate: want {n} choices, got {str(reply)[:500]}")
            return [self._sample(prompt, c) for c in sorted(choices, key=lambda c: c["index"])]

        return list(self._pool.map(lambda a: one(*a), enumerate(prompt_token_ids)))

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """The engine's log-prob of each token of `token_ids` given the ones before it (len - 1 values)."""
        params = {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        reply = self._post("/inference/v1/generate", {"token_ids": token_ids, "sampling_params": params})
        per_position = reply.get("prompt_logprobs")
        if not per_position or len(per_position) != len(token_ids):
            raise RolloutServerError(f"{self.url}: no prompt log-probs in the reply: {str(reply)[:500]}")
        return [float(pos[str(tok)]["logprob"]) for pos, tok in zip(per_position[1:], token_ids[1:], strict=True)]

    def _sample(self, prompt: list[int], choice: dict[str, Any]) -> Sample:
        """A `Sample` from one choice; its version is the one vLLM recorded for the tokens (`weight_versions`
        spans, set by `finish_weight_update(weight_version=...)`), or `/weight_info` if the reply has none."""
        ids = choice.get("token_ids") or []
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) != len(ids) or any(c["token_id"] != t for c, t in zip(content, ids, strict=False)):
            raise RolloutServerError(f"{self.url}: log-probs do not match the sampled tokens in {choice}")
        spans = choice.get("weight_versions") or []
        versions = {s["version"] for s in spans}
        if len(versions) > 1:
            raise RolloutServerError(f"{self.url}: one response spans weight versions {sorted(versions)}")
        version = _version_number(versions.pop() if versions else self.weight_version())
        routes = choice.get("routed_experts")
        if routes is not None:
            try:
                routes = decode_routed_experts(routes, len(prompt) + len(ids) - 1)
            except RolloutServerError as err:
                raise RolloutServerError(f"{self.url}: {err}") from None
        return Sample(prompt, list(ids), [float(c["logprob"]) for c in content], choice.get("finish_reason"),
                      version, routes)

    def healthy(self, timeout_s: float = 10.0) -> bool:
        """Whether the server answers `/health` with 200 within `timeout_s` (its engine and workers are alive);
        cheap, and not queued behind a busy engine."""
        try:
            return requests.get(f"{self.url}/health", timeout=timeout_s, headers=self._headers).status_code == 200
        except requests.RequestException:
            return False

    # ---- weights ---------------------------------------------------------------------------------------------
    def weight_version(self, timeout_s: float | None = None) -> str | None:
        """The label of the weights the server is serving now (`"default"` until the first update); `timeout_s`:
        this call's timeout (default the client's)."""
        return self._get("/weight_info", timeout_s=timeout_s).get("weight_version")

    def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Every worker creates its weight-transfer engine and joins the sync group (blocks until all joined)."""
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def pause(self, timeout_s: float | None = None) -> None:
        """Stop scheduling new steps once the running ones finish (`mode=wait`). `timeout_s` here and in the other
        calls of a push: this call's timeout (default the client's; a push passes its own bound,
        `megarl.sync.lifecycle`)."""
        self._post("/pause", params={"mode": "wait"}, timeout_s=timeout_s)

    def resume(self, timeout_s: float | None = None) -> None:
        self._post("/resume", timeout_s=timeout_s)

    def is_paused(self) -> bool:
        """Whether generation is paused (a replica whose weight update failed part-way stays paused)."""
        return bool(self._get("/is_paused")["is_paused"])

    def start_weight_update(self, timeout_s: float | None = None) -> None:
        self._post("/start_weight_update", timeout_s=timeout_s)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]],
                       timeout_s: float | None = None) -> None:
        """Run `receive_weights` on the workers: one info for all, or a list with one per TP rank."""
        self._post("/update_weights", {"update_info": update_info}, timeout_s=timeout_s)

    def finish_weight_update(self, version: int | None, timeout_s: float | None = None) -> None:
        """End the update and label the served weights with `version` (reported with later samples);
        `None` keeps the current label (closing a session that loaded nothing)."""
        self._post("/finish_weight_update", {"weight_version": None if version is None else str(version)},
                   timeout_s=timeout_s)

    def collective_rpc(self, method: str, timeout_s: float | None = None) -> list[Any]:
        """Call `method` of every worker (server dev mode) and return their results in rank order."""
        reply = self._post("/collective_rpc", {"method": method}, timeout_s=timeout_s)
        if not isinstance(reply, dict) or "results" not in reply:
            raise RolloutServerError(f"{self.url}/collective_rpc({method}): no results in {str(reply)[:500]}")
        return reply["results"]


def _error_message(response: requests.Response) -> str:
    """The message of a vLLM error reply (`{"error": {"message": ...}}`, FastAPI's `{"detail": ...}`), else its text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:2000]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])[:2000]
        for key in ("error", "detail", "message"):
            if key in body:
                return str(body[key])[:2000]
    return response.text[:2000]
