"""What one trainer rank's GPU memory must hold at its peak, per pipeline stage: a pure model (no process, no weights).

Its inputs are the HF config, the trainer layout and the microbatch token budget; `megarl plan` prints it and
`megarl check --gpu` (`trainer_memory_problem`) refuses a layout whose worst rank does not fit
`trainer.gpu_memory_gb`. The terms (bytes), as megatron-core's DDP and optimizer hold them
(`megarl.trainer.optimizer`), in `trainer.precision` fp32 or bf16 (mixed precision):

- weights: the rank's parameters (`megarl.models.shapes.megatron_local_shapes`) x 4 (fp32) or x 2 (bf16);
- gradients: megatron DDP's contiguous gradient buffers, fp32 (`grad_reduce_in_fp32`), 4 bytes per parameter in
  either precision, or 2 with `trainer.grad_reduce_in_bf16`;
- main parameters (bf16 only): the fp32 copies Adam steps, 4 bytes per parameter (fp32 steps the parameters
  themselves: none);
- optimizer: Adam's `exp_avg` and `exp_avg_sq`, fp32, 8 bytes per parameter;
- with `trainer.distributed_optimizer` the main parameters and the moments are sharded: dense parameters' over the
  data-parallel ranks, expert parameters' over the expert-data-parallel ranks (the weights and gradient buffers are
  whole on every rank; megatron pads each parameter to 64 elements and each bucket to a multiple of lcm(DP, 128),
  which the plan leaves out);
- activations: what autograd keeps per token of a microbatch in each of the stage's layers (`layer_elements`),
  times the microbatches in flight (1F1B: pipeline stage s holds up to pp - s microbatches' activations; without
  pipelining, one), plus the stage's input and, with attention that keeps its scores (the CPU local spec),
  `heads/tp x s^2` per row of b per layer; 4 bytes per element in fp32, 2 in bf16 (megatron's mixed precision keeps
  activations in bf16; its few fp32 tensors, the router's probabilities and softmax statistics, are left out);
- logits (last stage): fused (`megarl.parallel.fused_output_logprobs`, the default): four `chunk x block` fp32
  tile buffers (`block` = `trainer.logprob_vocab_block` rows, default the shard's `V/tp`), the `[V/tp, h]` weight
  gradient it returns (fp32 weights: accumulated in place, no second copy) and dL/dh `[tokens, h]`; unfused: the whole
  `[tokens, V/tp]` fp32 logits and their gradient, plus three chunk buffers; counted in fp32 in either precision
  (both paths compute in fp32; in bf16 an upper bound);
- reserve: `RESERVE_BYTES` for what lives outside torch's tensors (CUDA context, NCCL buffers, allocator
  fragmentation), an allowance rather than a measurement.

The microbatch is the token budget `trainer.max_tokens_per_microbatch`, or, count-based, `micro_batch_size` rows of
the longest possible sequence (`data.max_prompt_tokens` + `rollout.max_new_tokens`): count-based microbatches pad
every row to the batch's longest sequence. The longest sequence (`s`) is at most that length.

Assumptions, each a bound or a stated simplification: routing is balanced over experts (a rank's experts process
top_k routed copies per token of its microbatch, on average); `trainer.recompute='full'` keeps each layer's input
plus one layer's activations, 'selective' drops the attention scores; attention on a GPU is Transformer Engine's flash
attention (no `s x s` scores kept), or with `trainer.layer_spec=local` megatron's local spec (scores and
probabilities kept, as on CPU); the
optimizer's transient buffers and the all-reduce buckets are inside the reserve. The per-token inventory was
checked against a measured CPU run of a tiny model at two token budgets, and the weights, gradient buffers, main
parameters and moments against the tensors a real CPU training step allocates, fp32 and bf16, with and without the
distributed optimizer (tests/test_memory_plan.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megarl.config.schema import Config
from megarl.models.hf_config import num_experts
from megarl.models.layer_backend import planned_layer_spec

GB = 10**9
FP32 = 4
WEIGHT_BYTES = {"fp32": 4, "bf16": 2}  # bytes per parameter (and per activation element) by trainer.precision
RESERVE_BYTES = 3 * GB  # CUDA context + NCCL communicators + caching-allocator fragmentation (an allowance)


@dataclass(frozen=True)
class TrainerRankMemory:
    """One pipeline stage's ranks at their peak (bytes)."""

    stage: int
    params: int
    weights: int
    grads: int  # DDP's fp32 gradient buffers
    main_params: int  # the fp32 copies Adam steps (bf16; 0 in fp32, where Adam steps the parameters themselves)
    optimizer: int  # Adam's two fp32 moments
    activations: int
    logits: int
    reserve: int
    tokens: int  # per microbatch
    in_flight: int  # microbatches whose activations are held at once

    @property
    def total(self) -> int:
        return (self.weights + self.grads + self.main_params + self.optimizer + self.activations + self.logits
                + self.reserve)


