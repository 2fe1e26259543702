"""In-flight weight updates on the real stack (`megarl.rollout.inflight`): two megatron-core trainer ranks push into
the session's real vLLM server (tensor parallel 2, at 1,024 positions: `tiny_moe_long_dir`) while 1,000-token
responses are generating, with the replica paused in vLLM's keep mode, once per KV setting (`sync.inflight_kv`),
each through a sync group of its own: keep through streamed full pushes, recompute through staged delta pushes (the
in-flight push a delta against the old weights).

Checked against independent references:
- the push did not wait for the responses: the engine's own model runner held every request, part-way, when the
  replica was paused (read by the test itself at the `push.paused.replica0` failpoint, `megarl_held_tokens`; the
  push is held just before its /pause until every request holds a few tokens, `_inflight_push`);
- no response restarted or lost tokens: its first tokens are exactly the ones the engine held at the pause, and it has
  the length asked for (ignore_eos);
- the `TokenVersions` of every response (from vLLM's own version spans) ends its first run exactly at the engine's
  count at the pause, the same count the lifecycle recorded (`FleetLifecycle.held`), and labels the rest with the new
  version;
- with `recompute`, the engine's log-prob of every token before the push equals transformers' fp32 forward of
  prompt + response under the OLD checkpoint, and of every token after it under the NEW one, within 1e-5;
  with `keep`, the tokens before the push still match the old weights, and the mismatch of the tokens after it
  against the new weights is measured and printed (and must be visible: stale KV changes them by far more than 1e-5).
- the engine's routing (read at vLLM's capture point, `megarl.rollout.routing_probe`, in the same run): every
  position routed once, the recomputed prefix twice; each position's first routing (the row vLLM returns for it) is
  transformers' routing at the version `route_segments` assigns to the row, and the re-prefill's is the new weights'
  (`_check_routing`; figures in docs/pipeline.md).

Tolerance: vLLM's CPU kernels (TP 2) and transformers both run fp32 with different reduction orders (~1e-6 per
token); a wrong or stale weight moves a log-prob by > 1e-2.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megarl.bench.engine_step import read_metrics
from megarl.config.schema import OptimizerConfig
from megarl.models.qwen_provider import read_hf_config
from megarl.rollout.fleet_auth import SECRET_ENV, bearer_header, read_secret
from megarl.rollout.inflight import engine_request_key, version_salt
from megarl.trainer.routing_replay import route_segments
from tests.dist_utils import free_port, run_distributed
from tests.fleet_fixture import perturbed_checkpoint

PROMPTS = [[6, 23, 7, 24], [5, 23, 5, 24, 11]]
N = 2  # samples per prompt: vLLM splits them into child requests `<index>_<parent id>`
MAX_TOKENS = 1000  # within the served context (`LONG_POSITIONS`): a response lasts many of the push's way to its pause
HELD_AT_LEAST = 8  # every request has this many tokens before the in-flight push pauses the replica
GENERATED = "vllm:generation_tokens_total"  # vLLM's counter of the tokens its engine generated
VERSIONS = {"keep": 61, "recompute": 71}  # the first (old, new) versions per KV setting: (base, base + 1)
# how each setting's sync group takes its pushes: keep through streamed full pushes, recompute through staged deltas
# (its first push, of the old weights, is full; the in-flight one a delta against it)
RECEIVE = {"keep": {"receive": "streamed"}, "recompute": {"receive": "staged", "delta": True}}
# the machine is shared: if the responses still finish before the replica is paused (the poll that releases the
# push comes too late), or one of them holds fewer than HELD_AT_LEAST tokens at the pause (the engine scheduled it
# late), the run is inconclusive and is repeated (old weights pushed again, new responses), at most this many times
ATTEMPTS = 6
# router-logit margin between the k-th and the (k+1)-th expert below which engine and transformers may pick
# differently (fp32 with other reduction orders: logits differ by ~1e-6); such (row, layer) pairs are not compared
ROUTE_TIE = 1e-4


@pytest.fixture(scope="module")
def new_checkpoint(tiny_moe_long_dir, tmp_path_factory):
    return perturbed_checkpoint(tiny_moe_long_dir, tmp_path_factory.mktemp("inflight_new"), seed=11)


def _trainer(rank, world, old_dir, new_dir, url, port, sync_ports, points):
    from megarl.parallel.groups import TrainerLayout, destroy_trainer_groups, init_trainer_groups
    from megarl.rollout.client import RolloutClient
    from megarl.sync.weight_sync import PartitionedWeightSync
    from megarl.trainer.policy import MegatronPolicy

    init_trainer_groups(TrainerLayout(1, 1, 2), rank, world, "127.0.0.1", port)
    try:
        hf = read_hf_config(old_dir)
        old = list(MegatronPolicy(old_dir, hf, OptimizerConfig()).iter_local_hf_slices())
        new_tensors = load_file(Path(new_dir) / "model.safetensors")
        new = [(s, new_tensors[s.name][tuple(slice(a, b) for a, b in s.box)].contiguous().to(t.dtype))
               for s, t in old]
        client = RolloutClient(url) if rank == 0 else None
        out = {}
        for (kv, base), sync_port in zip(VERSIONS.items(), sync_ports, strict=True):
            if kv != next(iter(VERSIONS)):
                torch.distributed.barrier()  # the previous sync group is left on every rank first
            sync = PartitionedWeightSync(rank, world, hf, [client] if client else [], rollout_tp=2,
                                         rollout_replicas=1, store_host="127.0.0.1", store_port=sync_port,
                                         bucket_bytes=256 << 10, timeout_s=120, **RECEIVE[kv])
            for attempt in range(ATTEMPTS):
                v_old, v_new = base + 2 * attempt, base + 2 * attempt + 1
                if client is not None:
                    sync.fleet.inflight = False
                sync.push(old, v_old)  # the replica serves the old weights, paused the usual way (mode wait)
                if client is not None:
                    sync.fleet.inflight, sync.fleet.inflight_kv = True, kv
                    out[kv] = _inflight_push(sync, client, kv, v_old, lambda v=v_new, s=sync: s.push(new, v), points)
                    out[kv]["versions"], out[kv]["attempts"] = (v_old, v_new), attempt + 1
                else:
                    sync.push(new, v_new)
                again = [client is not None and not out[kv]["held_part_way"]]
                torch.distributed.broadcast_object_list(again, src=0)
                if not again[0]:
                    break
            sync.close()
        return out
    finally:
        destroy_trainer_groups()


def _inflight_push(sync, client, kv: str, v_old: int, push, points: str) -> dict:
    """Trainer rank 0: the in-flight push `push()` runs and is held just before it pauses the replica (failpoint
    `push.pause.replica0`) while long responses start; once every request holds a few tokens it goes on and pauses
    the replica, and the test reads the engine's tokens itself when the replica is paused (`push.paused.replica0`).
    Holding the push there only sets the moment up: the trainer's way from starting a push to its /pause can take
    seconds on a loaded machine. The responses are long for the same reason (`MAX_TOKENS`): at the tiny model's 128
    positions a response lasted under a second, and CI's loaded machine once paused too late in every attempt (the
    responses had finished). What the test checks starts at the pause, which is not held."""
    from megarl.sync import failpoints

    rids = [f"inflight-{kv}-{i}" for i in range(len(PROMPTS))]
    box: dict = {}
    assert all(not r for r in client.collective_rpc("megarl_routing_probe_start")), "routing probe failed to start"
    gen = threading.Thread(target=lambda: box.update(samples=client.generate(
        PROMPTS, n=N, max_tokens=MAX_TOKENS, ignore_eos=True, seed=5, cache_salt=version_salt(v_old),
        request_ids=rids)))
    seen: dict = {}
    headers = bearer_header(read_secret(os.environ[SECRET_ENV])) if os.environ.get(SECRET_ENV) else {}
    pause, paused = Path(points) / "push.pause.replica0", Path(points) / "push.paused.replica0"
    pause.write_text("")
    paused.write_text("")

    def reached(point: Path) -> None:
        deadline = time.monotonic() + 120
        while not point.with_name(point.name + ".reached").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the push never reached {point.name}")
            time.sleep(0.01)

    def release(point: Path) -> None:
        point.unlink(missing_ok=True)
        point.with_name(point.name + ".reached").unlink(missing_ok=True)

    def generated() -> float:
        """The tokens the server has generated so far, from vLLM's own counter (its API server updates it as the
        engine's outputs come in; an RPC into the engine to count them can take seconds on a loaded machine)."""
        return read_metrics(client.url, headers, [GENERATED])[GENERATED]

    def drive() -> None:
        try:
            reached(pause)  # the push is about to pause the replica
            start = generated()
            gen.start()
            while gen.is_alive() and generated() - start < len(PROMPTS) * N * (HELD_AT_LEAST + 2):
                time.sleep(0.005)  # until the requests hold a few tokens each (they decode in the same steps)
            release(pause)  # it pauses the replica now
            reached(paused)
            seen.update(client.collective_rpc("megarl_held_tokens")[0])
            seen["_paused"] = client.is_paused()
        except BaseException as err:  # noqa: BLE001 - raised below, in the push's thread
            box["driver"] = err
        finally:
            release(pause)
            release(paused)

    driver = threading.Thread(target=drive)
    driver.start()
    os.environ[failpoints.ENV] = points
    try:
        stats = push()
    finally:
        del os.environ[failpoints.ENV]
        driver.join()
        if gen.ident is not None:
            gen.join()
    if "driver" in box:
        raise box["driver"]
    if "samples" not in box:
        raise RuntimeError("the generate call of the in-flight push failed (its traceback is printed above)")
    routing = client.collective_rpc("megarl_routing_probe_take")
    assert all("rows" in r for r in routing), routing
    held = dict(sync.fleet.held[0])
    # the push is released once the requests hold HELD_AT_LEAST + 2 tokens on average: one scheduled late may hold
    # fewer, and an attempt where one does is inconclusive as one paused too late (repeated)
    part_way = all(HELD_AT_LEAST <= held.get((rid, j), 0) < MAX_TOKENS for rid in rids for j in range(N))
    return {"samples": box["samples"], "seen": seen, "held": held, "held_part_way": part_way,
            "after_pause_s": {k: stats.phases[f"{k}_s"] for k in ("send", "close")}, "rids": rids,
            "delta_workers": sorted(stats.delta), "routing": [r["rows"] for r in routing]}


