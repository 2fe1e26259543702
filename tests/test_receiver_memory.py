"""A vLLM worker's memory during a push, staged against streamed (`sync.receive`), on a real vLLM server (CPU, TP 1)
serving a dense Qwen3 big enough (~1 GB fp32) for a second copy of its weights to stand far above the noise.

One sending process holds the checkpoint whole and pushes it with the real plan, wire and transport
(`tests.test_sync_llama._push`). The worker reports its resident set before the update and its peak during it
(VmHWM, reset at the update's start): peak - before is what the push added. Checked against independent references:
- staged: the extra is at least 0.9 x the shard's bytes (summed here from the checkpoint's tensors), so the
  measurement does see a second copy when there is one;
- streamed: the extra stays within a bound computed here from the plan's buckets by formula (see `_streamed_bound`),
  far below the shard;
- the log-probs served after a streamed push equal, exactly, those after a staged push of the same weights (and
  differ from before it), and a streamed push of the original weights gives back exactly the original log-probs;
- a sender failing mid-push in streamed mode leaves the replica paused and reported as possibly mixed, and the next
  complete push serves exactly the right log-probs again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megarl.data.tokenizer import save_tokenizer
from megarl.rollout.client import RolloutClient
from megarl.rollout.fleet import FleetSpec, launch
from tests.dist_utils import free_port, run_distributed
from tests.test_sync_llama import _push
from tests.test_weight_sync import SEQS

# ~254 M parameters, 1.02 GB fp32: embeddings 2 x 131 MB, 12 decoder layers of 63 MB
QWEN3 = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=8,
             head_dim=64, intermediate_size=4096, max_position_embeddings=256, rms_norm_eps=1e-6,
             tie_word_embeddings=False, initializer_range=0.02)
BUCKET = 8 << 20
POSTED_AHEAD = 2  # bucket indices a streamed receiver keeps posted (megarl.sync.stream.take_buckets)
# resident-set noise beside the buffers the formula counts: gloo's per-pair buffers, Python objects, the pages
# vLLM's code and logging touch during an update, the allocator's rounding
SLACK = 64 << 20
WORKER = 1  # the vLLM worker's sync-group rank (one trainer rank before it)
# the sync group's timeout: a push here takes ~5 s; a streamed receive posted on a gloo pair just after its sender
# closed it was once seen to wait for the timeout instead of failing at once (megarl.sync.wire.staged_ahead)
TIMEOUT_S = 30


def _random_qwen3(out: Path, seed: int) -> Path:
    """A Qwen3 checkpoint with QWEN3's shapes (transformers' Qwen3ForCausalLM, built on the meta device for its
    tensor names and shapes) and random weights: N(0, 0.02) matrices, unit norms. Writing the tensors directly
    takes seconds where transformers' own initialisation of 254 M parameters takes most of a minute here."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**QWEN3, architectures=["Qwen3ForCausalLM"], dtype="float32")
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in Qwen3ForCausalLM(config).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    tensors = {name: torch.ones(shape) if name.endswith("norm.weight") else 0.02 * torch.randn(shape, generator=g)
               for name, shape in shapes.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(out)
    save_tokenizer(out, model_max_length=QWEN3["max_position_embeddings"])
    return out


@pytest.fixture(scope="module")
def big_dir(tmp_path_factory) -> Path:
    return _random_qwen3(tmp_path_factory.mktemp("big") / "qwen3", seed=0)


@pytest.fixture(scope="module")
def new_dir(tmp_path_factory) -> Path:
    """Other weights of the same shapes: what the pushes bring."""
    return _random_qwen3(tmp_path_factory.mktemp("big_new") / "qwen3", seed=1)


@pytest.fixture(scope="module")
def big_fleet(big_dir, fleet_secret, tmp_path_factory, request):
    """The server and the log-probs it serves from the checkpoint it started with (before any push). `new_dir`
    is written while the server starts (in a thread here)."""
    from concurrent.futures import ThreadPoolExecutor

    starting = ThreadPoolExecutor(1).submit(launch, FleetSpec(model_dir=big_dir, tp=1, secret_file=fleet_secret,
                                                               log_dir=tmp_path_factory.mktemp("big_fleet_logs")))
    try:
        request.getfixturevalue("new_dir")
    except BaseException:
        if starting.exception() is None:  # waits for the start
            starting.result().stop()
        raise
    with starting.result() as fleet:
        client = RolloutClient(fleet.urls[0])
        yield fleet, [client.prompt_logprobs(s) for s in SEQS]


def _push_as(url: str, hf_dir: Path, receive: str, version: int, fail_after_blocks: int | None = None) -> dict:
    """One push of `hf_dir` from one sending process holding it whole (TP 1, the hand-written table's needs)."""
    return run_distributed(_push, 1, hf_dir, url, free_port(), "table", 1, BUCKET, receive, False, version,
                           fail_after_blocks, TIMEOUT_S)[0]


def _pushes(rank: int, world: int, url: str, pushes: list[tuple[Path, str, int]]) -> list[dict]:
    """`_push_as`'s push of each (checkpoint, receive mode, version) of `pushes`, in turn, in this one sending
    process, each through a sync group of its own (one process start instead of one per push)."""
    return [_push(rank, world, hf_dir, url, free_port(), "table", 1, BUCKET, receive, False, version, None, TIMEOUT_S)
            for hf_dir, receive, version in pushes]


def _extra(out: dict) -> int:
    """What the push added to the worker's memory at its peak (its own report), checking the report first."""
    assert "error" not in out, out.get("error")
    (report,) = out["stats"].reports
    assert report["memory_measured"] == "cpu_rss" and report["model_state"] == "updated", report
    return report["memory_peak_bytes"] - report["memory_before_bytes"]


def _plan_entries(hf_dir: Path):
    """The plan's buckets for this push, laid out here as the sender does (one holder of everything, TP 1)."""
    import json

    from megarl.sync.plan import plan_transfers, vllm_rank_slices
    from megarl.sync.slices import HFSlice
    from megarl.sync.wire import layout_buckets

    hf = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(hf_dir / "model.safetensors")
    holdings = {0: [HFSlice.whole(n, tuple(t.shape)) for n, t in tensors.items()]}
    plan = plan_transfers(holdings, {WORKER: vllm_rank_slices(hf, 1, 0)})
    return layout_buckets(plan, {n: t.dtype for n, t in tensors.items()}, BUCKET)


def _streamed_bound(entries) -> int:
    """What a streamed receiver may add, by formula from the plan's buckets:
    - the buckets it holds for the transfer: the POSTED_AHEAD indices posted plus the one being consumed, of every
      sender, at the worst point of the plan (a bucket can be larger than BUCKET: a larger block travels alone);
    - plus one more bucket, the largest: a module's received tensors are views into their buckets, kept by vLLM's
      layerwise reload until the module is complete, so a module begun in a bucket that has left that window keeps
      it alive;
    - plus twice the largest layer (a decoder layer, or a tensor outside the layers): the module vLLM materialises
      to load into, and the copy its processing makes (vLLM's CPU linear layers repack their weight);
    - plus SLACK."""
    sizes: dict[tuple[int, int], int] = {}
    layers: dict[str, int] = {}
    for e in entries:
        sizes[(e.sender, e.bucket)] = max(sizes.get((e.sender, e.bucket), 0), e.offset + e.nbytes)
        parts = e.block.name.split(".")
        layer = ".".join(parts[:3]) if parts[:2] == ["model", "layers"] else e.block.name
        layers[layer] = layers.get(layer, 0) + e.nbytes
    senders = {s for s, _ in sizes}
    last = max(b for _, b in sizes)
    held = max(sum(sizes.get((s, b + k), 0) for s in senders for k in range(POSTED_AHEAD + 1)) for b in range(last + 1))
    return held + max(sizes.values()) + 2 * max(layers.values()) + SLACK


def test_streamed_push_holds_buckets_not_the_shard(big_fleet, big_dir, new_dir):
    fleet, before = big_fleet
    url = fleet.urls[0]
    shard = sum(t.numel() * t.element_size() for t in load_file(new_dir / "model.safetensors").values())
    # one sending process, three pushes: staged, then the original weights again (streamed), then streamed
    staged, back, streamed = run_distributed(_pushes, 1, url, [(new_dir, "staged", 1), (big_dir, "streamed", 2),
                                                               (new_dir, "streamed", 3)])[0]
    bound = _streamed_bound(_plan_entries(new_dir))
    extras = {mode: _extra(out) for mode, out in (("staged", staged), ("streamed back", back),
                                                  ("streamed", streamed))}
    print(f"shard {shard} B; push extra (peak - before RSS) {extras}; streamed bound {bound} B; push seconds "
          f"{ {m: round(o['stats'].seconds, 2) for m, o in (('staged', staged), ('streamed', streamed))} }")
    for out, mode in ((staged, "staged"), (back, "streamed"), (streamed, "streamed")):
        assert out["stats"].reports[0]["receive"] == mode
        assert out["stats"].bytes_received[WORKER] == out["stats"].bytes_read_by_loaders[WORKER] == shard

    assert bound < 0.9 * shard  # the two assertions below can tell the modes apart
    assert extras["staged"] >= 0.9 * shard, (extras, shard)
    assert extras["streamed"] <= bound and extras["streamed back"] <= bound, (extras, bound)

    assert back["engine"] == before  # streamed, the original weights serve exactly as when the server loaded them
    assert streamed["engine"] == staged["engine"]  # exactly: the same bits loaded whichever way they came
    assert max(abs(a - b) for s, t in zip(staged["engine"], before, strict=True)
               for a, b in zip(s, t, strict=True)) > 1e-3
    assert {s.policy_version for s in streamed["samples"]} == {3}


def test_streamed_push_failing_mid_transfer_leaves_the_replica_paused_until_a_complete_push(big_fleet, big_dir,
                                                                                               new_dir):
    fleet, before = big_fleet
    url = fleet.urls[0]
    blocks = len(_plan_entries(new_dir))
    failed = _push_as(url, new_dir, "streamed", 7, fail_after_blocks=blocks // 2)
    assert "trainer rank 0 failed while sending: RuntimeError: injected failure while packing" in failed["error"]
    assert "streamed weight update failed after loading began" in failed["error"], failed["error"]
    assert "may hold a mix of old and new weights, so it is left paused" in failed["error"]
    assert failed["paused"] is True
    again = _push_as(url, big_dir, "streamed", 8)
    assert "error" not in again, again.get("error")
    assert again["paused"] is False and again["engine"] == before  # exactly the original weights, all of them
    assert {s.policy_version for s in again["samples"]} == {8}


def _stream_rank(rank: int, world: int, port: int, window: int) -> dict | None:
    """Trainer ranks 0 and 1 send (each holds half the rows of "w" and every other small tensor), rank 2 streams
    (a slow consumer, as a loader is): the values it is yielded, in order."""
    import time

    from megarl.sync.plan import plan_transfers
    from megarl.sync.slices import HFSlice
    from megarl.sync.stream import SliceStream, send_buckets
    from megarl.sync.transport import make_sync_group
    from megarl.sync.wire import layout_buckets

    tensors = _stream_tensors()
    holds = {0: {"w": (0, 8)}, 1: {"w": (8, 16)}}
    for i in range(12):
        holds[i % 2][f"t{i}"] = (0, 4)
    holdings = {r: [HFSlice(n, tuple(tensors[n].shape), ((a, b), (0, tensors[n].shape[1]))) for n, (a, b) in h.items()]
                for r, h in holds.items()}
    needs = {2: [HFSlice.whole(n, tuple(t.shape)) for n, t in tensors.items()]}
    entries = layout_buckets(plan_transfers(holdings, needs), {n: t.dtype for n, t in tensors.items()}, 2048)
    _, group = make_sync_group("127.0.0.1", port, rank, world, 60)
    if rank < 2:
        local = [(block, tensors[block.name][block.box[0][0]:block.box[0][1]]) for block in holdings[rank]]
        send_buckets(group, rank, entries, local, window=window)
        return None
    got = {}
    for name, block, data in SliceStream(group, [e for e in entries if e.receiver == 2]):
        got[name] = (block, data.clone())
        time.sleep(0.01)
    return got


def _stream_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = {"w": torch.randn(16, 96, generator=g)}  # split over the two senders: assembled from two pieces
    out.update({f"t{i}": torch.randn(4, 96, generator=g) for i in range(12)})  # 1.5 KiB: one bucket each
    return out


@pytest.mark.parametrize("window", [1, 2])
def test_slice_stream_takes_every_senders_buckets_in_order_and_assembles_split_tensors(window):
    """No vLLM: two senders (bucket-major, at most `window` in flight), one streamed receiver posting two bucket
    indices ahead; every tensor it yields equals the reference, the split one assembled from both senders."""
    got = run_distributed(_stream_rank, 3, free_port(), window, init_dist=False)[2]
    tensors = _stream_tensors()
    assert sorted(got) == sorted(tensors)
    for name, (block, data) in got.items():
        assert block.box == tuple((0, s) for s in tensors[name].shape)
        assert torch.equal(data, tensors[name]), name
