"""What one vLLM rank's memory must hold during a weight push, beside the weights it serves, per receive mode.

A pure model: no process, no weights. Its inputs are the rank's needs (the HF blocks one sync sends it: the plan's
`vllm_rank_slices` or the fleet's record), what each trainer rank holds (the senders), the served dtype's bytes per
element, `sync.bucket_mb` and the trainer's pipeline stages. `megarl plan` prints it; `megarl check --gpu`
(`push_memory_problem`) refuses a layout whose push does not fit beside vLLM's share of the GPU.

The modes (`sync.receive`; see docs/sync.md, "Receiver memory"):

- `staged`: the push's blocks arrive through device buckets and are copied into host memory (pinned); once every
  block is there, vLLM's layerwise reload loads them. Device extra = the receive buckets in flight + the largest
  module the reload materialises at once; host extra = the rank's whole shard. The old weights serve until every
  block has arrived, so a failed transfer changes nothing.
- `streamed`: blocks are loaded into the model as their buckets arrive. Device extra = the receive buckets in
  flight + the layers being assembled + the largest materialised module; host extra none on a GPU. A transfer
  that fails mid-push leaves the replica paused until a complete push.
- `legacy` (before issue 24; for comparison only): every block received into device buffers, then loaded: a second
  copy of the shard on the device, plus the materialised module.

Assumptions, each a bound rather than a measurement:

1. In flight: each sender keeps at most two buckets on the wire (`stream.send_buckets`: bucket k+1 packed while
   bucket k travels) and the receiver posts at most two rounds per sender, so a sender has at most
   `2 x bucket_bytes` in flight to this rank, and never more than the bytes it can send this rank at all. A block
   larger than a bucket travels alone (`wire.layout_buckets`) and adds its excess over a bucket: at most two such
   blocks per sender at once, and each block once. The senders are every trainer rank that holds some of the
   rank's blocks: the planner picks one holder per block (the least loaded), so the real senders are a subset and
   the bound holds whatever it picks.
2. vLLM's layerwise reload (`vllm/model_executor/model_loader/reload/layerwise.py`) works per module: a module's
   new weights are buffered until all of its elements have been loaded, then the module is materialised on the
   device (`torch.empty_strided`, its served size), loaded, processed and copied into the old storage, and freed.
   One module at a time is materialised; processing an unquantized module allocates nothing beyond it. The modules
   are vLLM's fused ones (`vllm_module`): q/k/v -> `qkv_proj`, gate/up -> `gate_up_proj`, all experts of a layer
   -> one `experts` (FusedMoE) module, every other tensor its own module.
3. Streamed: the blocks buffered for modules not yet complete are bounded by `LAYERS_ASSEMBLED_PER_STAGE` (2)
   decoder layers per trainer pipeline stage (every stage's senders walk their own layers in order, at their own
   pace), counted at the largest decoder layer this rank serves, and the buffered blocks hold only their own
   bytes. (`stream.Assembler` hands a tensor received as one piece over as a view into its bucket, and vLLM's
   reload keeps it until its module is complete, so such a view keeps its whole bucket: a receiver that lets
   views of unfinished modules pin buckets can exceed this term by up to a bucket per piece held.)
4. Staged device extra adds the in-flight buckets and the materialised module although the two phases do not
   overlap (max would be the tight figure): the sum leaves room for the caching allocator not reusing the
   buckets' blocks for the module.
5. The budget beside vLLM: vLLM sizes its KV cache so that its own allocations fill
   `gpu_memory_utilization x total memory` (vllm/v1/worker/utils.py `request_memory`), counted from a snapshot
   taken after the CUDA context and its tensor-parallel NCCL communicator exist; what a push may use is the rest,
   `rollout.gpu_memory_gb x 1e9 x (1 - rollout.gpu_memory_utilization)`, less `CUDA_RESERVE_BYTES` for what lives
   outside both (below). `rollout.gpu_memory_gb` is the nominal size (an "80 GB" H100 has a "total capacity of 79.11
   GiB" = 84.9e9 bytes in torch's words), so the budget errs on the safe side.
6. Host extra is this rank's alone; a node holding several vLLM ranks holds the sum.
7. On a GPU fleet (NCCL) the rank's sync group holds one communicator and a connection to every trainer rank, all
   made when it joins (`megarl.sync.group_setup.connect`): `NCCL_COMM_BYTES + trainer ranks x NCCL_PEER_BYTES`
   (`nccl_group_bytes`), counted in every mode's device extra. It lives as long as the group, not only during a
   push, but it is made after vLLM sized its KV cache, so it must fit in the same room beside vLLM's share.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from typing import Literal

from megarl.sync.slices import HFSlice

ReceiveMode = Literal["staged", "streamed"]
MODES: tuple[ReceiveMode, ...] = ("staged", "streamed")

# Device memory outside vLLM's budget and outside the push: the CUDA context of a vLLM worker with torch's kernels
# loaded (commonly 0.5 GiB on an H100; not measured here: no GPU). `megarl check --gpu` keeps it free on top of the
# push and the sync group's NCCL memory (below).
CUDA_RESERVE_BYTES = 512 * (1 << 20)
# The weight-sync group's NCCL memory on a vLLM worker (assumption 7), made when the worker joins, after vLLM sized
# its KV cache, so it comes out of what vLLM leaves. Assumed figures, not measured (no GPU was lent): a communicator's
# own device structures, and per connected peer the point-to-point buffers of its channels (NCCL_BUFFSIZE-sized 4 MiB
# simple-protocol buffers on a couple of channels, and the small low-latency ones), rounded up.
NCCL_COMM_BYTES = 64 * (1 << 20)
NCCL_PEER_BYTES = 16 * (1 << 20)
BUCKETS_IN_FLIGHT_PER_SENDER = 2  # bucket k+1 packed (and posted) while bucket k travels
LAYERS_ASSEMBLED_PER_STAGE = 2  # streamed: decoder layers per trainer pipeline stage whose blocks wait for the rest
MIB = 1 << 20

_FUSED = (
    (re.compile(r"^(.*\.mlp\.experts)\.\d+\.(gate|up|down)_proj\.weight$"), r"\1"),
    (re.compile(r"^(.*\.self_attn)\.[qkv]_proj\.(weight|bias)$"), r"\1.qkv_proj"),
    (re.compile(r"^(.*\.mlp)\.(gate|up)_proj\.weight$"), r"\1.gate_up_proj"),
)


@cache
def vllm_module(name: str) -> str:
    """The vLLM module HF tensor `name` loads into: the unit layerwise reload materialises at once."""
    for pattern, module in _FUSED:
        if pattern.match(name):
            return pattern.sub(module, name)
    return name.rsplit(".", 1)[0]


@cache
def decoder_layer(name: str) -> str:
    """`model.layers.<i>` for a decoder layer's tensor, else the tensor's module (embedding, final norm, head)."""
    m = re.match(r"^(.*?\.layers\.\d+)\.", name)
    return m.group(1) if m else vllm_module(name)


def _largest_group(blocks: Iterable[HFSlice], itemsize: int, key: Callable[[str], str]) -> int:
    sizes: dict[str, int] = {}
    for b in blocks:
        group = key(b.name)
        sizes[group] = sizes.get(group, 0) + b.numel * itemsize
    return max(sizes.values(), default=0)


def largest_module_bytes(blocks: Iterable[HFSlice], itemsize: int) -> int:
    """Bytes of the largest vLLM module among `blocks` (one rank's needs): what the reload materialises at once."""
    return _largest_group(blocks, itemsize, vllm_module)


def largest_layer_bytes(blocks: Iterable[HFSlice], itemsize: int) -> int:
    """Bytes of the largest decoder layer (or other top-level module) among `blocks`."""
    return _largest_group(blocks, itemsize, decoder_layer)


def overlap(a: HFSlice, b: HFSlice) -> int:
    """Elements two blocks of the same tensor share (`HFSlice.intersect`'s size, without building it)."""
    n = 1
    for (a0, a1), (b0, b1) in zip(a.box, b.box, strict=True):
        n *= max(0, min(a1, b1) - max(a0, b0))
    return n


def held_pieces(holdings: dict[int, list[HFSlice]], needs: list[HFSlice]) -> dict[int, list[int]]:
    """Trainer rank -> the elements of each piece of `needs` (one vLLM rank's blocks) it holds: everything it could
    send that rank. Ranks that hold none of them are left out."""
    wanted: dict[str, list[HFSlice]] = {}
    for need in needs:
        wanted.setdefault(need.name, []).append(need)
    out: dict[int, list[int]] = {}
    for rank, blocks in holdings.items():
        pieces = [n for block in blocks for need in wanted.get(block.name, ()) if (n := overlap(need, block))]
        if pieces:
            out[rank] = pieces
    return out


def sender_bytes(holdings: dict[int, list[HFSlice]], needs: list[HFSlice], itemsize: int) -> dict[int, int]:
    """Trainer rank -> bytes of `needs` it holds (`held_pieces`, summed)."""
    return {rank: sum(pieces) * itemsize for rank, pieces in held_pieces(holdings, needs).items()}


def in_flight_bytes(pieces: dict[int, list[int]], needs: list[HFSlice], itemsize: int, bucket_bytes: int) -> int:
    """Receive buckets one vLLM rank may hold at once (assumption 1), from `held_pieces`: per sender two buckets, or
    all it holds if less; plus what blocks larger than a bucket (each travels alone) add beyond a bucket: at most
    two such blocks per sender, and each block once (the smaller of the two sums)."""
    per_sender = BUCKETS_IN_FLIGHT_PER_SENDER * bucket_bytes

    def excess(elements: int) -> int:
        return max(0, elements * itemsize - bucket_bytes)

    buckets = sum(min(per_sender, sum(p) * itemsize) for p in pieces.values())
    two_per_sender = sum(sum(sorted(map(excess, p))[-BUCKETS_IN_FLIGHT_PER_SENDER:]) for p in pieces.values())
    each_once = sum(excess(b.numel) for b in needs)
    return buckets + min(two_per_sender, each_once)


def nccl_group_bytes(trainers: int) -> int:
    """Device bytes of a vLLM rank's NCCL sync group, connected to `trainers` trainer ranks (assumption 7)."""
    return NCCL_COMM_BYTES + trainers * NCCL_PEER_BYTES


def push_budget_bytes(gpu_memory_gb: float, utilization: float, reserve: int = CUDA_RESERVE_BYTES) -> int:
    """Device bytes a push may use beside vLLM's share of the GPU (assumption 5); negative when none."""
    return round(gpu_memory_gb * 1e9 * (1 - utilization)) - reserve


def max_utilization(device_extra: int, gpu_memory_gb: float, reserve: int = CUDA_RESERVE_BYTES) -> float:
    """The largest `rollout.gpu_memory_utilization` that leaves `device_extra` free beside vLLM (2 decimals, down)."""
    return int((1 - (device_extra + reserve) / (gpu_memory_gb * 1e9)) * 100) / 100


@dataclass(frozen=True)
class ReceiverMemory:
    """One vLLM rank's memory during a push, in bytes (see the module docstring for the assumptions)."""

    served: int  # the rank's weights in the served dtype (= the bytes one sync sends it)
    senders: int  # trainer ranks holding some of its blocks
    bucket_bytes: int
    in_flight: int  # receive buckets in flight at once
    largest_module: int  # what vLLM's layerwise reload materialises at once
    largest_layer: int  # the largest decoder layer it serves
    stages: int  # trainer pipeline stages
    group: int = 0  # the sync group's NCCL memory on a GPU (assumption 7)

    @property
    def assembling(self) -> int:
        """Streamed: blocks buffered for layers not complete yet (assumption 3)."""
        return LAYERS_ASSEMBLED_PER_STAGE * self.stages * self.largest_layer

    @property
    def legacy_device(self) -> int:
        """Before issue 24: a second copy of the shard on the device, then the materialised module."""
        return self.served + self.largest_module

    def device_extra(self, mode: ReceiveMode, cuda: bool = True) -> int:
        """Peak device bytes beyond the served weights, the sync group's NCCL memory included (0 on a CPU fleet:
        everything is host memory)."""
        if not cuda:
            return 0
        if mode == "staged":
            return self.group + self.in_flight + self.largest_module
        return self.group + self.in_flight + self.assembling + self.largest_module

    def host_extra(self, mode: ReceiveMode, cuda: bool = True) -> int:
        """Peak host bytes beyond the served weights: staged keeps the shard there; on a CPU fleet the device's
        part is host memory too."""
        staged_shard = self.served if mode == "staged" else 0
        return staged_shard + (0 if cuda else self.device_extra(mode, cuda=True) - self.group)


def receiver_memory(needs: list[HFSlice], holdings: dict[int, list[HFSlice]], itemsize: int, bucket_bytes: int,
                    stages: int, pieces: dict[int, list[int]] | None = None) -> ReceiverMemory:
    """The model for one vLLM rank whose blocks are `needs`, fed by trainer ranks holding `holdings`; `pieces`:
    `held_pieces(holdings, needs)` when the caller has it already (it does not depend on the dtype)."""
    if pieces is None:
        pieces = held_pieces(holdings, needs)
    return ReceiverMemory(
        served=sum(b.numel for b in needs) * itemsize, senders=len(pieces), bucket_bytes=bucket_bytes,
        in_flight=in_flight_bytes(pieces, needs, itemsize, bucket_bytes),
        largest_module=largest_module_bytes(needs, itemsize), largest_layer=largest_layer_bytes(needs, itemsize),
        stages=stages, group=nccl_group_bytes(len(holdings)),
    )


def bucket_bytes_of(bucket_mb: float) -> int:
    """`sync.bucket_mb` (MiB) in bytes, as the sender sizes its buckets."""
    return int(bucket_mb * MIB)
