"""The markdown tables `megarl bench inflight` prints: the 30B projection's (`inflight_projection`'s result) and
the longtail setting's (`bench_setting`'s)."""

from __future__ import annotations

from megarl.bench.inflight_sim.baselines import COLOCATED_GPUS


def projection_markdown(result: dict) -> str:
    lines = []
    for sc in result["scenarios"]:
        c = sc["colocated_parts_s"]
        lines += [
            f"\n{sc['lengths']} lengths: sequential controller (1, 0) {sc['sequential_step_s']:.1f} s/step; "
            f"pipelined (8, 1) today (static shares) {sc['pipelined_8_1_step_s']:.1f} s/step; colocated "
            f"synchronous, {COLOCATED_GPUS} GPUs {sc['colocated_step_s']:.1f} s/step (generate {c['generate_s']:.1f} + "
            f"score {c['score_s']:.1f} + train {c['train_s']:.1f} + switch {c['switch_s']:.1f}; with a free switch "
            f"{sc['colocated_free_switch_step_s']:.1f})\n",
            "| controller | sync (m, n) | bound | admission | KV | steady s/step | vs sequential | vs colocated | "
            "vs (8, 1) today | trainer idle | replica idle | engine occupancy | token lag 0 / 1 / 2 / 3+ | max lag | "
            "responses spanning versions | dropped + aborted groups (of admitted) | tokens wasted | "
            "trained mean length (bias) | takes with more than P pooled |",
            "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---:|---|---:|",
        ]
        for r in sc["rows"]:
            share = {int(k): v for k, v in r["lag_share"].items()}
            three = sum(v for k, v in share.items() if k >= 3)
            choice = "-" if r["controller"] == "queue" else f"{r['takes_with_choice']:.0%}"  # queue: batch k = home k
            lines.append(
                f"| {r['controller']} | ({r['interval']}, {r['offset']}) | {r['bound']} | {r['admit']} | {r['kv']} | "
                f"{r['steady_step_s']:.1f} | {r['vs_sequential']:.2f}x | {r['vs_colocated']:.2f}x | "
                f"{r['vs_pipelined_8_1']:.2f}x | {r['trainer_idle']:.0%} | {r['replica_idle']:.0%} | "
                f"{r['engine_occupancy']:.0%} | "
                f"{share.get(0, 0):.0%} / {share.get(1, 0):.0%} / {share.get(2, 0):.0%} / {three:.0%} | "
                f"{r['max_lag']} | {r['responses_spanning_versions']:.0%} | {r['dropped_groups']} + "
                f"{r['aborted_groups']} (of {r['groups_admitted']}) | {r['wasted_token_share']:.1%} | "
                f"{r['trained_mean_length']:.0f} ({r['length_bias']:+.1%}) | {choice} |")
    return "\n".join(lines)


def bench_markdown(result: dict) -> str:
    lines = [
        f"stream: {result['stream_long_responses']} long responses, mean length {result['stream_mean_length']:.1f} "
        f"tokens; static split {result['static_per_batch']:.1f}, queue {result['queue_per_batch']:.1f} decode steps "
        "per batch (per window, as the bench)",
        "",
        "| run | decode steps per batch | vs today's queue | replica idle | max lag | dropped + aborted groups | "
        "long responses trained | trained mean length |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    base = result["runs"][0]["per_batch"]
    for r in result["runs"]:
        lines.append(f"| {r['run']} | {r['per_batch']:.1f} | {r['per_batch'] / base:.2f}x | {r['replica_idle']:.0%} | "
                     f"{r['max_lag']} | {r['dropped']} + {r['aborted']} | {r['long_responses_trained']} | "
                     f"{r['trained_mean_length']:.1f} |")
    return "\n".join(lines)
