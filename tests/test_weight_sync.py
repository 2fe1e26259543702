"""The partitioned weight sync, end to end on the real stack: a megatron-core trainer (2 gloo ranks,
expert parallel 2) pushes new weights into a real vLLM server (tensor parallel 2).

Checked against independent references:
- the plan's needs, recorded by the fleet from vLLM's own loaders, equal the hand-written table;
- what each vLLM rank received, and every block vLLM's own weight loaders read from it, equals bit
  for bit (sha256) the same block of the new checkpoint (what the trainer holds); its byte count
  equals the size of its slices computed by hand from the config below (ratio 1.00);
- the engine's log-probs after the sync equal `transformers`' for the new checkpoint, and the
  trainer's own (megatron, vocab-parallel) log-probs for the same tokens;
- responses generated after the sync carry the pushed version;
- an update missing a block that only ONE TP rank needs is rejected by every TP rank of the replica
  (none loads half of it), every trainer rank raises, and the old weights and version keep serving;
- an update whose loaders fail part-way (injected) leaves the replica paused, every trainer rank says it may
  hold mixed weights, and the next complete push restores and resumes it.

Tolerance for log-probs: vLLM's CPU kernels, transformers and megatron all run fp32 but with
different attention / matmul kernels and reduction orders; per-token differences are ~1e-6, so
1e-4 absolute leaves margin while catching any wrong or stale weight (which moves log-probs by >1e-2).
"""

import hashlib

import pytest
import torch
from safetensors.torch import load_file

from megarl.config.schema import OptimizerConfig
from megarl.models.qwen_provider import read_hf_config
from megarl.sync.heartbeat import DONE
from megarl.sync.plan import vllm_rank_slices
from tests.dist_utils import free_port, run_distributed
from tests.fleet_fixture import perturbed_checkpoint, sparsely_changed

SEQS = [[6, 23, 7, 24, 13, 2], [5, 23, 5, 24, 11], [12, 23, 3, 24, 17, 2, 9]]
BUCKET = 256 << 10  # sync bucket size of these pushes