def _reference(hf_dir, sequences: list[tuple[list[int], list[int]]]) -> tuple[list[torch.Tensor], list[tuple]]:
    """transformers' fp32 forward of prompt + response per sequence: the log-prob of each response token given the
    tokens before it, and the routing of every forwarded token (all but the last): per row and MoE layer the top-k
    experts (sorted) and the router-logit margin between the k-th and the (k+1)-th expert (a near-tie when tiny)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    k = model.config.num_experts_per_tok
    gate_logits: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: gate_logits.append(out[0].float()))
    logprobs, routes = [], []
    with torch.no_grad():
        for prompt, response in sequences:
            gate_logits.clear()
            ids = torch.tensor([prompt + response])
            logsm = torch.log_softmax(model(ids).logits[0].float(), -1)
            logprobs.append(logsm[len(prompt) - 1:-1].gather(-1, torch.tensor(response)[:, None]).squeeze(-1))
            top = torch.stack(gate_logits, 1)[:-1].topk(k + 1, dim=-1)  # [rows, layers, k + 1]
            routes.append((top.indices[..., :k].sort(-1).values, top.values[..., k - 1] - top.values[..., k]))
    return logprobs, routes


def _route_mismatches(engine: list[list[list[int]]], reference: tuple, rows: range) -> tuple[int, int, int]:
    """(mismatched, near-tied, compared) (row, layer) pairs of the engine's routing over `rows` against a
    reference's; a pair whose reference margin is below ROUTE_TIE is a near-tie, not compared."""
    experts, margin = reference
    bad = ties = 0
    for row in rows:
        for layer, chosen in enumerate(engine[row]):
            if float(margin[row, layer]) < ROUTE_TIE:
                ties += 1
            elif sorted(chosen) != experts[row, layer].tolist():
                bad += 1
    return bad, ties, len(rows) * len(engine[0]) - ties


