"""A step whose gradient norm is not finite is skipped on every rank (megatron-core's convention): weights and
optimizer state unchanged bit for bit, the step still counted; a later finite step updates as usual. Real
megatron-core ranks (tiny MoE, expert parallel 2: dense gradients summed over 2 data-parallel ranks); the
non-finite gradient is injected through the loss, as a diverging run produces it. A diverged run's pushes leave NaN
in the fleet's KV cache, which a new trainer's first push clears (`megarl.sync.vllm_receiver.scrub_kv_cache`)."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.parallel.groups import TrainerLayout
from tests.dist_utils import free_port, run_distributed

B, S = 4, 6


def _rank(rank, world, hf_dir, port):
    from megarl.config.schema import OptimizerConfig
    from megarl.models.qwen_provider import read_hf_config
    from megarl.parallel.groups import destroy_trainer_groups, dp_rank_and_size, init_trainer_groups
    from megarl.trainer.optimizer import adam_states
    from megarl.trainer.policy import MegatronPolicy

    init_trainer_groups(TrainerLayout(ep=2), rank, world, "127.0.0.1", port)
    try:
        hf = read_hf_config(hf_dir)
        policy = MegatronPolicy(hf_dir, hf, OptimizerConfig(lr=1e-2))
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, hf["vocab_size"], (B, S), generator=g)
        targets, mask = torch.roll(tokens, -1, 1), torch.ones(B, S)
        dp_rank, dp = dp_rank_and_size()
        share = [{"tokens": tokens[dp_rank::dp], "targets": targets[dp_rank::dp], "mask": mask[dp_rank::dp]}]

        def loss_fn(scale):
            def fn(lp, ent, mb):
                return scale * (lp * mb["mask"]).sum() / mask.sum(), {}
            return fn

        def snapshot():
            params = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
            state = {i: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                     for i, (_, _, s) in enumerate(adam_states(policy.optimizer))}
            return params, state

        first = policy.train_step(share, loss_fn(1.0))  # a finite step: optimizer state exists afterwards
        before = snapshot()
        # NaN on rank 0 only: the gradient sums carry it to every rank, and every rank must skip alike
        bad = policy.train_step(share, loss_fn(float("nan") if rank == 0 else 1.0))
        after_bad = snapshot()
        good = policy.train_step(share, loss_fn(1.0))
        after_good = snapshot()
        unchanged = all(torch.equal(before[0][n], after_bad[0][n]) for n in before[0]) and all(
            torch.equal(before[1][k][name], after_bad[1][k][name]) for k in before[1] for name in before[1][k])
        changed = sum(not torch.equal(after_bad[0][n], after_good[0][n]) for n in before[0])
        return {"first": first, "bad": bad, "good": good, "unchanged": unchanged, "changed": changed,
                "params": len(before[0]), "version": policy.version, "state_entries": len(before[1])}
    finally:
        destroy_trainer_groups()


def test_non_finite_gradient_skips_the_step_on_every_rank(tiny_moe_dir) -> None:
    results = run_distributed(_rank, 2, str(tiny_moe_dir), free_port(), init_dist=False)
    for r in results:
        assert r["first"]["train/skipped_step"] == 0 and math.isfinite(r["first"]["grad_norm"])
        assert r["bad"]["train/skipped_step"] == 1 and not math.isfinite(r["bad"]["grad_norm"])
        assert r["state_entries"] > 0 and r["unchanged"], "a skipped step changed weights or optimizer state"
        assert r["good"]["train/skipped_step"] == 0 and math.isfinite(r["good"]["grad_norm"])
        assert r["changed"] == r["params"], "the step after a skipped one did not update every parameter"
        assert r["version"] == 3  # the skipped step is counted


@pytest.mark.parametrize("skipped", [0, 1])
def test_metrics_writer_keeps_a_skipped_steps_non_finite_values_as_null(tmp_path, skipped) -> None:
    from megarl.metrics.writer import MetricsWriter

    writer = MetricsWriter(tmp_path)
    record = {"step": 0, "loss": float("nan"), "grad_norm": float("inf"), "train/skipped_step": skipped}
    if skipped:
        writer.write(record)
    else:
        with pytest.raises(FloatingPointError, match=r"non-finite metrics \['loss', 'grad_norm'\]"):
            writer.write(record)
    writer.close()
    import json

    written = json.loads((tmp_path / "metrics.jsonl").read_text())  # valid JSON: no NaN literal
    assert written["loss"] is None and written["grad_norm"] is None
    assert written["nonfinite"] == ["loss", "grad_norm"]


@pytest.mark.spoils_session_fleet("moe_fleet_2x1")
def test_a_diverged_run_stops_after_max_skipped_steps_without_checkpointing_them(tiny_moe_dir, moe_fleet_2x1,
                                                                                 tmp_path) -> None:
    """lr 1e30 with weight decay 0.1: the first update (decay alone is enough, whatever the rewards) blows the
    weights up, every later forward overflows, every later gradient is NaN. The run skips
    `trainer.max_skipped_steps` steps in a row, then stops with one line; checkpoints were saved only after steps
    that were not skipped. The blown-up weights are pushed to the session's two-replica fleet, so this test runs
    after every other user of it (`spoils_session_fleet`) but the killers, which push whole checkpoints first."""
    import json

    from megarl.launch import TrainerError, prepare, train

    run_dir = tmp_path / "run"
    cfg = prepare(None, [f"model.hf_dir={tiny_moe_dir}", f"run.dir={run_dir}", "run.steps=10", "trainer.world_size=2",
                         "trainer.ep=2", "rollout.tp=1", "rollout.replicas=2", "rollout.samples_per_prompt=4",
                         "rollout.max_new_tokens=2", "data.prompts_per_step=4", "sync.interval=1", "optimizer.lr=1e30",
                         "optimizer.weight_decay=0.1", "checkpoint.interval=1", "trainer.max_skipped_steps=3"])
    with pytest.raises(TrainerError, match=r"NonFiniteStepsError: steps (\d+)\.\.(\d+): 3 consecutive steps") as err:
        train(cfg, fleet_urls=moe_fleet_2x1.urls)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    flags = [r["train/skipped_step"] for r in records]
    first_bad = flags.index(1)
    assert first_bad >= 1 and flags == [0] * first_bad + [1, 1, 1], flags
    assert f"steps {first_bad}..{first_bad + 2}: 3 consecutive" in str(err.value)
    assert [r["train/skipped_steps"] for r in records] == [0] * first_bad + [1, 2, 3]
    assert all(r["grad_norm"] is None and "grad_norm" in r["nonfinite"] for r in records[first_bad:])
    saved = sorted(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*"))
    assert saved and max(saved) < first_bad, saved


def _spoil_then_repair(rank, world, tiny_dir, spoiled_dir, url, ports):
    """Two trainers in turn (each its own sync group, so each joins the replica at `url`): the first pushes
    `spoiled_dir` (non-finite weights, as a diverged run pushes them) and requests are generated; the second pushes
    the checkpoint `tiny_dir`. Returns the log-probs of sampled tokens after each push, the engine's log-probs of
    SEQS after the second, and its workers' reports."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from megarl.rollout.client import RolloutClient, RolloutServerError
    from megarl.sync.slices import HFSlice
    from megarl.sync.weight_sync import PartitionedWeightSync
    from tests.test_weight_sync import SEQS

    client = RolloutClient(url)
    out = {}
    for name, hf_dir, port, version in (("spoiled", spoiled_dir, ports[0], 101), ("repaired", tiny_dir, ports[1], 102)):
        hf = json.loads((Path(hf_dir) / "config.json").read_text())
        tensors = load_file(Path(hf_dir) / "model.safetensors")
        local = [(HFSlice.whole(n, tuple(t.shape)), t) for n, t in tensors.items()]
        sync = PartitionedWeightSync(rank, world, hf, [client], rollout_tp=1, rollout_replicas=1,
                                     store_host="127.0.0.1", store_port=port, bucket_bytes=256 << 10, timeout_s=90,
                                     needs="table")
        out[f"{name}_reports"] = sync.push(local, version=version).reports
        sync.close()
        groups = client.generate([s[:4] for s in SEQS], n=2, max_tokens=24, seed=0)
        out[name] = [x for group in groups for sample in group for x in sample.response_logprobs]
    try:  # (a NaN log-prob cannot be sent as JSON: vLLM answers 400)
        out["engine"] = [client.prompt_logprobs(s) for s in SEQS]
    except RolloutServerError as err:
        out["engine"] = f"{type(err).__name__}: {err}"
    return out


