"""Failures in the middle of a weight update, on real processes (2 trainer ranks, expert parallel 2; vLLM servers):

- a trainer rank that raises while sending (the session's TP 2 server);
- the sync store's host, trainer rank 0, killed (the session's TP 2 server);
- a replica's whole server killed mid-update (the session's two TP-1 replicas, `moe_fleet_2x1`): the push goes on
  without it (rollout.min_replicas=1), a restarted server for its slot rejoins with a full push, and with
  min_replicas=2 the same loss fails the push;
- one vLLM worker of a TP 2 replica killed (the session's TP 2 server: vLLM then shuts the whole server down).

The last two kill replicas of session fleets, so they are marked `kills_session_fleet` and run after every other test
of the session (tests/fleet_fixture.py): no fleet is started here to be killed.

Every failing case checks that each surviving trainer rank raises `WeightSyncError` naming what failed and why within a
bounded time (`BOUND_S`, against the group's 600 s timeout), and what the replicas serve afterwards, seen from
outside: paused or not, label, log-probs, sample versions, a next push through a new sync group.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from safetensors.torch import load_file

from megarl.config.schema import OptimizerConfig
from megarl.models.qwen_provider import read_hf_config
from megarl.rollout.client import RolloutClient
from megarl.rollout.fleet import FleetSpec, launch
from tests.dist_utils import free_port, run_distributed
from tests.fleet_fixture import perturbed_checkpoint
from tests.slow_proxy import slow_proxy

BOUND_S = 120  # a failed update must be reported well within the sync group's timeout (600 s here)


def _kill_replica_mid_update(sync, pid):
    """Rank 0: SIGKILL the server of process group `pid` (API server, engine, worker) once the push's
    `/update_weights` calls are under way (once: the next push is left alone)."""
    start = sync.fleet.start_updates

    def start_then_kill(infos, **kwargs):
        threads = start(infos, **kwargs)
        os.killpg(pid, signal.SIGKILL)
        sync.fleet.start_updates = start
        return threads

    sync.fleet.start_updates = start_then_kill


def _served_by(client):
    return {"paused": client.is_paused(), "label": client.weight_version(),
            "logprobs": client.prompt_logprobs([6, 23, 7, 24, 13, 2]),
            "versions": [s.policy_version for s in client.generate([[6, 23, 7, 24]], n=2, max_tokens=2, seed=0)[0]]}


def _lose_rejoin_then_fail(rank, world, hf_dir, pushed_dir, urls, doomed_pid, port, sync_port, logs, secret_file):
    """Every trainer rank, over one sync of a 2-replica TP-1 fleet (rollout.min_replicas=1 at first):
    v1 to both; v2 with replica 1 killed mid-update (the push goes on without it); v3 to replica 0 only;
    replica 1 restarted (its new server is started by rank 0 in a thread as the rank begins, so that its start-up
    overlaps the trainer's and the first three pushes: it is only offered to the sync after v3); first offered
    through a proxy that accepts the join request and never passes it on (its workers never arrive): with
    sync.rejoin_timeout_s=2 the trainer ranks give up on it after 2 s and it stays out; then let back in for real;
    v4 to both; then min_replicas=2 and replica 1 killed mid-update again: v5 fails naming it."""
    from concurrent.futures import ThreadPoolExecutor

    from megarl.parallel.groups import TrainerLayout, destroy_trainer_groups, init_trainer_groups
    from megarl.rollout.client import RolloutClient
    from megarl.sync.weight_sync import PartitionedWeightSync, WeightSyncError
    from megarl.trainer.policy import MegatronPolicy

    starting = None
    if rank == 0:  # the launcher's restart of slot 1 (a new server, at a new URL), begun now, waited for after v3
        starting = ThreadPoolExecutor(1).submit(launch, FleetSpec(model_dir=hf_dir, tp=1, replicas=1, first_replica=1,
                                                                   log_dir=logs, secret_file=secret_file))
    init_trainer_groups(TrainerLayout(1, 1, 2), rank, world, "127.0.0.1", port)
    restarted = None
    try:
        hf = read_hf_config(hf_dir)
        policy = MegatronPolicy(pushed_dir, hf, OptimizerConfig())  # weights the fleet does not serve
        clients = [RolloutClient(u, timeout_s=120) for u in urls] if rank == 0 else []
        sync = PartitionedWeightSync(rank, world, hf, clients, rollout_tp=1, rollout_replicas=2,
                                     store_host="127.0.0.1", store_port=sync_port, bucket_bytes=64 << 10,
                                     timeout_s=600, min_replicas=1)
        out = {}

        def push(version):
            t0 = time.monotonic()
            try:
                stats = sync.push(policy.iter_local_hf_slices(), version=version)
                result = {"replicas": stats.replicas, "lost": stats.lost, "received": stats.bytes_received,
                          "needed": stats.bytes_needed}
            except WeightSyncError as err:
                result = {"error": str(err)}
            return result | {"seconds": time.monotonic() - t0, "live": list(sync.live)}

        out["v1"] = push(1)
        if rank == 0:
            _kill_replica_mid_update(sync, doomed_pid)
        out["v2"] = push(2)
        out["v3"] = push(3)
        back = {}
        if rank == 0:  # the launcher's restart: a new server for slot 1, at a new URL
            restarted = starting.result()
            back = {1: RolloutClient(restarted.urls[0], timeout_s=120)}
            out["restarted_before"] = _served_by(back[1])
        sync.rejoin_timeout_s = 2.0
        with slow_proxy(restarted.urls[0] if rank == 0 else "", swallow=("/init_weight_transfer_engine",)) as silent:
            dist.barrier()  # rank 0 was starting the new server: time the admit alone
            t0 = time.monotonic()
            out["admitted_silent"] = sync.admit({1: RolloutClient(silent, timeout_s=120)} if rank == 0 else {})
            out["silent_seconds"], out["live_after_silent"] = time.monotonic() - t0, list(sync.live)
        sync.rejoin_timeout_s = 120.0
        out["admitted"] = sync.admit(back)
        out["v4"] = push(4)
        if rank == 0:
            out["served_v4"] = [_served_by(c) for c in (clients[0], back[1])]
            _kill_replica_mid_update(sync, restarted.procs[0].pid)
        sync.min_replicas = 2  # rollout.min_replicas=2: losing a replica now ends the run
        out["v5"] = push(5)
        if rank == 0:
            out["served_v5"] = _served_by(clients[0])
        return out
    finally:
        if starting is not None and starting.exception() is None:  # waits for a start still under way
            starting.result().stop()
        destroy_trainer_groups()


@pytest.mark.kills_session_fleet("moe_fleet_2x1")
def test_a_replica_killed_mid_update_leaves_the_sync_and_a_restarted_one_rejoins(moe_fleet_2x1, tiny_moe_dir,
                                                                               pushed_checkpoint, fleet_secret,
                                                                               tmp_path):
    """Kills replica 1 of the session's `moe_fleet_2x1` (it runs after every other user of that fleet)."""
    doomed_fleet = moe_fleet_2x1
    doomed = doomed_fleet.procs[1].pid  # each server leads its own process group
    results = run_distributed(_lose_rejoin_then_fail, 2, tiny_moe_dir, pushed_checkpoint, doomed_fleet.urls, doomed,
                              free_port(), free_port(), tmp_path, fleet_secret, init_dist=False)
    model_bytes = sum(t.numel() * t.element_size() for t in load_file(tiny_moe_dir / "model.safetensors").values())
    for r in results:  # every trainer rank saw the same fleet
        assert [r[v]["live"] for v in ("v1", "v2", "v3", "v4", "v5")] == [[0, 1], [0], [0], [0, 1], [0]], r
        for v in ("v1", "v2", "v3", "v4"):
            assert "error" not in r[v] and r[v]["seconds"] < BOUND_S, (v, r[v])
        # the silent rejoin: given up after sync.rejoin_timeout_s (2 s), not the group timeout (600 s); it stays out
        assert r["admitted_silent"] == [] and r["live_after_silent"] == [0], r
        assert r["silent_seconds"] < 30, r["silent_seconds"]
        assert r["admitted"] == [1]
        # v5: below rollout.min_replicas=2, every rank raises naming the dead replica and the bound
        error = r["v5"]["error"]
        assert "replica 1" in error and "rollout.min_replicas=2" in error and r["v5"]["seconds"] < BOUND_S, error
        assert "replica 0" not in error.replace("(replica 1)", ""), error
    r = results[0]
    # v2 reached replica 0 and named replica 1 by its URL as lost; v3 went to replica 0 alone (TP 1: one worker
    # per replica, fleet-wide ranks 2 and 3): every byte of the model, nothing for the dead replica
    assert r["v2"]["replicas"] == [0] and doomed_fleet.urls[1] in r["v2"]["lost"][1], r["v2"]
    assert r["v3"]["received"] == {2: model_bytes} and r["v3"]["needed"] == {2: model_bytes}, r["v3"]
    # v4: the restarted replica got the whole model (a full push) and serves what replica 0 serves, which is not
    # what it served when it started (the checkpoint on disk)
    assert r["v4"]["received"] == {2: model_bytes, 3: model_bytes}, r["v4"]
    before, (survivor, rejoined) = r["restarted_before"], r["served_v4"]
    assert before["label"] != "4"
    for served in (survivor, rejoined):
        assert served["paused"] is False and served["label"] == "4" and served["versions"] == [4, 4], served
    assert max(abs(a - b) for a, b in zip(rejoined["logprobs"], survivor["logprobs"], strict=True)) < 1e-5
    assert max(abs(a - b) for a, b in zip(rejoined["logprobs"], before["logprobs"], strict=True)) > 1e-3
    # the failed v5 left replica 0 serving v5 (it took the push), unpaused
    assert r["served_v5"]["paused"] is False and r["served_v5"]["label"] == "5", r["served_v5"]


# ---- the other failures: a trainer rank that raises, a vLLM worker killed, the sync store's host killed --------------
PROMPT = [6, 23, 7, 24, 13, 2]


@pytest.fixture(scope="module")
def pushed_checkpoint(tiny_moe_dir, tmp_path_factory):
    """Weights the fleet does not serve yet (the tiny MoE perturbed with a seed no other test uses)."""
    return perturbed_checkpoint(tiny_moe_dir, tmp_path_factory.mktemp("pushed"), seed=13)


@pytest.fixture(scope="module")
def other_checkpoint(tiny_moe_dir, tmp_path_factory):
    """Other weights again (another seed): a test after one that pushed `pushed_checkpoint` still sees a change."""
    return perturbed_checkpoint(tiny_moe_dir, tmp_path_factory.mktemp("other"), seed=17)


class _AtSecondBucket:
    """Wraps a rank's sync group: `action(first)` runs when the rank is about to send its second bucket, with the
    first bucket's send `first`; `after_first()` runs once the first send is posted."""

    def __init__(self, group, action, after_first=lambda: None):
        self.group, self.action, self.after_first, self.first, self.sent = group, action, after_first, None, 0

    def send(self, tensors, dst, tag):
        if self.sent == 1:
            self.action(self.first)
        self.sent += 1
        work = self.group.send(tensors, dst, tag)
        if self.sent == 1:
            work = self.first = _WaitOnce(work)
            self.after_first()
        return work


class _WaitOnce:
    """A send's Work that may be waited on twice (by the injection, then by the sender): gloo's wait on a send
    consumes one completion, so a second plain wait would block until the group's timeout."""

    def __init__(self, work):
        self.work, self.error, self.done = work, None, False

    def wait(self):
        if not self.done:
            self.done = True
            try:
                self.work.wait()
            except Exception as err:  # noqa: BLE001 - raised again on every wait, as a Work does
                self.error = err
        if self.error is not None:
            raise self.error
        return True


def _kill_once_received(pid):
    """An `_AtSecondBucket` action: wait until the first bucket was received (so the vLLM workers are inside the
    update, receiving), then SIGKILL `pid`."""

    def action(first):
        first.wait()
        os.kill(pid, signal.SIGKILL)

    return action


def _inject(sync, what) -> None:
    """Failure injection inside this trainer rank's process (tests only), all after the rank's first bucket:
    "raise": packing its second bucket raises (as a failing copy or allocation would); "die": once its first bucket
    was received, the rank is SIGKILLed; ("kill", pid): then, process `pid` (a vLLM worker) is SIGKILLed. A "raise"
    is undone by `_uninject`."""
    from megarl.sync import stream

    if what == "raise":  # the flag, not the wrapper, is shared: nothing but the transport may hold the group
        first_sent: list[bool] = []
        real = stream.to_bytes

        def to_bytes(t):
            if first_sent:
                raise RuntimeError("injected failure while packing the second bucket")
            return real(t)

        stream.to_bytes = to_bytes
        _UNINJECT.append(lambda: setattr(stream, "to_bytes", real))
        sync.transport.group = _AtSecondBucket(sync.transport.group, lambda first: None,
                                               lambda: first_sent.append(True))
    else:
        pid = os.getpid() if what == "die" else what[1]
        sync.transport.group = _AtSecondBucket(sync.transport.group, _kill_once_received(pid))


_UNINJECT: list = []  # in a trainer rank's process: what undoes its "raise" injection


def _push(rank, world, hf_dir, urls, tp, port, sync_port, version, inject=None, again=False, fresh=None):
    """Every trainer rank: join, plan, push `hf_dir`'s weights as `version` (rank `inject[0]` injects `inject[1]`);
    returns the stats or the WeightSyncError's message, and the push's seconds; `again`: after a failed push, push
    once more with the same objects (its error and seconds: "again_error", "again_seconds"); `fresh`: (store port,
    version): then, the injection undone, rank 0 reads what the replica serves ("served_after") and every rank
    pushes once more as that version through a new PartitionedWeightSync (a new sync group, as a later push after a
    failure needs; its stats: "fresh")."""
    from megarl.parallel.groups import TrainerLayout, destroy_trainer_groups, init_trainer_groups
    from megarl.rollout.client import RolloutClient
    from megarl.sync.weight_sync import PartitionedWeightSync, WeightSyncError
    from megarl.trainer.policy import MegatronPolicy

    init_trainer_groups(TrainerLayout(1, 1, 2), rank, world, "127.0.0.1", port)
    try:
        hf = read_hf_config(hf_dir)
        policy = MegatronPolicy(hf_dir, hf, OptimizerConfig())
        clients = [RolloutClient(u, timeout_s=120) for u in urls] if rank == 0 else []
        sync = PartitionedWeightSync(rank, world, hf, clients, rollout_tp=tp, rollout_replicas=len(urls),
                                     store_host="127.0.0.1", store_port=sync_port, bucket_bytes=64 << 10,
                                     timeout_s=600)
        if inject is not None and inject[0] == rank:
            _inject(sync, inject[1])
        out = {}
        t0 = time.monotonic()
        try:
            out["stats"] = sync.push(policy.iter_local_hf_slices(), version=version)
        except WeightSyncError as err:
            out["error"] = str(err)
        out["seconds"] = time.monotonic() - t0
        if again and "error" in out:
            t0 = time.monotonic()
            try:
                sync.push(policy.iter_local_hf_slices(), version=version)
            except WeightSyncError as err:
                out["again_error"] = str(err)
            out["again_seconds"] = time.monotonic() - t0
        if fresh is not None:
            while _UNINJECT:
                _UNINJECT.pop()()
            sync.close()
            if rank == 0:
                out["served_after"] = _served(clients[0])
            dist.barrier()  # the replica read before any rank begins the next push
            sync = PartitionedWeightSync(rank, world, hf, clients, rollout_tp=tp, rollout_replicas=len(urls),
                                         store_host="127.0.0.1", store_port=fresh[0], bucket_bytes=64 << 10,
                                         timeout_s=600)
            out["fresh"] = sync.push(policy.iter_local_hf_slices(), version=fresh[1])
        return out
    finally:
        destroy_trainer_groups()


def _push_to_file(out_path, env, rank, world, *args):
    """`_push` in a process of its own, its result saved to `out_path` (the test's own launcher: run_distributed
    would stop the other ranks as soon as one dies), in the test's environment `env` (a forkserver's child would
    otherwise have the server's)."""
    import torch

    os.environ.clear()
    os.environ.update(env)
    torch.save(_push(rank, world, *args), out_path)


def _served(client):
    """What a replica serves, seen from outside: paused?, label, and (if not paused) log-probs and sample versions."""
    out = {"paused": client.is_paused(), "label": client.weight_version()}
    if not out["paused"]:
        out["logprobs"] = client.prompt_logprobs(PROMPT)
        out["versions"] = [s.policy_version for s in client.generate([PROMPT[:4]], n=2, max_tokens=2, seed=0)[0]]
    return out


def _assert_serves_new(client, before, version):
    served = _served(client)
    assert served["paused"] is False and served["label"] == str(version)
    assert served["versions"] == [version, version]
    assert max(abs(a - b) for a, b in zip(served["logprobs"], before["logprobs"], strict=True)) > 1e-3


def test_trainer_rank_raising_mid_send(moe_fleet, pushed_checkpoint):
    """Trainer rank 1 raises while packing its second bucket (its first is on the wire). It closes its sync-group
    connections, so the vLLM workers waiting for its buckets fail at once, still take trainer rank 0's buckets, and
    refuse the update before touching the model. Checked from outside: both trainer ranks raise naming trainer
    rank 1 and why, well within the group's timeout, and a later push on the same objects is refused on both at once;
    the replica is not paused and serves exactly what it served before (label, log-probs); a push through a new
    PartitionedWeightSync (a new sync group, in the same trainer processes, the injection undone) then succeeds and
    serves the new weights."""
    client = RolloutClient(moe_fleet.urls[0], timeout_s=120)
    before = _served(client)
    assert before["paused"] is False
    results = run_distributed(_push, 2, pushed_checkpoint, moe_fleet.urls, 2, free_port(), free_port(), 31,
                              (1, "raise"), True, (free_port(), 32), init_dist=False)
    for r in results:
        assert "trainer rank 1 failed while sending: RuntimeError: injected failure while packing" in r["error"]
        assert "rejected, model left unchanged on every TP rank" in r["error"], r["error"]
        assert r["seconds"] < BOUND_S, r["seconds"]
        # the group lost rank 1's connections: a later push on the same objects is refused on every rank at once
        assert "unusable since an earlier push failed (trainer rank 1 failed while sending" in r["again_error"]
        assert r["again_seconds"] < 5, r["again_seconds"]
    print(f"trainer rank raised mid-send: reported in {[round(r['seconds'], 1) for r in results]} s")
    # read by trainer rank 0 after the failed pushes, before the next one: unchanged (same label, same log-probs),
    # generation works
    assert results[0]["served_after"] == before
    assert results[0]["fresh"].receive_ratio == {2: 1.0, 3: 1.0}
    _assert_serves_new(client, before, 32)


def _worker_pid(fleet, tp_rank):
    """The pid of vLLM worker `tp_rank` of the fleet's first server (its process title: VLLM::Worker_TP<r>)."""
    group = fleet.procs[0].pid  # the server leads its own process group
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pgid = int(stat.read_text().rsplit(")", 1)[1].split()[2])
            title = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError):
            continue
        if pgid == group and f"Worker_TP{tp_rank}" in title:
            return int(stat.parent.name)
    raise AssertionError(f"no Worker_TP{tp_rank} process in the server's process group {group}")


