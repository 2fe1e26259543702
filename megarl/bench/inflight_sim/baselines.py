"""The baselines the in-flight projection is set against, on its batches (`dispatch_sim.guru_lengths`): the
sequential controller's stage times with static shares (`pipeline_sim.StageTimes`, which `pipeline_sim.simulate`
runs), and a synchronous colocated step on the same 64 GPUs. Assumptions: `megarl.bench.pipeline_sim`'s, plus the
colocated ones below."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megarl.bench import pipeline_sim as cluster
from megarl.bench.dispatch_sim import CLUSTER_COSTS, EngineCosts, guru_lengths

COLOCATED_GPUS = cluster.TRAINER_GPUS + cluster.REPLICAS * 4  # the same 64 GPUs
COLOCATED_REPLICAS = COLOCATED_GPUS // 4  # every GPU generates: 16 vLLM TP-4 replicas
COLOCATED_MODE_SWITCH_S = 2.0  # assumption: one train <-> generate memory transition (offload / onload of the
#                  trainer's weights and optimizer state, vLLM sleep / wake-up of weights and KV cache): verl's
#                  hybrid engine switches in "1-3 s" (deepwiki.com/volcengine/verl, hybrid engine architecture)
COLOCATED_SWITCH_S = 2 * COLOCATED_MODE_SWITCH_S + cluster.PUSH_FIXED_S  # two transitions a step, plus the
#                  weights resharded into the engine: the push model's fixed part (layerwise reload of 48 layers,
#                  lifecycle), without its network part (the weights stay on the node)


def static_share_s(groups: Sequence[Sequence[int]], costs: EngineCosts = CLUSTER_COSTS) -> float:
    """One replica's static share, the projection's formula: prefill + step x longest + per-seq x total tokens."""
    seqs = [n for g in groups for n in g]
    if not seqs:
        return 0.0
    return costs.prefill_per_seq_s * len(seqs) + costs.step_s * max(seqs) + costs.per_seq_s * sum(seqs)


def sequential_times(per_prompt: bool, replicas: int = cluster.REPLICAS,
                     costs: EngineCosts = CLUSTER_COSTS) -> cluster.StageTimes:
    """`pipeline_sim.StageTimes` on the same batches as the in-flight runs (`guru_lengths`), static shares
    (replica r: prompts i = r mod R; with windows of one batch the queue takes the same time: `dispatch_sim`)."""
    def generate(r: int, j: int) -> float:
        b = guru_lengths(j, per_prompt)
        return static_share_s([g for i, g in enumerate(b) if i % replicas == r], costs)

    def train(k: int) -> float:
        return cluster.train_seconds([n for g in guru_lengths(k, per_prompt) for n in g])

    return cluster.StageTimes(generate=generate, score=cluster.SCORE_S, train=train, push=cluster.PUSH_S)


@dataclass(frozen=True)
class ColocatedStep:
    generate_s: float  # the slowest of the replicas' static shares
    score_s: float
    train_s: float
    switch_s: float

    @property
    def step_s(self) -> float:
        return self.generate_s + self.score_s + self.train_s + self.switch_s


def colocated_step(batch: Sequence[Sequence[int]], replicas: int = COLOCATED_REPLICAS,
                   gpus: int = COLOCATED_GPUS, switch_s: float = COLOCATED_SWITCH_S,
                   costs: EngineCosts = CLUSTER_COSTS, score_s: float = cluster.SCORE_S,
                   train_32: Callable[[list[int]], float] | None = None) -> ColocatedStep:
    """A synchronous colocated step (verl / NeMo-RL's default): all `gpus` generate the batch as `replicas` static
    shares of the same engine, then score, then all train: the trainer's `TRAINER_GPUS` time x TRAINER_GPUS /
    gpus (linear scaling, the optimizer step included: the most favourable assumption for this baseline), plus
    the switch."""
    train_32 = train_32 or cluster.train_seconds
    gen = max(static_share_s([g for i, g in enumerate(batch) if i % replicas == r], costs) for r in range(replicas))
    train = train_32([n for g in batch for n in g]) * cluster.TRAINER_GPUS / gpus
    return ColocatedStep(gen, score_s, train, switch_s)
