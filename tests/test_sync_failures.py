"""A replica's server killed in the middle of a weight update (real processes: 2 trainer ranks, expert parallel 2;
two vLLM replicas, TP 1 each, on a fleet of their own since one of them dies).

Checked: every trainer rank raises `WeightSyncError` naming the dead replica, within a bounded time (no wait on
the 600 s group timeout); the surviving replica was sent all its bytes, is resumed and serves under a
consistent label (its workers loaded the whole update, so it serves the new version, and generation works).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from megarl.config.schema import OptimizerConfig
from megarl.models.qwen_provider import read_hf_config
from megarl.rollout.fleet import FleetSpec, launch
from tests.dist_utils import free_port, run_distributed

BOUND_S = 120  # a failed update must be reported well within the sync group's timeout (600 s here)


@pytest.fixture(scope="module")
def doomed_fleet(tiny_moe_dir, fleet_secret, tmp_path_factory):
    with launch(FleetSpec(model_dir=tiny_moe_dir, tp=1, replicas=2, log_dir=tmp_path_factory.mktemp("doomed_logs"),
                          secret_file=fleet_secret)) as fleet:
        yield fleet


def _push_killing_replica_1(rank, world, hf_dir, urls, doomed_pid, port, sync_port):
    from megarl.parallel.groups import TrainerLayout, destroy_trainer_groups, init_trainer_groups
    from megarl.rollout.client import RolloutClient
    from megarl.sync.weight_sync import PartitionedWeightSync, WeightSyncError
    from megarl.trainer.policy import MegatronPolicy

    init_trainer_groups(TrainerLayout(1, 1, 2), rank, world, "127.0.0.1", port)
    try:
        hf = read_hf_config(hf_dir)
        policy = MegatronPolicy(hf_dir, hf, OptimizerConfig())
        clients = [RolloutClient(u, timeout_s=120) for u in urls] if rank == 0 else []
        sync = PartitionedWeightSync(rank, world, hf, clients, rollout_tp=1, rollout_replicas=2,
                                     store_host="127.0.0.1", store_port=sync_port, bucket_bytes=64 << 10,
                                     timeout_s=600)
        if rank == 0:  # kill replica 1's whole server (API server, engine, worker) once its update has started
            start = sync.fleet.start_updates

            def start_then_kill(infos):
                threads = start(infos)
                os.killpg(doomed_pid, signal.SIGKILL)
                return threads

            sync.fleet.start_updates = start_then_kill
        t0 = time.monotonic()
        out = {}
        try:
            sync.push(policy.iter_local_hf_slices(), version=7)
        except WeightSyncError as err:
            out["error"] = str(err)
        out["seconds"] = time.monotonic() - t0
        if rank == 0:
            survivor = clients[0]
            out["paused"] = survivor.is_paused()
            out["label"] = survivor.weight_version()
            out["samples"] = survivor.generate([[6, 23, 7, 24]], n=2, max_tokens=2, seed=0)[0]
        return out
    finally:
        destroy_trainer_groups()


def test_replica_killed_during_the_update(doomed_fleet, tiny_moe_dir):
    doomed = doomed_fleet.procs[1].pid  # each server leads its own process group
    results = run_distributed(_push_killing_replica_1, 2, tiny_moe_dir, doomed_fleet.urls, doomed, free_port(),
                              free_port(), init_dist=False)
    for r in results:
        assert "replica 1" in r["error"] and doomed_fleet.urls[1] in r["error"], r["error"]
        assert "replica 0" not in r["error"].replace("(replica 1)", ""), r["error"]
        assert r["seconds"] < BOUND_S, r["seconds"]
    survivor = results[0]
    assert survivor["paused"] is False
    assert survivor["label"] == "7"
    assert [s.policy_version for s in survivor["samples"]] == [7, 7]
    assert doomed_fleet.procs[1].poll() is not None  # the killed server is gone