def _hand_bytes_per_rank(hf: dict, tp: int) -> list[int]:
    """Elements each vLLM TP rank holds, written out from the architecture (not from the planner)."""
    h, d, heads, kv, e, inter = (hf["hidden_size"], hf["head_dim"], hf["num_attention_heads"],
                                 hf["num_key_value_heads"], hf["num_local_experts"], hf["moe_intermediate_size"])
    layer = (2 * h  # input / post-attention norms
             + heads * d // tp * h + 2 * (kv * d // tp * h) + h * heads * d // tp  # q, k, v, o
             + 2 * d + e * h  # q/k norms, router
             + e * 3 * (inter // tp * h))  # experts: gate, up, down
    padded = 64  # vLLM pads the 32-token vocabulary to 64 rows, 32 per rank: rank 0 real rows, rank 1 padding
    vocab_rows = [max(0, min(hf["vocab_size"], (r + 1) * padded // tp) - r * padded // tp) for r in range(tp)]
    return [4 * (hf["num_hidden_layers"] * layer + h + 2 * rows * h) for rows in vocab_rows]


@pytest.fixture(scope="module")
def new_checkpoint(tiny_moe_dir, tmp_path_factory):
    """The tiny MoE with every tensor perturbed: the weights the trainer will push."""
    return perturbed_checkpoint(tiny_moe_dir, tmp_path_factory.mktemp("perturbed"), seed=7)


def _trainer(rank, world, hf_dir, url, port, sync_port, drop):
    from megarl.parallel.groups import TrainerLayout, destroy_trainer_groups, init_trainer_groups
    from megarl.rollout.client import RolloutClient
    from megarl.sync.heartbeat import beat_key
    from megarl.sync.weight_sync import PartitionedWeightSync, WeightSyncError
    from megarl.trainer.policy import MegatronPolicy

    init_trainer_groups(TrainerLayout(1, 1, 2), rank, world, "127.0.0.1", port)
    try:
        hf = read_hf_config(hf_dir)
        policy = MegatronPolicy(hf_dir, hf, OptimizerConfig())
        clients = [RolloutClient(url)] if rank == 0 else []
        sync = PartitionedWeightSync(rank, world, hf, clients, rollout_tp=2, rollout_replicas=1,
                                     store_host="127.0.0.1", store_port=sync_port, bucket_bytes=BUCKET,
                                     digests=True, timeout_s=90, silent_s=60)
        out = {}
        if drop == "fail_load":  # vLLM's loaders raise after 3 tensors, once the model is being reloaded
            sync.fail_loading_after = 3
        elif drop:  # an incomplete plan: vLLM TP rank 1 (sync rank 3) never gets its k_proj block of layer 1
            sync.entries = [e for e in sync._plan(list(policy.iter_local_hf_slices()))
                            if not (e.receiver == 3 and e.block.name.endswith("layers.1.self_attn.k_proj.weight"))]
        if drop:
            try:
                sync.push(policy.iter_local_hf_slices(), version=99)
            except WeightSyncError as err:
                out["error"] = str(err)
        else:
            out["stats"] = sync.push(policy.iter_local_hf_slices(), version=5)
            # each worker beat on its own key of this push in the trainer's store, and marked its part done
            out["beats"] = {w: int(sync.transport.store.add(beat_key(sync.pushes, w), 0)) for w in (2, 3)}
        out["needs"] = sync.needs
        if rank == 0:
            out["paused"] = clients[0].is_paused()
        if rank == 0 and not out["paused"]:
            out["engine"] = [clients[0].prompt_logprobs(s) for s in SEQS]
            out["samples"] = clients[0].generate([SEQS[0][:4]], n=3, max_tokens=2, seed=0)[0]
        length = max(map(len, SEQS))
        tokens = torch.tensor([s + [0] * (length - len(s)) for s in SEQS])
        out["trainer"] = policy.compute_logprobs(tokens, torch.roll(tokens, -1, 1))[0]
        return out
    finally:
        destroy_trainer_groups()


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _cut(tensors: dict[str, torch.Tensor], name: str, box: list[list[int]]) -> torch.Tensor:
    return tensors[name][tuple(slice(a, b) for a, b in box)]


def _transformers_logprobs(hf_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    out = []
    for s in SEQS:
        logsm = torch.log_softmax(model(torch.tensor([s])).logits[0].float(), -1)
        out.append(logsm[:-1].gather(-1, torch.tensor(s[1:])[:, None]).squeeze(-1))
    return out


def test_sync_moves_exactly_each_ranks_slices(moe_fleet, new_checkpoint):
    hf = read_hf_config(new_checkpoint)
    results = run_distributed(_trainer, 2, new_checkpoint, moe_fleet.urls[0], free_port(), free_port(), False,
                              init_dist=False)
    stats = results[0]["stats"]
    reports = {r["rank"]: r for r in stats.reports}
    print(f"sync: sent {stats.bytes_sent} received {stats.bytes_received} in {stats.seconds:.2f}s "
          f"({stats.gbps:.4f} GB/s); per worker receive/load seconds "
          f"{[(r['receive_seconds'], r['load_seconds']) for r in stats.reports]}")
    assert sorted(reports) == [2, 3]  # the two vLLM TP workers, after the 2 trainer ranks
    # megarl/sync/heartbeat.py: both workers beat during the push (once at least) and marked their part done
    assert all(DONE < n < 2 * DONE for n in results[0]["beats"].values()), results[0]["beats"]

    # the plan came from the fleet's recording of vLLM's own loaders, which equals the hand-written table here
    needs = results[0]["needs"]
    assert needs.source == "recorded" and results[1]["needs"] == needs
    for tp_rank in range(2):
        assert set(needs.reads[tp_rank]) == set(vllm_rank_slices(hf, 2, tp_rank))
    assert stats.phases["needs_s"] == needs.seconds > 0  # obtained once, in the constructor, reported by push 1
    # the slowest worker's receive and load seconds, from the workers' own reports (`sync/worker_*_s` metrics)
    for phase, key in (("worker_receive_s", "receive_seconds"), ("worker_load_s", "load_seconds")):
        assert stats.phases[phase] == max(r[key] for r in stats.reports) > 0, (phase, stats.phases)

    # bytes: each worker received exactly its own slices (ratio 1.00), all read by vLLM's loaders
    expected = _hand_bytes_per_rank(hf, tp=2)
    full_model = 4 * sum(t.numel() for t in load_file(new_checkpoint / "model.safetensors").values())
    for tp_rank, sync_rank in enumerate((2, 3)):
        assert stats.bytes_needed[sync_rank] == expected[tp_rank]
        assert stats.bytes_received[sync_rank] == expected[tp_rank]
        assert stats.bytes_read_by_loaders[sync_rank] == expected[tp_rank]
        assert stats.receive_ratio[sync_rank] == 1.0
        assert expected[tp_rank] < 0.55 * full_model
    assert sum(stats.bytes_sent.values()) == sum(stats.bytes_received.values())
    # memory: the transport's default send window keeps at most two buckets in flight per trainer rank (no block
    # here is larger than a 256 KiB bucket, so two buckets bound it); this push sends six nearly full buckets per
    # rank, so a window of three would stage ~0.75 MB and more than one bucket is really in flight at a time
    assert all(BUCKET < peak <= 2 * BUCKET for peak in stats.staging_peak_bytes.values()), stats.staging_peak_bytes

    # bits: what each worker received, and every block its loaders read, is the new checkpoint's block
    new = load_file(new_checkpoint / "model.safetensors")
    for report in reports.values():
        assert set(report["sha256"]) == set(report["blocks"])
        for name, box in report["blocks"].items():
            assert report["sha256"][name] == _sha256(_cut(new, name, box))
        assert {name for name, _, _ in report["loader_reads"]} == set(report["blocks"])
        for name, box, digest in report["loader_reads"]:
            assert digest == _sha256(_cut(new, name, box)), f"{name} {box} loaded different bits"

    # the served model is the new one, and generation reports the pushed version
    reference = _transformers_logprobs(new_checkpoint)
    for engine, ref, trainer, seq in zip(results[0]["engine"], reference, results[0]["trainer"], SEQS, strict=True):
        torch.testing.assert_close(torch.tensor(engine), ref, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(engine), trainer[: len(seq) - 1], atol=1e-4, rtol=0)
    assert {s.policy_version for s in results[0]["samples"]} == {5}


def test_incomplete_update_is_rejected_and_old_weights_serve(moe_fleet, new_checkpoint, tiny_moe_dir):
    # bring the fleet to a known state: the new checkpoint at version 5 (as the previous test leaves it)
    run_distributed(_trainer, 2, new_checkpoint, moe_fleet.urls[0], free_port(), free_port(), False,
                    init_dist=False)
    # push the ORIGINAL weights with one block missing from the plan
    results = run_distributed(_trainer, 2, tiny_moe_dir, moe_fleet.urls[0], free_port(), free_port(), True,
                              init_dist=False)
    for r in results:  # every trainer rank reports the rejection (none is left waiting)
        assert "rejected, model left unchanged on every TP rank" in r["error"]
        assert "worker 3:" in r["error"] and "layers.1.self_attn.k_proj.weight" in r["error"]
    reference = _transformers_logprobs(new_checkpoint)  # still the previous weights
    for engine, ref in zip(results[0]["engine"], reference, strict=True):
        torch.testing.assert_close(torch.tensor(engine), ref, atol=1e-4, rtol=0)
    assert {s.policy_version for s in results[0]["samples"]} == {5}
    # the rejection left the server able to take the next update
    again = run_distributed(_trainer, 2, new_checkpoint, moe_fleet.urls[0], free_port(), free_port(), False,
                            init_dist=False)
    assert again[0]["stats"].receive_ratio == {2: 1.0, 3: 1.0}


def test_loader_failure_leaves_the_replica_paused_until_a_complete_push(moe_fleet, new_checkpoint, tiny_moe_dir):
    """vLLM's loaders fail part-way through an update (injected after 3 tensors, once the model is being
    reloaded): the replica may hold a mix of old and new weights, so it must not serve: every trainer rank raises
    saying so, the replica stays paused, and the next complete push restores and resumes it."""
    results = run_distributed(_trainer, 2, tiny_moe_dir, moe_fleet.urls[0], free_port(), free_port(), "fail_load",
                              init_dist=False)
    for r in results:
        assert "injected loader failure after 3 tensors" in r["error"]
        assert "may hold a mix of old and new weights, so it is left paused" in r["error"]
        assert "keeps serving its previous weights" not in r["error"]
    assert results[0]["paused"] is True
    again = run_distributed(_trainer, 2, new_checkpoint, moe_fleet.urls[0], free_port(), free_port(), False,
                            init_dist=False)
    assert again[0]["paused"] is False
    assert again[0]["stats"].receive_ratio == {2: 1.0, 3: 1.0}
    reference = _transformers_logprobs(new_checkpoint)  # the complete push is what serves now
    for engine, ref in zip(again[0]["engine"], reference, strict=True):
        torch.testing.assert_close(torch.tensor(engine), ref, atol=1e-4, rtol=0)
    assert {s.policy_version for s in again[0]["samples"]} == {5}


def _trainer_delta(rank, world, dirs, url, port, sync_ports):
    """A megatron trainer (EP 2) built from each checkpoint of `dirs` in turn pushes it through one sync group with
    sync.delta (versions 1, 2, ...), then a second sync group without deltas pushes the last one again in full.
    Rank 0 returns each push's stats and the engine's log-probs after each."""
    from megarl.parallel.groups import TrainerLayout, destroy_trainer_groups, init_trainer_groups
    from megarl.rollout.client import RolloutClient
    from megarl.sync.weight_sync import PartitionedWeightSync
    from megarl.trainer.policy import MegatronPolicy

    init_trainer_groups(TrainerLayout(1, 1, 2), rank, world, "127.0.0.1", port)
    try:
        hf = read_hf_config(dirs[0])
        clients = [RolloutClient(url)] if rank == 0 else []
        out = {"stats": [], "engine": []}
        for delta, versions in ((True, list(enumerate(dirs, start=1))), (False, [(len(dirs) + 1, dirs[-1])])):
            sync = PartitionedWeightSync(rank, world, hf, clients, rollout_tp=2, rollout_replicas=1,
                                         store_host="127.0.0.1", store_port=sync_ports[int(not delta)],
                                         bucket_bytes=256 << 10, digests=True, timeout_s=90, delta=delta)
            for version, d in versions:
                policy = MegatronPolicy(d, hf, OptimizerConfig())
                out["stats"].append(sync.push(policy.iter_local_hf_slices(), version=version))
                if rank == 0:
                    out["engine"].append([clients[0].prompt_logprobs(s) for s in SEQS])
            sync.close()
        return out
    finally:
        destroy_trainer_groups()


def test_delta_pushes_from_an_expert_parallel_trainer(moe_fleet, new_checkpoint, tmp_path):
    """sync.delta through the real trainer (megatron, EP 2) into vLLM TP 2 serving the MoE (whose CPU experts are
    re-packed after every reload): after a full push and a delta, every block the workers hold is, bit for bit
    (sha256), the new checkpoint's; each worker received the bytes the rule gives from the two checkpoints'
    differing bits in its slices (the hand-written table); the engine's log-probs equal those of a full push of
    the same weights exactly, and transformers' for that checkpoint."""
    from tests.test_sync_delta import _wire_size

    v2 = sparsely_changed(new_checkpoint, tmp_path / "v2", 0.03, seed=31)
    out = run_distributed(_trainer_delta, 2, [new_checkpoint, v2], moe_fleet.urls[0], free_port(),
                          (free_port(), free_port()), init_dist=False)[0]
    first, delta, full = out["stats"]
    assert first.delta == {} and full.delta == {} and sorted(delta.delta) == [2, 3]
    hf = read_hf_config(v2)
    old, new = (load_file(d / "model.safetensors") for d in (new_checkpoint, v2))
    for tp_rank, worker in enumerate((2, 3)):
        want = changed = 0
        for block in vllm_rank_slices(hf, 2, tp_rank):
            index = tuple(slice(a, b) for a, b in block.box)
            c = int((old[block.name][index].contiguous().view(torch.int32)
                     != new[block.name][index].contiguous().view(torch.int32)).sum())
            want, changed = want + _wire_size(block.numel, c, 4), changed + c
        assert delta.bytes_received[worker] == want < delta.bytes_needed[worker] / 3
        assert delta.delta[worker][0] == changed
        report = next(r for r in delta.reports if r["rank"] == worker)
        for name, box in report["blocks"].items():  # what the worker holds and loaded after the delta
            assert report["sha256"][name] == _sha256(_cut(new, name, box)), name
    assert out["engine"][1] == out["engine"][2]  # delta vs full push of the same weights: identical floats
    for engine, ref in zip(out["engine"][1], _transformers_logprobs(v2), strict=True):
        torch.testing.assert_close(torch.tensor(engine), ref, atol=1e-4, rtol=0)
