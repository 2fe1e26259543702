"""What each vLLM TP rank needs from a sync: the HF blocks its weight loaders read, and where that list comes from.

Two sources (`sync.needs`):

- `recorded` (default): vLLM's own loaders, run over data-less probes (`megarl.sync.loader_reads`). The record is
  made where vLLM is installed, i.e. by the fleet: trainer rank 0 asks TP rank 0 of replica 0
  (`MegarlWorkerExtension.megarl_record_loader_reads`), which records its own layout (model, TP, expert parallel,
  vLLM version) in a fresh process, or reads it from its file cache. The trainer needs no vLLM, so trainer and
  fleet may run in separate containers. Rank 0 hands every trainer rank the record (the planner's input) and
  every vLLM worker its copy at `/init_weight_transfer_engine`; each worker re-computes the record's layout key
  from its own checkpoint and config and refuses updates planned for another layout.
- `table`: `megarl.sync.plan.vllm_rank_slices`, hand-written vLLM 0.32 layouts of Qwen2, Qwen3 and Qwen3-MoE
  without expert parallel: a fallback where the fleet cannot record, and the tests' independent reference.

The record is taken once per `PartitionedWeightSync` (once per run); its seconds are reported as the first push's
`needs_s` phase.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from megarl.sync.loader_reads import RankReads, reads_from_json, reads_to_json
from megarl.sync.plan import vllm_rank_slices

NeedsSource = Literal["recorded", "table"]


class NeedsError(RuntimeError):
    """The vLLM ranks' needs could not be established (the fleet could not record, or recorded another layout)."""


@dataclass(frozen=True)
class RolloutNeeds:
    """Per vLLM TP rank, the HF blocks it needs; `key` is the recorded layout's key (None for the table)."""

    source: NeedsSource
    reads: RankReads
    key: str | None
    seconds: float  # what it cost to obtain them (recording, or reading the fleet's file cache)

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "key": self.key, "seconds": self.seconds, "reads": reads_to_json(self.reads)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RolloutNeeds:
        return cls(data["source"], reads_from_json(data["reads"]), data["key"], float(data["seconds"]))


def table_needs(hf: dict[str, Any], tp: int) -> RolloutNeeds:
    """The needs from the hand-written table (`vllm_rank_slices`)."""
    start = time.perf_counter()
    reads = {r: vllm_rank_slices(hf, tp, r) for r in range(tp)}
    return RolloutNeeds("table", reads, None, time.perf_counter() - start)


def recorded_by_fleet(results: list[Any], tp: int, url: str) -> RolloutNeeds:
    """The needs recorded by a replica's workers (`collective_rpc("megarl_record_loader_reads")` results, TP rank 0's
    record, the others None), checked to cover `tp` ranks."""
    record = next((r for r in results if r), None)
    if record is None or "error" in record:
        why = record["error"] if record else "no worker returned a record"
        raise NeedsError(f"the fleet at {url} could not record what its vLLM ranks' loaders read: {why}. Fix it, or "
                         "set sync.needs=table (hand-written layouts of Qwen2/Qwen3/Qwen3-MoE only)")
    reads = reads_from_json(record["reads"])
    if sorted(reads) != list(range(tp)):
        raise NeedsError(f"the fleet at {url} recorded TP ranks {sorted(reads)}, but rollout.tp is {tp}")
    return RolloutNeeds("recorded", reads, record["key"], float(record["seconds"]))