def microbatch_tokens(cfg: Config) -> tuple[int, int]:
    """(tokens of the largest microbatch, its longest sequence) for the config's microbatching."""
    longest = (cfg.data.max_prompt_tokens or 0) + cfg.rollout.max_new_tokens
    budget = cfg.trainer.max_tokens_per_microbatch
    if budget is None:
        return cfg.trainer.micro_batch_size * longest, longest
    return max(budget, longest), min(longest, max(budget, longest))  # a longer sequence gets its own microbatch


def layer_elements(hf: dict[str, Any], tp: int, sequence_parallel: bool, moe: bool, expert_tp: int | None = None
                   ) -> float:
    """fp32 elements autograd keeps per token in one decoder layer on one rank, excluding attention scores:
    norm inputs and outputs, q/k/v (and the q/k norms' inputs/outputs, GQA keys/values expanded to the query heads
    as megatron's core attention does), the attention context, the MLP's fc1 output and activation (MoE: per
    routed copy, plus the permuted input and output and the router's logits and probabilities).
    MoE with balanced routing: a stage's tp x dp ranks share its dp x tokens x top_k routed copies; each copy's
    permuted input and output (h each) sit on its expert's `expert_tp` ranks, its fc1 output and activation
    (3 x moe_intermediate_size) are split over them, so per token of a rank's microbatch: top_k x (2h x expert_tp
    / tp + 3 x inter / tp). `expert_tp` None: equal to tp (megatron's default)."""
    h = hf["hidden_size"]
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"])
    d = hf.get("head_dim") or h // heads
    hs = h / tp if sequence_parallel else h  # h-sized tensors are split over TP under sequence parallelism
    q, k = heads * d / tp, kv * d / tp
    attn = 2 * hs + (q + 2 * k) + (2 * (q + k) if hf.get("model_type") != "qwen2" else 0) + 3 * q + q
    mlp_norm = 2 * hs
    if moe:
        # a partial config (no routing fields) counts one expert of the dense MLP's size per token
        top_k = hf.get("num_experts_per_tok", 1)
        inter = hf.get("moe_intermediate_size") or hf.get("intermediate_size") or 4 * h
        experts = num_experts(hf)
        etp = tp if expert_tp is None else expert_tp
        mlp = 3 * experts / tp + top_k * (2 * h * etp / tp + 3 * inter / tp)
    else:
        mlp = 3 * (hf.get("intermediate_size") or 4 * h) / tp  # 4h when a partial config has none
    return attn + mlp_norm + mlp


def logits_bytes(hf: dict[str, Any], tokens: int, tp: int, fused: bool, chunk: int, block: int | None = None) -> int:
    """The last stage's log-prob memory beyond the layers (see the module docstring); `block`: the fused path's
    vocabulary rows per tile (None: the shard)."""
    from megarl.models.hf_config import padded_vocab_size

    vt, h = padded_vocab_size(hf, tp) // tp, hf["hidden_size"]
    chunk = min(chunk, tokens)
    if fused:
        return FP32 * (4 * chunk * min(block or vt, vt) + vt * h + tokens * h)
    return FP32 * (2 * tokens * vt + 3 * chunk * vt)