@pytest.mark.spoils_session_fleet("moe_fleet_2x1")  # should the repair fail, the replica stays spoiled
def test_a_new_trainers_first_push_clears_what_a_diverged_model_left_in_the_kv_cache(tiny_moe_dir, moe_fleet_2x1,
                                                                                      tmp_path) -> None:
    """A replica that served non-finite weights (a diverged run's) holds NaN in its KV cache, and vLLM lets stale
    cache slots reach later requests (`megarl.sync.vllm_receiver.scrub_kv_cache`): without the scrub, every token
    sampled after a clean push still came back NaN (vLLM's -9999.0 floor). A new trainer's first push clears it:
    the replica then serves the checkpoint's own log-probs (transformers, fp32) and finite samples."""
    import shutil

    from safetensors.torch import load_file, save_file

    from megarl.rollout.client import MISSING_LOGPROB
    from tests.test_weight_sync import _transformers_logprobs

    spoiled = tmp_path / "spoiled"
    shutil.copytree(tiny_moe_dir, spoiled)
    tensors = load_file(spoiled / "model.safetensors")
    tensors["model.embed_tokens.weight"] = torch.full_like(tensors["model.embed_tokens.weight"], math.inf)
    save_file(tensors, spoiled / "model.safetensors", metadata={"format": "pt"})

    out = run_distributed(_spoil_then_repair, 1, tiny_moe_dir, spoiled, moe_fleet_2x1.urls[0],
                          (free_port(), free_port()))[0]
    assert out["spoiled"] and all(x <= MISSING_LOGPROB for x in out["spoiled"]), out["spoiled"][:8]  # NaN in its KV
    assert all(x > MISSING_LOGPROB for x in out["repaired"]), [x for x in out["repaired"] if x <= MISSING_LOGPROB]
    assert isinstance(out["engine"], list), out["engine"]
    for engine, ref in zip(out["engine"], _transformers_logprobs(tiny_moe_dir), strict=True):
        torch.testing.assert_close(torch.tensor(engine), ref, atol=1e-4, rtol=0)
    (report,) = out["repaired_reports"]
    assert report["model_state"] == "updated" and report["kv_scrub_seconds"] >= 0, report
    print(f"\nthe scrub took {report['kv_scrub_seconds']:.3f} s (after the spoiled push: "
          f"{out['spoiled_reports'][0]['kv_scrub_seconds']:.3f} s)")
