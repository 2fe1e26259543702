"""HTTP client of one vLLM rollout server: token-in/token-out generation with the engine's own
sampled-token log-probs and weight version, and the weight-update lifecycle calls. Every request carries
the job's fleet secret (`megarl.rollout.fleet_auth`) when one is given or named by `MEGARL_FLEET_SECRET_FILE`."""

from __future__ import annotations

import base64
import binascii
import io
import logging
import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import requests

from megarl.rollout.fleet_auth import SECRET_ENV, bearer_header, read_secret
from megarl.rollout.inflight import engine_external_id, token_versions_from_spans
from megarl.rollout.liveness import Liveness
from megarl.schedule import version_of_label
from megarl.token_versions import TokenVersions

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)


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
    # weight version of the response's first token (its oldest; every token's when no push landed while it generated)
    policy_version: int
    # [prompt + response - 1, moe_layers, top_k] experts the engine routed each forwarded token to (uint8, or int16
    # beyond 256 experts); None unless the server returns routed experts (rollout.return_routed_experts)
    routed_experts: np.ndarray | None = None
    # the version of each response token, from the engine's own spans (`megarl.rollout.inflight`); a response with
    # no push inside it is `TokenVersions.single(policy_version, len(response_ids))`. None only for a Sample built
    # by hand (tests, benches)
    token_versions: TokenVersions | None = None
    request_id: str | None = None  # the id the client sent the prompt's request with (shared by its n samples)