def activation_bytes(
    hf: dict[str, Any], tokens: int, longest: int, layers: int, tp: int, flash: bool, recompute: str = "none",
    expert_tp: int | None = None, precision: str = "fp32", recompute_layers: int | None = None,
) -> int:
    """One microbatch's activations in `layers` decoder layers of one rank: `tokens` tokens in rows of `longest`,
    `WEIGHT_BYTES[precision]` bytes per element."""
    moe = num_experts(hf) > 0
    sp = moe and tp > 1
    per_token = layer_elements(hf, tp, sp, moe, expert_tp)
    scores = 0.0 if flash or recompute == "selective" else 2 * hf["num_attention_heads"] / tp * longest
    h = hf["hidden_size"] / (tp if sp else 1)
    size = WEIGHT_BYTES[precision]
    if recompute == "full":  # recomputed layers keep their input; one layer's activations rebuilt at a time
        rerun = layers if recompute_layers is None else min(recompute_layers, layers)
        kept = layers - rerun  # trainer.recompute_layers: the stage's other layers keep everything
        return int(size * tokens * (rerun * h + kept * (per_token + scores) + per_token + scores + 2 * h))
    return int(size * tokens * (layers * (per_token + scores) + 2 * h))


def grad_bytes(t: Any) -> int:
    """Bytes per element of megatron DDP's gradient buffers: fp32, or bf16 with `trainer.grad_reduce_in_bf16`."""
    return 2 if t.grad_reduce_in_bf16 else FP32


def stage_activation_bytes(hf: dict[str, Any], t: Any, tokens: int, longest: int, flash: bool, recompute: str,
                           recompute_layers: int | None) -> int:
    """One microbatch's activations on a rank of trainer layout `t` (a stage's layers), under `recompute`."""
    return activation_bytes(hf, tokens, longest, hf["num_hidden_layers"] // t.pp, t.tp, flash, recompute, t.expert_tp,
                            t.precision, recompute_layers)


def optimizer_shard(params: int, expert: int, t: Any) -> float:
    """Parameters whose main copy and Adam moments one rank holds: all of its `params`, or with
    `trainer.distributed_optimizer` the dense ones' 1/DP share and the `expert` ones' 1/expert-DP share."""
    if not t.distributed_optimizer:
        return params
    dp = t.world_size // (t.tp * t.pp)
    expert_dp = t.world_size // (t.expert_tp * t.ep * t.pp)
    return (params - expert) / dp + expert / expert_dp


def trainer_memory(hf: dict[str, Any], cfg: Config, flash: bool | None = None, fused: bool = True
                   ) -> list[TrainerRankMemory]:
    """By pipeline stage: what each of its ranks holds at its peak. `flash`: attention keeps no scores (None: as the
    GPU job's layer spec does, Transformer Engine's flash attention unless `trainer.layer_spec=local`)."""
    from megarl.models.shapes import megatron_local_shapes

    t = cfg.trainer
    if flash is None:
        flash = planned_layer_spec(t.layer_spec) == "te"
    tokens, longest = microbatch_tokens(cfg)
    out = []
    for stage in range(t.pp):
        shapes = megatron_local_shapes(hf, t.tp, t.pp, t.ep, stage, t.expert_tp)
        params = sum(map(math.prod, shapes.values()))
        expert = sum(math.prod(v) for k, v in shapes.items() if ".local_experts." in k)
        shard = optimizer_shard(params, expert, t)
        in_flight = t.pp - stage if t.pp > 1 else 1
        last = stage == t.pp - 1
        out.append(
            TrainerRankMemory(
                stage=stage,
                params=params,
                weights=WEIGHT_BYTES[t.precision] * params,
                grads=grad_bytes(t) * params,
                main_params=int(FP32 * shard) if t.precision == "bf16" else 0,
                optimizer=int(2 * FP32 * shard),
                activations=in_flight * stage_activation_bytes(hf, t, tokens, longest, flash, t.recompute,
                                                               t.recompute_layers),
                logits=logits_bytes(hf, tokens, t.tp, fused, t.logprob_chunk_tokens, t.logprob_vocab_block)
                if last else 0,
                reserve=RESERVE_BYTES,
                tokens=tokens,
                in_flight=in_flight,
            )
        )
    return out


def _gb(n: int) -> str:
    return f"{n / GB:.1f} GB"