@pytest.mark.kills_session_fleet("moe_fleet")
def test_vllm_worker_killed_mid_receive(moe_fleet, pushed_checkpoint):
    """One vLLM worker (TP rank 1) of a TP 2 replica is SIGKILLed while the trainer ranks send (trainer rank 0 kills
    it once its first bucket was received); the API server and the other worker are left alone. Checked:
    both trainer ranks raise naming the replica, its URL and that a worker died, within the bound; the replica is not
    labelled with the pushed version, and it no longer serves (vLLM shuts the whole engine down when a worker
    dies: the server exits, so it never serves under the pushed label). Kills the session's `moe_fleet` (it runs after
    every other user of that fleet)."""
    fleet = moe_fleet
    client = RolloutClient(fleet.urls[0], timeout_s=60)
    label = client.weight_version()
    victim = _worker_pid(fleet, 1)
    results = run_distributed(_push, 2, pushed_checkpoint, fleet.urls, 2, free_port(), free_port(), 41,
                              (0, ("kill", victim)), init_dist=False)
    for r in results:
        assert f"replica 0 ({fleet.urls[0]})" in r["error"], r["error"]
        assert "a worker died" in r["error"] and "serves nothing until it is restarted" in r["error"], r["error"]
        assert "keeps serving its previous weights" not in r["error"], r["error"]
        assert r["seconds"] < BOUND_S, r["seconds"]
    print(f"vLLM worker killed: reported in {[round(r['seconds'], 1) for r in results]} s: {results[0]['error']}")
    deadline = time.monotonic() + 60
    while fleet.procs[0].poll() is None and time.monotonic() < deadline:
        time.sleep(1)
    print(f"server gone {time.monotonic() - deadline + 60:.1f} s after the push returned; label before: {label}")
    assert fleet.procs[0].poll() is not None  # vLLM shut the engine and its server down: nothing serves