def _version_number(label: str | None) -> int:
    """vLLM labels weights loaded at start-up `"default"`: that is policy version 0; megarl labels pushes with
    the integer policy version (`megarl.schedule.version_of_label`)."""
    try:
        return version_of_label(label)
    except ValueError as err:
        raise RolloutServerError(str(err)) from None


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
                 ignore_eos: bool = False, cache_salt: str | None = None, min_tokens: int = 0,
                 request_ids: list[str] | None = None, require_spans: bool = False) -> list[list[Sample]]:
        """K = n samples for each prompt (one request per prompt, sent concurrently). `seed`: the sampling seed
        of each prompt (a list), or of the first one with the others following it (an int). `max_tokens`: the
        response budget of every prompt, or of each (a list); `ignore_eos`: sample on past EOS to the budget
        (vLLM's `ignore_eos`; `megarl bench longtail` uses it to set response lengths); `min_tokens`: no EOS before
        that many tokens (vLLM's `min_tokens`, `rollout.min_new_tokens`). `cache_salt`: vLLM's
        prefix-cache salt of every request (`megarl.schedule.VersionClock.salt`: requests that run under different
        versions never share cached blocks). `request_ids`: the id of each prompt's request (default: fresh ones),
        which the engine's counts at an in-flight pause are keyed by (`FleetLifecycle.held`). `require_spans`
        (`sync.inflight`): a choice without the engine's version spans is an error (see `_sample`)."""
        for name, value in (("seeds", seed), ("max_tokens", max_tokens), ("request_ids", request_ids)):
            if isinstance(value, list) and len(value) != len(prompt_token_ids):
                raise ValueError(f"{len(value)} {name} for {len(prompt_token_ids)} prompts")

        def one(i: int, prompt: list[int]) -> list[Sample]:
            budget = max_tokens[i] if isinstance(max_tokens, list) else max_tokens
            params = {"n": n, "max_tokens": budget, "temperature": temperature, "top_p": top_p, "logprobs": 0}
            if ignore_eos:
                params["ignore_eos"] = True
            if min_tokens:
                params["min_tokens"] = min_tokens
            if seed is not None:
                params["seed"] = seed[i] if isinstance(seed, list) else seed + i
            rid = request_ids[i] if request_ids is not None else f"megarl-{uuid.uuid4().hex}"
            body: dict[str, Any] = {"token_ids": prompt, "sampling_params": params, "request_id": rid}
            if cache_salt is not None:
                body["cache_salt"] = cache_salt
            reply = self._post("/inference/v1/generate", body)
            choices = reply.get("choices") if isinstance(reply, dict) else None
            if not isinstance(choices, list) or len(choices) != n:
                raise RolloutServerError(f"{self.url}/inference/v1/generate: want {n} choices, got {str(reply)[:500]}")
            return [self._sample(prompt, c, rid, require_spans) for c in sorted(choices, key=lambda c: c["index"])]

        return list(self._pool.map(lambda a: one(*a), enumerate(prompt_token_ids)))

    def abort_requests(self, request_ids: list[str], timeout_s: float | None = None) -> None:
        """End the generate requests sent with these `request_id`s now (vLLM's `/abort_requests`, by external id,
        `megarl.rollout.inflight.engine_external_id`): each one's generate call answers with the tokens it had, its
        choices' `finish_reason` "abort"; an id the engine no longer runs is ignored. The route aborts EVERY request
        when given none, so an empty list is refused here."""
        if not request_ids:
            raise ValueError("abort_requests([]) would abort every request in the engine; name the requests")
        self._post("/abort_requests", {"request_ids": [engine_external_id(r) for r in request_ids]},
                   timeout_s=timeout_s)

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """The engine's log-prob of each token of `token_ids` given the ones before it (len - 1 values)."""
        params = {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        reply = self._post("/inference/v1/generate", {"token_ids": token_ids, "sampling_params": params})
        per_position = reply.get("prompt_logprobs")
        if not per_position or len(per_position) != len(token_ids):
            raise RolloutServerError(f"{self.url}: no prompt log-probs in the reply: {str(reply)[:500]}")
        return [float(pos[str(tok)]["logprob"]) for pos, tok in zip(per_position[1:], token_ids[1:], strict=True)]

    def _sample(self, prompt: list[int], choice: dict[str, Any], request_id: str | None = None,
                require_spans: bool = False) -> Sample:
        """A `Sample` from one choice; its token versions are the ones vLLM recorded for the tokens
        (`weight_versions` spans: the label set by `finish_weight_update(weight_version=...)` of each model step that
        produced them, `megarl.rollout.inflight`). A choice without spans: with `require_spans` (`sync.inflight`, where
        a push may land while the response generates) `RolloutServerError` naming this server and the request, since
        the server's newest label would under-count the lag of its older tokens; otherwise `/weight_info`'s label for
        every token (no push lands while a request generates: the fleet is quiesced before each)."""
        ids = choice.get("token_ids") or []
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) != len(ids) or any(c["token_id"] != t for c, t in zip(content, ids, strict=False)):
            raise RolloutServerError(f"{self.url}: log-probs do not match the sampled tokens in {choice}")
        missing = missing_logprobs(content)
        if missing:
            logger.warning("%s: request %s: %s (kept as sent: the trainer meets them)", self.url, request_id, missing)
        spans = choice.get("weight_versions") or []
        if spans:
            try:
                token_versions = token_versions_from_spans(spans, len(ids))
            except ValueError as err:
                raise RolloutServerError(f"{self.url}: {err}") from None
            version = token_versions.oldest
        elif require_spans and ids:
            raise RolloutServerError(
                f"{self.url}: request {request_id}, choice {choice.get('index')}: the reply carries no weight_versions "
                f"spans for its {len(ids)} tokens; with sync.inflight a push may land while a response generates, so "
                "its tokens' versions must come from the engine's spans (vLLM 0.32's /inference/v1/generate sends "
                "them), not from the server's newest label")
        else:
            version = _version_number(self.weight_version())
            token_versions = TokenVersions.single(version, len(ids))
        routes = choice.get("routed_experts")
        if routes is not None:
            try:
                routes = decode_routed_experts(routes, len(prompt) + len(ids) - 1)
            except RolloutServerError as err:
                raise RolloutServerError(f"{self.url}: {err}") from None
        return Sample(prompt, list(ids), [float(c["logprob"]) for c in content], choice.get("finish_reason"),
                      version, routes, token_versions, request_id)

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

    def pause(self, timeout_s: float | None = None, mode: Literal["wait", "keep", "abort"] = "wait",
              clear_cache: bool = True) -> None:
        """Pause generation. `wait`: stop admitting requests and return once the running ones have finished;
        `keep` (in-flight updates, `megarl.rollout.inflight`): stop stepping at once and return once no model step
        is in flight; the running requests stay frozen in the engine until `resume`. `abort`: end every request in
        the engine (running, waiting or frozen by `keep`) at once: each generate call answers 200 with what it had,
        its choices' `finish_reason` "abort"; the engine stays paused (requests sent later wait, unscheduled, until
        `resume`). `clear_cache`: then empty the
        prefix cache; in vLLM 0.32 this also preempts every running request, whose KV is then recomputed when it
        is scheduled again (so keep mode keeps the KV only with `clear_cache=False`, whatever vLLM's route
        docstring says). `timeout_s` here and in the other calls of a push: this call's timeout (default the
        client's; a push passes its own bound, `megarl.sync.lifecycle`)."""
        self._post("/pause", params={"mode": mode, "clear_cache": str(clear_cache).lower()}, timeout_s=timeout_s)

    def reset_prefix_cache(self, preempt_running: bool, timeout_s: float | None = None) -> bool:
        """Empty the engine's prefix cache; `preempt_running`: first preempt every running request (its KV is
        freed and recomputed over prompt + output when it is scheduled again: `sync.inflight_kv=recompute`).
        Whether the cache was emptied (without preempting, vLLM refuses while requests hold blocks)."""
        reply = self._post("/reset_prefix_cache", params={"reset_running_requests": str(preempt_running).lower()},
                           timeout_s=timeout_s)
        return bool(isinstance(reply, dict) and reply.get("success"))

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

    def collective_rpc(self, method: str, timeout_s: float | None = None, args: list[str] | None = None) -> list[Any]:
        """Call `method` of every worker (server dev mode), with positional `args` (strings: vLLM's route passes
        only those), and return their results in rank order."""
        body: dict[str, Any] = {"method": method, **({"args": args} if args else {})}
        reply = self._post("/collective_rpc", body, timeout_s=timeout_s)
        if not isinstance(reply, dict) or "results" not in reply:
            raise RolloutServerError(f"{self.url}/collective_rpc({method}): no results in {str(reply)[:500]}")
        return reply["results"]