def test_push_lands_while_responses_generate(moe_fleet, tiny_moe_dir, tiny_moe_long_dir, new_checkpoint, tmp_path):
    """One set of trainer ranks: per KV setting, a push of the old weights, then long responses and an in-flight
    push of the new weights while they generate."""
    results = run_distributed(_trainer, 2, tiny_moe_dir, new_checkpoint, moe_fleet.urls[0], free_port(),
                              [free_port(), free_port()], str(tmp_path), init_dist=False)
    for kv in VERSIONS:
        r = results[0][kv]
        v_old, v_new = r["versions"]
        assert r["held_part_way"], (f"{kv}: in every attempt the push paused the replica too late (or a request had "
                                    f"fewer than {HELD_AT_LEAST} tokens); the last found {r['held']} (request: "
                                    f"output tokens held) of {MAX_TOKENS}")
        assert r["seen"].pop("_paused") is True
        # the in-flight push went as any other: a full streamed one (keep), a delta to both vLLM workers (recompute)
        assert r["delta_workers"] == ([2, 3] if RECEIVE[kv].get("delta") else []), r["delta_workers"]
        seen = {engine_request_key(k): v for k, v in r["seen"].items() if engine_request_key(k)}
        sequences, boundaries, keys = [], [], []
        for prompt, rid, samples in zip(PROMPTS, r["rids"], r["samples"], strict=True):
            for j, s in enumerate(samples):
                held = seen[(rid, j)]  # the engine's tokens at the pause
                assert HELD_AT_LEAST <= len(held) < MAX_TOKENS, (kv, rid, j, len(held))
                assert r["held"][(rid, j)] == len(held)  # the lifecycle's count is the engine's
                # not restarted, nothing lost: it continued from exactly what it held, to the length asked
                assert s.response_ids[:len(held)] == held
                assert len(s.response_ids) == MAX_TOKENS and s.finish_reason == "length"
                assert s.request_id == rid
                # versions: the engine's spans end the old version exactly at its count at the pause
                assert s.token_versions.runs == ((v_old, len(held)), (v_new, MAX_TOKENS - len(held))), kv
                assert s.policy_version == v_old
                sequences.append((prompt, s.response_ids))
                boundaries.append((len(held), torch.tensor(s.response_logprobs)))
                keys.append(((rid, j), s.token_versions, len(held)))
        old_ref, old_routes = _reference(tiny_moe_long_dir, sequences)  # the weights of tiny_moe_dir
        new_ref, new_routes = _reference(new_checkpoint, sequences)
        before = max(float((e[:b] - o[:b]).abs().max()) for (b, e), o in zip(boundaries, old_ref, strict=True))
        after = [(e[b:] - n[b:]).abs() for (b, e), n in zip(boundaries, new_ref, strict=True)]
        after_max, after_mean = max(float(a.max()) for a in after), float(torch.cat(after).mean())
        sent, closed = r["after_pause_s"]["send"], r["after_pause_s"]["close"]
        print(f"inflight_kv={kv} (attempt {r['attempts']}): held {sorted(len(v) for v in seen.values())} tokens at "
              f"the pause (then sent in {sent:.2f} s, closed in {closed:.2f} s); engine vs transformers |dlogprob|: "
              f"before the push (old weights) max {before:.2e}; after it (new weights) max {after_max:.2e} mean "
              f"{after_mean:.2e}")
        assert before < 1e-5, (kv, before)
        if kv == "recompute":
            assert after_max < 1e-5, after_max
        else:  # stale KV: visible, and reported in docs/pipeline.md
            assert after_max > 1e-3, after_max
        _check_routing(kv, r["routing"], sequences, keys, (v_old, v_new), old_routes, new_routes)