def test_store_host_killed_mid_send(moe_fleet, other_checkpoint, tmp_path):
    """The sync group's TCPStore lives inside trainer rank 0 (it hosts the store at store_port, and the trainer's
    own rendezvous store), so the store disappearing is its host dying: trainer rank 0 is SIGKILLed once its first
    bucket was received (the workers are inside the update), after it paused the replica and started its update. The
    ranks run in processes of the test's own (run_distributed would stop rank 1 as soon as rank 0 dies). Checked:
    trainer rank 1 raises within the bound, saying the store no longer answers and rank 0 is gone; the vLLM workers
    refuse the update (their reports name trainer rank 0), the replica keeps its label and, with nobody left to
    resume it, stays paused; a push from fresh trainer processes then closes the update session rank 0 left open,
    loads, resumes the replica and serves the new version."""
    client = RolloutClient(moe_fleet.urls[0], timeout_s=120)
    before = _served(client)
    try:
        _kill_the_store_host_mid_send(client, before, moe_fleet, other_checkpoint, tmp_path)
    finally:  # the fleet is shared by the session: never leave it paused, or inside an update, for the next tests
        client.collective_rpc("megarl_end_stale_update")
        if client.is_paused():
            client.resume()


def _kill_the_store_host_mid_send(client, before, moe_fleet, other_checkpoint, tmp_path):
    import multiprocessing

    import torch

    from megarl.parallel.spawn import PRELOAD, start_method

    # started as run_distributed starts ranks: forked from the forkserver that has torch and megatron-core imported
    # (seconds per fresh interpreter otherwise)
    ctx = multiprocessing.get_context(start_method())
    if start_method() == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))
    args = (other_checkpoint, moe_fleet.urls, 2, free_port(), free_port(), 51, (0, "die"))
    procs = [ctx.Process(target=_push_to_file, args=(tmp_path / f"rank{r}.pt", dict(os.environ), r, 2, *args))
             for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(BOUND_S + 180)  # start-up (megatron model, plan) is not bounded by the push's BOUND_S
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    assert [proc.exitcode for proc in procs] == [-signal.SIGKILL, 0]
    survivor = torch.load(tmp_path / "rank1.pt", weights_only=False)
    print(f"store host killed: trainer rank 1 reported in {survivor['seconds']:.1f} s: {survivor['error']}")
    assert survivor["seconds"] < BOUND_S
    assert "no longer answers: trainer rank 0" in survivor["error"], survivor["error"]
    reports = client.collective_rpc("megarl_sync_report")
    assert all("trainer rank 0 failed to send" in r["error"] and r["model_state"] == "unchanged"
               for r in reports), reports
    assert client.is_paused() is True and client.weight_version() == before["label"]
    again = run_distributed(_push, 2, other_checkpoint, moe_fleet.urls, 2, free_port(), free_port(), 52,
                            init_dist=False)
    assert again[0]["stats"].receive_ratio == {2: 1.0, 3: 1.0}
    _assert_serves_new(client, before, 52)
