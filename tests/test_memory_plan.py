"""The trainer memory plan (`megarl.trainer.memory_plan`) against a measured CPU run, and `megarl check --gpu` refusing
a layout that cannot fit.

Measured: the first training step of the tiny dense Qwen3 through `train_on_batch` (token-budget microbatching,
megatron's local spec, fp32) in a fresh process per token budget, at 512 and 2,048 tokens per microbatch (rows of
256). The rise of the process's resident-set high-water mark during the step (`megarl.sync.peak_memory`) minus the
same at the other budget is what the extra 1,536 tokens cost: the weights, gradients, AdamW state and everything
else that does not grow with tokens cancel. The plan's projection of that difference (activations of the stage's
layers including the local spec's attention scores, plus the output log-prob's per-token terms) must be within 25%
of it; a per-token inventory that missed the MLP, the scores or the q/k/v tensors would be off by more.

The fixed terms, in mixed precision too: one spawned pair of gloo ranks trains one step of the tiny dense model at
DP 2 (fp32 and bf16, with and without megatron's distributed optimizer) and of the tiny MoE at EP 2 (bf16,
distributed optimizer: dense moments sharded over DP 2, experts' over expert DP 1, i.e. not) and at EP 1 (expert DP
2); the storages the model, DDP's buffers and the optimizer hold, by what reaches them, are the plan's weights,
gradient buffers, main parameters and Adam moments per rank (measured: equal to the byte but for the Adam step
counts).
"""

from __future__ import annotations

import pytest
import torch

from megarl.batch import RolloutBatch
from megarl.bench.trainer import held_bytes
from megarl.config.schema import Config, DataConfig, ModelConfig, OptimizerConfig, RolloutConfig, TrainerConfig
from megarl.models.qwen_provider import read_hf_config
from megarl.models.tiny import make_tiny_checkpoint
from megarl.parallel.groups import TrainerLayout
from megarl.trainer.memory_plan import activation_bytes, logits_bytes, trainer_memory, trainer_memory_problem
from tests.dist_utils import free_port, run_distributed

ROW = 256
BUDGETS = (2 * ROW, 8 * ROW)


def _batch(rows: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(rows)
    responses = [torch.randint(3, 32, (ROW - 4,), generator=g).tolist() for _ in range(rows)]
    return RolloutBatch(
        index=0,
        prompt_ids=[[5, 6, 7, 8]] * rows,
        response_ids=responses,
        engine_logprobs=[[-1.0] * (ROW - 4)] * rows,
        rewards=torch.ones(1, rows),
        advantages=torch.ones(1, rows),
        policy_version=0,
    )


def _step_peak(rank, world, hf_dir, budget):
    from megarl.algorithms.registry import get_algorithm
    from megarl.parallel.groups import TrainerLayout, destroy_trainer_groups, init_trainer_groups
    from megarl.sync.peak_memory import PeakMemory
    from megarl.trainer.policy import MegatronPolicy
    from megarl.trainer.step import train_on_batch

    init_trainer_groups(TrainerLayout(), 0, 1, "127.0.0.1", free_port())
    try:
        policy = MegatronPolicy(hf_dir, read_hf_config(hf_dir), OptimizerConfig(lr=1e-6))
        cfg = Config(
            model=ModelConfig(hf_dir=hf_dir), trainer=TrainerConfig(world_size=1, max_tokens_per_microbatch=budget)
        )
        batch = _batch(budget // ROW)
        memory = PeakMemory.start(cuda=False)
        metrics = train_on_batch(policy, batch, get_algorithm("grpo"), cfg, 0, 0, 1, lag=0)
        report = memory.finish()
        assert metrics["train/microbatches"] == 1 and metrics["train/tokens_computed"] == budget
        return report["memory_peak_bytes"] - report["memory_before_bytes"]
    finally:
        destroy_trainer_groups()


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "dense", kind="dense")


def test_activation_projection_matches_a_measured_cpu_run(dense):
    hf = read_hf_config(dense)
    measured = [run_distributed(_step_peak, 1, dense, b, init_dist=False)[0] for b in BUDGETS]

    def projected(tokens: int) -> int:
        return activation_bytes(hf, tokens, ROW, hf["num_hidden_layers"], tp=1, flash=False) + logits_bytes(
            hf, tokens, tp=1, fused=True, chunk=4096
        )

    got, want = measured[1] - measured[0], projected(BUDGETS[1]) - projected(BUDGETS[0])
    assert want > 50 * 2**20  # the difference is large enough to measure (tens of MiB)
    mib = 2**20
    print(f"memory plan: measured {got / mib:.1f} MiB, projected {want / mib:.1f} MiB for 1,536 more tokens")
    assert abs(got - want) <= 0.25 * want, f"measured {got / mib:.1f} MiB for 1,536 more tokens, plan {want / mib:.1f}"


def test_check_refuses_a_layout_that_cannot_fit(dense):
    hf = read_hf_config(dense)
    cfg = Config(
        model=ModelConfig(hf_dir=dense),
        trainer=TrainerConfig(world_size=1, gpu_memory_gb=4.0),
        rollout=RolloutConfig(max_new_tokens=1024),
        data=DataConfig(max_prompt_tokens=1024),
    )
    # the tiny model fits 4 GB at a 4k-token microbatch: weights + grads + AdamW 16 B/param, the reserve 3 GB
    small = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"max_tokens_per_microbatch": 4096})})
    assert trainer_memory_problem(hf, small) is None
    # count-based: 32 rows x 2,048 tokens = 65,536 tokens per microbatch, ~30 kB of activations per token: ~2 GB
    problem = trainer_memory_problem(hf, cfg)
    assert problem is not None and "trainer.max_tokens_per_microbatch" in problem and "65,536 tokens" in problem
    rank = trainer_memory(hf, cfg)[0]
    assert rank.weights == rank.grads == 4 * rank.params and rank.optimizer == 8 * rank.params