def _check_routing(kv: str, routing: list[dict], sequences: list, keys: list, versions: tuple[int, int],
                   old_routes: list, new_routes: list) -> None:
    """The engine's routing at every forward of the in-flight run (`megarl.rollout.routing_probe`, at the point
    where vLLM captures the routes it returns) against transformers' at the old and the new weights:
    - every forwarded position (prompt + response - 1 rows) was routed once, except, with recompute, the held
      prefix (rows before the first post-push row), routed twice: before the push, and in the re-prefill;
    - each position's first routing (the row vLLM 0.32 returns for it) is the routing of the version that
      `route_segments` assigns to the row from the response's `token_versions`: the old weights' before the push, the
      new weights' after it (recompute; with keep, the post-push rows see stale KV and their agreement with the new
      weights is measured);
    - with recompute, the re-prefill routes the prefix with the new weights, and differently from the rows
      returned for it: concatenating it to them (verl PRs 6029/6046) would duplicate rows of the wrong version.
    (row, layer) pairs whose reference router-logit margin is under ROUTE_TIE are near-ties, not compared."""
    v_old, v_new = versions
    assert routing[0] == routing[1], "the two TP workers routed differently"
    by_key = {engine_request_key(k): v for k, v in routing[0].items() if engine_request_key(k)}
    tally = {name: [0, 0, 0] for name in ("old rows", "new rows", "re-prefill")}
    flips = prefix = 0
    for (prompt, response), (key, token_versions, held), old, new in zip(sequences, keys, old_routes, new_routes,
                                                                   strict=True):
        by_pos: dict[int, list] = {}
        for pos, layers in by_key[key]:
            by_pos.setdefault(pos, []).append(layers)
        rows = len(prompt) + len(response) - 1
        cut = len(prompt) - 1 + held  # the first row routed after the push: the forward of the last held token
        assert sorted(by_pos) == list(range(rows)), (kv, key, sorted(by_pos))
        twice = kv == "recompute"
        assert [len(by_pos[p]) for p in range(rows)] == [2 if twice and p < cut else 1 for p in range(rows)], key
        assert route_segments(len(prompt), token_versions) == ((v_old, 0, cut), (v_new, cut, rows))
        first = [by_pos[p][0] for p in range(rows)]
        for name, ref, span in (("old rows", old, range(cut)), ("new rows", new, range(cut, rows))):
            tally[name] = [a + b for a, b in zip(tally[name], _route_mismatches(first, ref, span), strict=True)]
        if twice:
            again = [by_pos[p][-1] for p in range(cut)]
            tally["re-prefill"] = [a + b for a, b in zip(tally["re-prefill"], _route_mismatches(again, new, range(cut)),
                                                         strict=True)]
            flips += sum(sorted(a) != sorted(b) for x, y in zip(first[:cut], again, strict=True)
                         for a, b in zip(x, y, strict=True))
            prefix += cut * len(first[0])
    print(f"inflight_kv={kv}: engine routing vs transformers (mismatched / near-tied / compared (row, layer) pairs): "
          + "; ".join(f"{name} {b}/{t}/{c}" for name, (b, t, c) in tally.items() if c or t)
          + (f"; the re-prefill changed {flips} of the {prefix} prefix (row, layer) routes" if twice else ""))
    assert tally["old rows"][0] == 0 and tally["old rows"][2] > 0, tally
    if kv == "recompute":
        assert tally["new rows"][0] == 0 and tally["re-prefill"][0] == 0, tally
        assert flips > 0, "the new weights route no prefix token differently: the test cannot tell versions apart"

