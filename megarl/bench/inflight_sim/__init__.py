"""In-flight weight updates with partial rollouts, simulated (`megarl bench inflight`); pure Python, deterministic.

    simulation        one run, event by event: the engine model (`megarl.bench.dispatch_sim`'s), the fleet's
                      admission, in-flight pushes, batches of complete groups, the staleness bound (the rules)
    baselines         on the projection's batches: the sequential controller's stage times (static shares) and a
                      synchronous colocated step on the same 64 GPUs
    projection        the 30B projection: its assumptions, the rows (controller, schedule, admission, KV) and their
                      steady figures, the decode-split sensitivity
    longtail_setting  `megarl bench longtail`'s setting, in decode steps
    fleet_setting     `megarl bench inflight-fleet`'s setting, simulated against its measured runs (`--fleet-check`)
    report            the markdown tables `megarl bench inflight` prints

The names its callers use are imported here.
"""

from __future__ import annotations

from megarl.bench.inflight_sim.baselines import (
    COLOCATED_GPUS,
    COLOCATED_MODE_SWITCH_S,
    COLOCATED_REPLICAS,
    COLOCATED_SWITCH_S,
    ColocatedStep,
    colocated_step,
    sequential_times,
    static_share_s,
)
from megarl.bench.inflight_sim.longtail_setting import UNIT_STEP, bench_setting
from megarl.bench.inflight_sim.projection import (
    IN_FLIGHT,
    INFLIGHT_SCHEDULES,
    RECOMPUTE_PER_TOKEN_S,
    ROWS,
    SCORE_GROUP_S,
    assumptions,
    decode_split_sensitivity,
    inflight_projection,
    project_inflight,
    summarize,
)
from megarl.bench.inflight_sim.report import bench_markdown, projection_markdown
from megarl.bench.inflight_sim.simulation import InflightResult, StepOut, simulate_inflight

__all__ = [
    "COLOCATED_GPUS", "COLOCATED_MODE_SWITCH_S", "COLOCATED_REPLICAS", "COLOCATED_SWITCH_S", "IN_FLIGHT",
    "INFLIGHT_SCHEDULES", "RECOMPUTE_PER_TOKEN_S", "ROWS", "SCORE_GROUP_S", "UNIT_STEP", "ColocatedStep",
    "InflightResult", "StepOut", "assumptions", "bench_markdown", "bench_setting", "colocated_step",
    "decode_split_sensitivity", "inflight_projection", "project_inflight", "projection_markdown", "sequential_times",
    "simulate_inflight", "static_share_s", "summarize",
]