# a Qwen3-style dense config of 8 layers (splits over 2 and 4 stages); the plan needs no weights
DENSE8 = dict(model_type="qwen3", vocab_size=1024, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, intermediate_size=512, tie_word_embeddings=False)


def _one_f_one_b_peak(pp: int, stage: int, microbatches: int) -> int:
    """Hand count of megatron's non-interleaved 1F1B on pipeline stage `stage`: `pp - stage - 1` warm-up forwards,
    then one forward and one backward at a time, then the cool-down backwards; the most microbatches forwarded and
    not yet backwarded at any moment (whose activations the stage holds)."""
    warmup = min(pp - stage - 1, microbatches)
    ops = [1] * warmup + [1, -1] * (microbatches - warmup) + [-1] * warmup
    held = peak = 0
    for op in ops:
        held += op
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("pp, expect", [(2, [2, 1]), (4, [4, 3, 2, 1])])
def test_microbatches_in_flight_per_stage_follow_1f1b(tmp_path, pp, expect):
    assert [_one_f_one_b_peak(pp, s, microbatches=16) for s in range(pp)] == expect
    cfg = Config(model=ModelConfig(hf_dir=str(tmp_path)), trainer=TrainerConfig(world_size=pp, pp=pp,
                                                                                max_tokens_per_microbatch=1024),
                 rollout=RolloutConfig(max_new_tokens=256), data=DataConfig(max_prompt_tokens=256))
    rows = trainer_memory(DENSE8, cfg)
    assert [m.stage for m in rows] == list(range(pp))
    assert [m.in_flight for m in rows] == expect
    one = activation_bytes(DENSE8, 1024, 512, 8 // pp, 1, flash=True)  # one microbatch in one stage's layers
    assert [m.activations for m in rows] == [n * one for n in expect]


def test_expert_tensor_parallel_in_the_plan():
    """Qwen3-30B-A3B at tp 2 x ep 8 on 16 ranks, whole experts (expert_tp 1) against experts split in two
    (expert_tp 2), worked out by hand from the config: 48 layers of 128 experts (16 local), hidden 2,048, expert
    columns 768, top-8 routing; expert data parallel 16 / (expert_tp x 8)."""
    from pathlib import Path

    hf = read_hf_config(Path(__file__).resolve().parents[1] / "configs" / "models" / "qwen3-30b-a3b")
    h, inter, layers, local, top_k = 2048, 768, 48, 16, 8
    assert (hf["hidden_size"], hf["moe_intermediate_size"], hf["num_hidden_layers"]) == (h, inter, layers)

    def rank(expert_tp: int):
        trainer = TrainerConfig(world_size=16, tp=2, ep=8, expert_tp=expert_tp, distributed_optimizer=True,
                                max_tokens_per_microbatch=4096)
        return trainer_memory(hf, Config(model=ModelConfig(hf_dir="x"), trainer=trainer))[0]

    whole, split = rank(1), rank(2)
    expert_params = layers * local * 3 * h * inter  # gate, up, down of the rank's 16 experts, whole
    assert whole.params - split.params == expert_params // 2
    dense = whole.params - expert_params  # attention, norms, router, vocabulary shards: the same either way
    # AdamW (8 B/param) split over data parallel 8 for dense parameters, over expert data parallel 2 or 1 for experts
    assert whole.optimizer == int(8 * (dense / 8 + expert_params / 2))
    assert split.optimizer == int(8 * (dense / 8 + expert_params / 2 / 1))
    # activations: each routed copy's permuted input and output (h each) sit on its expert's expert_tp ranks, shared
    # by the tp ranks of the tokens: 2h x expert_tp / tp per copy, so expert_tp 2 keeps top_k x h more per token
    assert split.activations - whole.activations == 4 * 4096 * layers * top_k * h


# ---- the fixed terms (weights, gradient buffers, main parameters, Adam moments) against a real training step -------
# (label, checkpoint kind, expert parallel, precision, distributed optimizer): one spawned pair of gloo ranks runs
# them all, one after the other; DP 2 (dense) so the distributed optimizer shards, EP 2 (expert DP 1) so experts do not,
# EP 1 (expert DP 2) so they do
HELD_CASES = [  # label, model, EP, precision, distributed optimizer, gradient buffers in bf16
    ("dense-fp32-distopt", "dense", 1, "fp32", True, False),
    ("dense-bf16-distopt", "dense", 1, "bf16", True, False),
    ("dense-bf16", "dense", 1, "bf16", False, False),
    ("dense-bf16-distopt-bf16grads", "dense", 1, "bf16", True, True),
    ("moe-ep2-bf16-distopt", "moe", 2, "bf16", True, False),
    ("moe-edp2-bf16-distopt", "moe", 1, "bf16", True, False),
]


def _held_rank(rank, world, hf_dirs, port):
    from megatron.core import parallel_state

    from megarl.parallel.cpu_compat import init_rng_tracker
    from megarl.parallel.groups import destroy_trainer_groups, init_trainer_groups
    from megarl.trainer.policy import MegatronPolicy

    init_trainer_groups(TrainerLayout(), rank, world, "127.0.0.1", port)
    out = {}
    try:
        for label, kind, ep, precision, distributed, bf16_grads in HELD_CASES:
            if ep != parallel_state.get_expert_model_parallel_world_size():
                parallel_state.destroy_model_parallel()  # the same world, regrouped
                parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
                init_rng_tracker()
            hf = read_hf_config(hf_dirs[kind])
            policy = MegatronPolicy(hf_dirs[kind], hf, OptimizerConfig(lr=1e-3), precision=precision,
                                    distributed_optimizer=distributed, grad_reduce_in_bf16=bf16_grads)
            g = torch.Generator().manual_seed(rank)
            tokens = torch.randint(3, hf["vocab_size"], (2, 8), generator=g)
            mb = {"tokens": tokens, "targets": torch.roll(tokens, -1, 1)}
            policy.train_step([mb], lambda lp, ent, m: (lp.sum() / 32, {}))  # Adam's state exists after a step
            out[label] = held_bytes(policy)
            del policy
    finally:
        destroy_trainer_groups()
    return out


def test_fixed_terms_match_what_a_training_step_allocates(tmp_path):
    """Per rank, the plan's weights (4 or 2 B/param), fp32 (or, asked for, bf16) gradient buffers, fp32 main
    parameters (bf16 only) and
    Adam moments (sharded over DP with the distributed optimizer, experts over expert DP) against the storages a real
    CPU training step of the tiny models holds (`held_bytes`), in fp32 and bf16, with and without the distributed
    optimizer. Within 2%: megatron pads every parameter to 64 elements and every bucket to lcm(DP, 128) with the
    distributed optimizer (the plan leaves that out; on a real model it is far below 1%), and each Adam state holds
    a 4-byte step count. A plan that counted bf16 weights at 4 bytes, bf16 gradients, no main copy or unsharded
    moments would be off by 25% or more in some term."""
    hf_dirs = {kind: make_tiny_checkpoint(tmp_path / kind, kind=kind) for kind in ("dense", "moe")}
    runs = run_distributed(_held_rank, 2, hf_dirs, free_port(), init_dist=False)
    for label, kind, ep, precision, distributed, bf16_grads in HELD_CASES:
        hf = read_hf_config(hf_dirs[kind])
        trainer = TrainerConfig(world_size=2, ep=ep, precision=precision, distributed_optimizer=distributed,
                                grad_reduce_in_bf16=bf16_grads)
        planned = trainer_memory(hf, Config(model=ModelConfig(hf_dir=hf_dirs[kind]), trainer=trainer,
                                            rollout=RolloutConfig(dtype="bfloat16")))[0]
        for rank, run in enumerate(runs):
            held = run[label]
            print(f"{label} rank {rank}: held {held}; planned weights {planned.weights}, grads {planned.grads}, "
                  f"main {planned.main_params}, Adam {planned.optimizer}")
            for term in ("weights", "grads", "main_params", "optimizer"):
                want = getattr(planned, term)
                assert abs(held[term] - want) <= 0.02 * want, (label, rank, term, held[term], want)