MISSING_LOGPROB = -9999.0  # vLLM's floor for a logprob (`entrypoints/scale_out/token_in_token_out/serving.py`)


def missing_logprobs(content: list[dict[str, Any]]) -> str:
    """What a generate reply's `logprobs.content` says about sampled tokens sent with vLLM's floor, -9999.0 (''
    if none): vLLM sends it for a NaN or -inf log-prob (the entry keeps its `top_logprobs`, a diverged model's) and
    for a sampled token the engine reported no log-prob for (no `top_logprobs`: the engine's log-probs and tokens
    disagree). Either makes the token's train-inference ratio overflow (`mismatch/k3_kl` inf); a diagnostic, the
    values are kept."""
    floored = [(i, bool(c.get("top_logprobs"))) for i, c in enumerate(content)
               if float(c.get("logprob", 0.0)) <= MISSING_LOGPROB]
    if not floored:
        return ""
    clamped = [i for i, top in floored if top]
    absent = [i for i, top in floored if not top]
    parts = [f"{len(clamped)} with a NaN or -inf log-prob (positions {clamped[:8]})" if clamped else "",
             f"{len(absent)} the engine reported no log-prob for (positions {absent[:8]})" if absent else ""]
    return (f"{len(floored)} of {len(content)} sampled tokens came back with vLLM's {MISSING_LOGPROB} floor: "
            + ", ".join(p for p in parts if p))


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
