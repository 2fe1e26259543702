"""The 30B projection of in-flight weight updates (`megarl bench inflight`): each row (controller, sync schedule,
admission, KV) simulated on the same batches (`megarl.bench.inflight_sim.simulation`), its steady figures next to
the baselines (`megarl.bench.inflight_sim.baselines`), and the decode-split sensitivity. Assumptions:
`megarl.bench.pipeline_sim`'s, plus those below (`assumptions()` names them all)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

from megarl.bench import pipeline_sim as cluster
from megarl.bench.dispatch_sim import CLUSTER_COSTS, EngineCosts, guru_lengths
from megarl.bench.inflight_sim.baselines import (
    COLOCATED_GPUS,
    COLOCATED_MODE_SWITCH_S,
    COLOCATED_REPLICAS,
    COLOCATED_SWITCH_S,
    colocated_step,
    sequential_times,
)
from megarl.bench.inflight_sim.simulation import InflightResult, simulate_inflight
from megarl.schedule import SyncSchedule

SCORE_GROUP_S = cluster.SCORE_S / cluster.PROMPTS  # assumption: the reward pool scores 1,152 responses in SCORE_S,
#                  so a group completing alone is scored in SCORE_S / 72 (groups are scored as they complete)
RECOMPUTE_PER_TOKEN_S = cluster.PREFILL_S / (cluster.PROMPTS * cluster.SAMPLES / cluster.REPLICAS
                                             * cluster.PROMPT_TOKENS)  # the model's prefill rate, per token
IN_FLIGHT = math.ceil(cluster.PROMPTS / cluster.REPLICAS)  # 9 groups (144 sequences) per replica, as today
INFLIGHT_SCHEDULES = ((1, 0), (1, 1), (1, 2), (4, 1), (8, 0), (8, 1), (8, 2))


def _lengths(per_prompt: bool) -> Callable[[int], list[list[int]]]:
    return lambda j: guru_lengths(j, per_prompt)


def project_inflight(m: int, n: int, per_prompt: bool = False, admit: str = "sequences", kv: str = "keep",
                     steps: int = 64, bound: int | None = None, quiesce: bool = False,
                     costs: EngineCosts = CLUSTER_COSTS, doomed: str = "finish", order: str = "home") -> InflightResult:
    return simulate_inflight(
        SyncSchedule(m, n), steps, cluster.REPLICAS, _lengths(per_prompt), costs, cluster.train_seconds,
        cluster.PUSH_S, SCORE_GROUP_S, IN_FLIGHT, admit, bound, kv, cluster.PROMPT_TOKENS, RECOMPUTE_PER_TOKEN_S,
        quiesce=quiesce, doomed=doomed, order=order)


def summarize(r: InflightResult, first: int, last: int, stream_mean: float) -> dict:
    """Steady figures over steps [first, last); `stream_mean`: the mean response length of prompt batches
    [first, last), what the same steps would train without partial rollouts."""
    lags = r.lag_histogram(first, last)
    trained = r.trained_lengths(first, last)
    admitted = [n for g in r.groups for n in g.lengths]
    lost = [n for g in r.groups if g.fate in ("dropped", "aborted") for n in g.lengths]
    steps = r.steps[first:last]
    return {
        "steady_step_s": r.mean_step_s(first, last),
        "trainer_idle": r.trainer_idle_fraction(first, last),
        "replica_idle": r.replica_idle_fraction(first, last),
        "engine_occupancy": r.occupancy(first, last),
        "lag_share": {str(k): v for k, v in lags.items()},
        "mean_lag": sum(k * v for k, v in lags.items()),
        "max_lag": max(lags) if lags else 0,
        "responses_spanning_versions": sum(s.responses_spanning for s in steps) / sum(s.responses for s in steps),
        "takes_with_choice": sum(s.pooled > r.prompts for s in steps) / len(steps),  # more than P scored groups
        #                    within the bound at the take: only there does the batch order matter
        "dropped_groups": r.dropped,
        "aborted_groups": r.aborted,
        "groups_admitted": len(r.groups),
        "wasted_token_share": r.wasted_tokens / max(1.0, sum(admitted)),
        "trained_mean_length": statistics.fmean(trained),
        "stream_mean_length": stream_mean,
        "lost_mean_length": statistics.fmean(lost) if lost else None,
        "length_bias": statistics.fmean(trained) / stream_mean - 1.0,
    }


ROWS = (  # (controller, sync (m, n), admission, KV)
    *(("queue", mn, admit, "keep") for admit in ("groups", "sequences") for mn in ((1, 1), (8, 1))),
    *(("in-flight", mn, admit, "keep") for admit in ("groups", "sequences") for mn in INFLIGHT_SCHEDULES),
    ("in-flight", (8, 1), "sequences", "recompute"),
)


def inflight_projection(steps: int = 64, lengths: Sequence[str] = ("per-sample", "per-prompt"),
                        doomed: str = "finish", order: str = "home") -> dict:
    """The 30B projection (batch rule `order` / `doomed`, by default megarl's: `simulate_inflight`): the sequential
    controller, today's best pipelined schedule (static shares, `pipeline_sim`), the colocated synchronous baseline
    on the same 64 GPUs, today's queue on the engine model (the control: pushes wait for the tail) and in-flight +
    partial rollouts, per schedule and admission policy; steady = steps [K/4, 3K/4). Every row on the same batches
    (`dispatch_sim.guru_lengths`)."""
    first, last = steps // 4, 3 * steps // 4
    out: dict = {"steps": steps, "steady_steps": [first, last], "order": order, "doomed": doomed,
                 "assumptions": assumptions(), "scenarios": []}
    for name in lengths:
        per_prompt = name == "per-prompt"
        stream = statistics.fmean(n for j in range(first, last) for g in guru_lengths(j, per_prompt) for n in g)
        seq = cluster.simulate(SyncSchedule(1, 0), steps, cluster.REPLICAS, sequential_times(per_prompt), False)
        best = cluster.simulate(SyncSchedule(8, 1), steps, cluster.REPLICAS, sequential_times(per_prompt), True)
        colo = [colocated_step(guru_lengths(j, per_prompt)) for j in range(first, last)]
        base = {
            "sequential_step_s": seq.mean_step_s(first, last),
            "pipelined_8_1_step_s": best.mean_step_s(first, last),
            "colocated_step_s": statistics.fmean(c.step_s for c in colo),
            "colocated_parts_s": {p: statistics.fmean(getattr(c, p) for c in colo)
                                  for p in ("generate_s", "score_s", "train_s", "switch_s")},
        }
        base["colocated_free_switch_step_s"] = base["colocated_step_s"] - base["colocated_parts_s"]["switch_s"]
        rows = []
        for controller, (m, n), admit, kv in ROWS:
            r = project_inflight(m, n, per_prompt, admit, kv, steps, quiesce=controller == "queue", doomed=doomed,
                                 order=order)
            row = summarize(r, first, last, stream)
            row.update({"controller": controller, "doomed": doomed, "order": order, "interval": m, "offset": n,
                        "bound": m + n - 1, "admit": admit, "kv": kv,
                        "vs_sequential": base["sequential_step_s"] / row["steady_step_s"],
                        "vs_colocated": base["colocated_step_s"] / row["steady_step_s"],
                        "vs_pipelined_8_1": base["pipelined_8_1_step_s"] / row["steady_step_s"]})
            rows.append(row)
        out["scenarios"].append({"lengths": name, **base, "rows": rows})
    return out


def assumptions() -> dict:
    return {
        "engine": "dispatch_sim.CLUSTER_COSTS (pipeline_sim: DECODE_STEP_S, DECODE_PER_SEQ_S, PREFILL_S)",
        "decode_step_s": cluster.DECODE_STEP_S, "decode_per_seq_s": cluster.DECODE_PER_SEQ_S,
        "prefill_per_seq_s": CLUSTER_COSTS.prefill_per_seq_s,
        "push_s": cluster.PUSH_S, "score_s_batch": cluster.SCORE_S, "score_s_group": SCORE_GROUP_S,
        "in_flight_groups_per_replica": IN_FLIGHT, "recompute_per_token_s": RECOMPUTE_PER_TOKEN_S,
        "colocated_gpus": COLOCATED_GPUS, "colocated_replicas": COLOCATED_REPLICAS,
        "colocated_train_scaling": f"train_s(32 GPUs) x {cluster.TRAINER_GPUS}/{COLOCATED_GPUS} (linear, optimizer "
                                   "included)",
        "colocated_mode_switch_s": COLOCATED_MODE_SWITCH_S, "colocated_switch_s": COLOCATED_SWITCH_S,
    }


def decode_split_sensitivity(steps: int = 48, fixed_s: Sequence[float] = (0.007, 0.0035), doomed: str = "finish",
                             order: str = "home") -> str:
    """`sync (8, 1)`, per-sample lengths, with a decode step's fixed cost moved to its per-sequence cost while a step
    of 144 sequences keeps its 14.2 ms: the sequential controller, today's queue and in-flight, group and sequence
    slots (steady steps [K/4, 3K/4)). A markdown table."""
    first, last = steps // 4, 3 * steps // 4
    full = cluster.DECODE_STEP_S + cluster.DECODE_PER_SEQ_S * 144
    lines = ["| decode step | sequential | queue, group slots | in-flight, group slots | queue, sequence slots | "
             "in-flight, sequence slots |", "|---|---:|---:|---:|---:|---:|"]
    for fixed in fixed_s:
        costs = EngineCosts(fixed, (full - fixed) / 144, CLUSTER_COSTS.prefill_per_seq_s)
        seq = cluster.simulate(SyncSchedule(1, 0), steps, cluster.REPLICAS, sequential_times(False, costs=costs),
                               False).mean_step_s(first, last)
        cells = [f"{fixed * 1e3:.1f} ms + {(full - fixed) / 144 * 1e3:.4f} ms a sequence", f"{seq:.1f} s"]
        for admit in ("groups", "sequences"):
            for quiesce in (True, False):
                r = project_inflight(8, 1, False, admit, "keep", steps, quiesce=quiesce, costs=costs, doomed=doomed,
                                     order=order)
                step = r.mean_step_s(first, last)
                cells.append(f"{step:.1f} s ({seq / step:.2f}x, occupancy {r.occupancy(first, last):.0%})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
