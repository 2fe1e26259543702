"""The partitioned sync across trainer and fleet layouts, real processes end to end: megatron-core trainer ranks
in several layouts push a perturbed checkpoint into real vLLM servers of several layouts.

Per push, against references independent of the planner:
- bits: every block each vLLM worker received, and every block vLLM's own loaders read from it, equals the
  same block of the pushed checkpoint file (sha256);
- bytes: each worker received exactly what its loaders read (ratio 1.00: nothing redundant), and the fleet
  received what the trainer ranks sent;
- spread: no trainer rank sends more than an even share of the bytes plus the largest tensor it holds.

Layouts (the CPU stack: a MoE trainer with tp > 1 needs Transformer Engine, so the MoE rows use pp and ep):
tiny MoE: trainer PP2, EP2xPP2 into vLLM TP2 and into two TP1 replicas (EP2 -> TP2 is tests/test_weight_sync.py);
tiny dense Qwen3: trainer TP2, PP2, TP2xPP2 into vLLM TP2.
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from megarl.config.schema import OptimizerConfig
from megarl.models.qwen_provider import read_hf_config
from megarl.models.tiny import make_tiny_checkpoint
from megarl.rollout.fleet import FleetSpec, launch
from tests.dist_utils import free_port, run_distributed
from tests.fleet_fixture import perturbed_checkpoint
from tests.test_weight_sync import _sha256


@pytest.fixture(scope="module")
def moe_new(tiny_moe_dir, tmp_path_factory):
    return perturbed_checkpoint(tiny_moe_dir, tmp_path_factory.mktemp("moe_new"), seed=11)


@pytest.fixture(scope="module")
def dense_dirs(tmp_path_factory):
    base = make_tiny_checkpoint(tmp_path_factory.mktemp("dense") / "base", kind="dense")
    return base, perturbed_checkpoint(base, tmp_path_factory.mktemp("dense_new"), seed=11)


@pytest.fixture(scope="module")
def dense_fleet(dense_dirs, fleet_secret, tmp_path_factory):
    """A vLLM TP-2 server of the tiny dense Qwen3, guarded by the session's fleet secret."""
    with launch(FleetSpec(model_dir=dense_dirs[0], tp=2, log_dir=tmp_path_factory.mktemp("dense_fleet_logs"),
                          secret_file=fleet_secret)) as fleet:
        yield fleet


def _push(rank, world, hf_dir, layout, targets, port):
    """Every trainer rank, one layout: push `hf_dir` into each fleet of `targets` ((urls, rollout TP, sync port)
    per fleet) in turn, one sync group each; per fleet the stats and the largest tensor this rank holds."""
    from megarl.parallel.groups import TrainerLayout, destroy_trainer_groups, init_trainer_groups
    from megarl.rollout.client import RolloutClient
    from megarl.sync.weight_sync import PartitionedWeightSync
    from megarl.trainer.policy import MegatronPolicy

    init_trainer_groups(TrainerLayout(*layout), rank, world, "127.0.0.1", port)
    try:
        hf = read_hf_config(hf_dir)
        policy = MegatronPolicy(hf_dir, hf, OptimizerConfig())
        local = list(policy.iter_local_hf_slices())
        out = []
        for urls, rollout_tp, sync_port in targets:
            clients = [RolloutClient(u) for u in urls] if rank == 0 else []
            sync = PartitionedWeightSync(rank, world, hf, clients, rollout_tp=rollout_tp, rollout_replicas=len(urls),
                                         store_host="127.0.0.1", store_port=sync_port, bucket_bytes=128 << 10,
                                         digests=True, timeout_s=120)
            stats = sync.push(local, version=rank + 100)  # version of rank 0 labels the fleet
            sync.close()
            out.append({"stats": stats, "largest_held": max(t.numel() * t.element_size() for _, t in local)})
        return out
    finally:
        destroy_trainer_groups()


def _check(results, checkpoint, workers: int) -> None:
    stats = results[0]["stats"]
    new = load_file(checkpoint / "model.safetensors")
    reports = {r["rank"]: r for r in stats.reports}
    assert len(reports) == workers
    for rank, report in reports.items():
        assert report["bytes_received"] == report["bytes_read_by_loaders"] == stats.bytes_needed[rank] > 0
        for name, box in report["blocks"].items():
            assert report["sha256"][name] == _sha256(new[name][tuple(slice(a, b) for a, b in box)]), (rank, name)
        for name, box, digest in report["loader_reads"]:
            assert digest == _sha256(new[name][tuple(slice(a, b) for a, b in box)]), (rank, name, box)
    sent = stats.bytes_sent
    assert sum(sent.values()) == sum(stats.bytes_received.values())
    share = sum(sent.values()) / len(sent)
    for rank, nbytes in sent.items():
        assert nbytes <= share + results[rank]["largest_held"], (rank, nbytes, share)


@pytest.mark.parametrize(("layout", "world"), [((1, 2, 1), 2), ((1, 2, 2), 4)], ids=["pp2", "ep2xpp2"])
def test_moe_layouts(layout, world, moe_new, moe_fleet, moe_fleet_2x1):
    """One set of trainer ranks pushes into the TP-2 server, then into the two TP-1 replicas (one sync group
    each), each push checked on its own. Changes the MoE fleets' weights (to `moe_new`); later tests that need
    particular weights push them."""
    targets = [(moe_fleet.urls, 2, free_port()), (moe_fleet_2x1.urls, 1, free_port())]
    results = run_distributed(_push, world, moe_new, layout, targets, free_port(), init_dist=False)
    for i in range(len(targets)):
        _check([r[i] for r in results], moe_new, workers=2)


@pytest.mark.parametrize(("layout", "world"), [((2, 1, 1), 2), ((1, 2, 1), 2), ((2, 2, 1), 4)],
                         ids=["tp2", "pp2", "tp2xpp2"])
def test_dense_layouts(layout, world, dense_dirs, dense_fleet):
    results = run_distributed(_push, world, dense_dirs[1], layout, [(dense_fleet.urls, 2, free_port())], free_port(),
                              init_dist=False)
    _check([r[0] for r in results], dense_dirs[1], workers=2)