def format_trainer_memory(hf: dict[str, Any], cfg: Config) -> list[str]:
    """The `megarl plan` section: per stage, the terms and the total against `trainer.gpu_memory_gb`."""
    t = cfg.trainer
    rows = trainer_memory(hf, cfg)
    unfused = trainer_memory(hf, cfg, fused=False)[-1]
    tokens, longest = microbatch_tokens(cfg)
    how = (
        f"trainer.max_tokens_per_microbatch={t.max_tokens_per_microbatch}"
        if t.max_tokens_per_microbatch
        else f"count-based: micro_batch_size {t.micro_batch_size} x {longest} tokens (rows padded to the longest)"
    )
    grads = "bf16" if t.grad_reduce_in_bf16 else "fp32"
    weights = (f"bf16 weights and activations, {grads} gradient buffers, fp32 main parameters and Adam moments"
               if t.precision == "bf16" else "fp32 weights, gradient buffers, Adam moments and activations")
    shard = " (main and Adam sharded over data parallel)" if t.distributed_optimizer else ""
    attention = ("flash attention (Transformer Engine)" if planned_layer_spec(t.layer_spec) == "te"
                 else "unfused attention keeping its scores (trainer.layer_spec=local)")
    lines = [
        "",
        f"trainer memory per rank at its peak (trainer.precision={t.precision}: {weights}{shard}; "
        f"megarl.trainer.memory_plan): microbatch of {tokens:,} tokens ({how}), {attention}, fused output log-prob",
        f"  {'stage':>5} {'weights':>9} {'grads':>9} {'main':>9} {'Adam':>9} {'activations':>12} {'mb held':>7} "
        f"{'logits':>8} {'reserve':>8} {'total':>9}",
    ]
    for m in rows:
        lines.append(
            f"  {m.stage:>5} {_gb(m.weights):>9} {_gb(m.grads):>9} {_gb(m.main_params):>9} {_gb(m.optimizer):>9} "
            f"{_gb(m.activations):>12} {m.in_flight:>7} {_gb(m.logits):>8} {_gb(m.reserve):>8} "
            f"{_gb(m.total):>9}"
        )
    worst = max(rows, key=lambda m: m.total)
    budget = t.gpu_memory_gb * GB
    verdict = "fits" if worst.total <= budget else "DOES NOT FIT"
    lines.append(
        f"  worst rank {_gb(worst.total)} vs trainer.gpu_memory_gb={t.gpu_memory_gb:g}: {verdict}; "
        f"unfused logits on the last stage would take {_gb(unfused.logits)} instead of "
        f"{_gb(rows[-1].logits)}"
    )
    return lines


def trainer_memory_problem(hf: dict[str, Any], cfg: Config) -> str | None:
    """Why the worst trainer rank cannot fit its GPU, naming the fields and the fixes; None when it fits."""
    t = cfg.trainer
    rows = trainer_memory(hf, cfg)
    worst = max(rows, key=lambda m: m.total)
    budget = t.gpu_memory_gb * GB
    if worst.total <= budget:
        return None
    fixed = worst.total - worst.activations - worst.logits
    per_token = (worst.activations + worst.logits) / worst.tokens
    fits = int((budget - fixed) / per_token) if budget > fixed else 0
    fixes = []
    if fits > 0:
        fixes.append(
            f"set trainer.max_tokens_per_microbatch to at most ~{fits:,} (now {worst.tokens:,} tokens per microbatch)"
        )
    if t.precision == "fp32":
        fixes.append("set trainer.precision=bf16 (bf16 weights and activations; fp32 main parameters)")
    if not t.distributed_optimizer:
        fixes.append("set trainer.distributed_optimizer=true (Adam moments and main parameters split over "
                     "data-parallel ranks)")
    fixes.append("raise trainer.tp / trainer.pp / trainer.ep / trainer.expert_tp (fewer parameters per rank)")
    if t.recompute == "none":
        fixes.append("set trainer.recompute=full (activations recomputed in backward)")
    return (
        f"trainer: pipeline stage {worst.stage}'s ranks need about {_gb(worst.total)} at their peak "
        f"(trainer.precision={t.precision}: weights {_gb(worst.weights)}, grad buffers {_gb(worst.grads)}, main "
        f"parameters {_gb(worst.main_params)}, Adam {_gb(worst.optimizer)}, activations "
        f"{_gb(worst.activations)} for {worst.in_flight} microbatch(es) of {worst.tokens:,} tokens, logits "
        f"{_gb(worst.logits)}, reserve {_gb(worst.reserve)}; `megarl plan` shows the terms), more than "
        f"trainer.gpu_memory_gb={t.gpu_memory_gb:g}: " + ", or ".join(fixes)
    )
