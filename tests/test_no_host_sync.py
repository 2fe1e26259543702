"""Nothing inside the trainer's microbatch loop waits on the host: the log-probs, entropy, the registered loss, the
train-inference correction and every metric of each microbatch stay on the model's device, and the step's metrics
are read to the host once, after megatron's schedule (`MegatronPolicy._sum_metrics`).

Held on a CPU by a `TorchDispatchMode` installed around the microbatch loop of real train steps
(`MegatronPolicy.microbatch_loop_context`: megatron's forward/backward schedule over every microbatch, one gloo rank,
tiny dense and MoE Qwen3 checkpoints): it sees every aten op the loop runs, backward included, and records

- device-to-host copies (`aten._to_copy` / `aten.copy_` from a non-CPU tensor to the CPU): on a CPU none can occur,
  on a GPU each waits for the device;
- the ops that force a host sync on CUDA whatever the device: scalar reads (`aten._local_scalar_dense`: `.item()`,
  `float(t)`, `bool(t)`, `.tolist()` of one element), data-dependent shapes (`aten.nonzero`, `aten.masked_select`,
  `aten.index` / `aten.index_put_` with a boolean mask, `aten.unique*`, `aten.bincount`, `aten.repeat_interleave`
  without `output_size`), and `aten.equal` (a bool on the host).

The steps cover count-based, token-budget and packed microbatches, a token-level loss with a token-level correction,
a sequence-level loss with a sequence-level correction, the trainer's own old log-probs (the forward-only loop), and
MoE routing; unpacked microbatches are run without an attention mask (the attention is causal), packed ones with
their block-diagonal mask. The test fails on the code before this change (run once against it, 2026-11-28: 28 syncs,
the mismatch monitor's boolean-mask `aten.index` and `aten.bincount` on every microbatch; its per-microbatch `.cpu()`
of the log-probs cannot show on a CPU, where it is no copy, and shows as `aten._to_copy` on a GPU).

Documented exceptions inside megatron-core 0.16.1 are listed in `MEGATRON_SYNCS`, each with the reason; none is
hidden: an exception matches one op name AND one megatron source file on the op's Python stack.
"""

from __future__ import annotations

import dataclasses
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megarl.config.schema import AlgorithmConfig, Config, CorrectionConfig, ModelConfig, OptimizerConfig, TrainerConfig
from megarl.parallel.groups import TrainerLayout
from tests.dist_utils import free_port, run_distributed
from tests.test_trainer_invariance import PAD, REWARDS, _batch, _responses, checkpoints  # noqa: F401 - a fixture

aten = torch.ops.aten

# ops that wait for the device on CUDA whatever their arguments (their overload packets)
ALWAYS_SYNC = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.bincount, aten.equal,
               aten.unique_dim, aten._unique, aten._unique2, aten.unique_consecutive, aten.unique_dim_consecutive}
# (op name, megatron-core source file on the op's stack, why): syncs of megatron's own code inside the loop
MEGATRON_SYNCS: list[tuple[str, str, str]] = [
    # dropless MoE: how many tokens each expert gets is data, so the permutation that groups tokens by expert has a
    # data-dependent shape (the allgather dispatcher, megarl's on a CPU: `permute`'s masked_select of the routing
    # map, and `dispatch_postprocess`'s of the local probabilities) ...
    ("aten.masked_select", "megatron/core/transformer/moe/moe_utils.py", "dropless MoE: tokens grouped per expert"),
    ("aten.masked_select", "megatron/core/transformer/moe/token_dispatcher.py", "dropless MoE: probs per expert"),
    # ... and the all-to-all dispatcher (megarl's on CUDA) reads the per-expert token counts to the host for the
    # all-to-all's split sizes and the expert GEMMs (`tokens_per_expert ... .cpu()` / `.tolist()`): one sync per MoE
    # layer per microbatch, inherent to dropless routing (a capacity factor with padding would remove it, at the
    # cost of dropped tokens)
    ("aten._to_copy", "megatron/core/transformer/moe/token_dispatcher.py", "dropless MoE: all-to-all split sizes"),
    ("aten._local_scalar_dense", "megatron/core/transformer/moe/token_dispatcher.py",
     "dropless MoE: all-to-all split sizes"),
]


def _is_bool(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


class HostSyncCounter(TorchDispatchMode):
    """Records `(op name, stack)` of every op run under it that forces a device-to-host synchronization."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[tuple[str, list[str]]] = []
        self.ops = 0

    @staticmethod
    def syncs_host(func, args, kwargs) -> bool:
        packet = func.overloadpacket
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        if torch.cuda.is_available() and tensors and all(t.device.type == "cpu" for t in tensors):
            # on a GPU an op on host tensors only (megatron's RNG tracker compares two CPU RNG states with .item()
            # in every `fork`: seen on an H200, 2026-11-28) never waits for the device; on a CPU every op counts
            return False
        if packet in ALWAYS_SYNC:
            return True
        if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
            return any(_is_bool(i) for i in (args[1] if len(args) > 1 else ()))
        if packet == aten.repeat_interleave:
            return isinstance(args[0], torch.Tensor) and kwargs.get("output_size") is None
        if packet == aten._to_copy:
            target = kwargs.get("device")
            return args[0].device.type != "cpu" and target is not None and torch.device(target).type == "cpu"
        if packet == aten.copy_:
            return args[0].device.type == "cpu" and args[1].device.type != "cpu"
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if self.syncs_host(func, args, kwargs):
            stack = [f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]]
            self.syncs.append((str(func), stack))
        return func(*args, **kwargs)


def _documented(name: str, stack: list[str]) -> bool:
    return any(name.startswith(op) and any(source in frame for frame in stack) for op, source, _ in MEGATRON_SYNCS)


# (label, checkpoint kind, algorithm, correction, trainer options, old log-probs)
STEPS = [
    ("grpo+tis_token, 4 microbatches", "dense", "grpo", CorrectionConfig(kind="tis_token", cap=1.5),
     {"micro_batch_size": 2}, "engine"),
    ("gspo+mis_seq, token budget, trainer old log-probs", "dense", "gspo",
     CorrectionConfig(kind="mis_seq", lower=0.6, upper=1.5), {"max_tokens_per_microbatch": 12}, "trainer"),
    ("reinforce+icepop, packed", "dense", "reinforce", CorrectionConfig(kind="icepop", lower=0.6, upper=1.5),
     {"max_tokens_per_microbatch": 12, "pack_sequences": True}, "engine"),
    ("oapl, MoE", "moe", "oapl", CorrectionConfig(), {"micro_batch_size": 4}, "engine"),
]


def _rank(rank, world, port, hf_dirs, responses):
    from megarl.algorithms.registry import get_algorithm
    from megarl.models.layer_backend import bench_layer_spec
    from megarl.models.qwen_provider import read_hf_config
    from megarl.parallel.groups import destroy_trainer_groups, init_trainer_groups
    from megarl.trainer.policy import MegatronPolicy
    from megarl.trainer.step import train_on_batch

    results = {}
    for kind in ("dense", "moe"):
        init_trainer_groups(TrainerLayout(), rank, world, "127.0.0.1", port[kind])
        try:
            hf = read_hf_config(hf_dirs[kind])
            # eager log-prob tiles: torch.compile refuses to run under a dispatch mode (the compiled kernel is
            # what runs on CUDA by default; its tiles are fixed-shape elementwise work, no sync)
            policy = MegatronPolicy(hf_dirs[kind], hf, OptimizerConfig(lr=1e-3), logprob_kernel="eager",
                                    layer_spec=bench_layer_spec(torch.cuda.is_available()))  # a GPU without TE too
            counters: list[HostSyncCounter] = []

            def count(counters: list[HostSyncCounter] = counters) -> HostSyncCounter:
                counters.append(HostSyncCounter())
                return counters[-1]

            policy.microbatch_loop_context = count
            masks: list = []  # the attention mask each microbatch is run with (GPTModel's third argument)
            policy.model.register_forward_pre_hook(
                lambda _module, args, masks=masks: masks.append(None if args[2] is None else
                                                                (tuple(args[2].shape), args[2].dtype)))
            for label, step_kind, name, corr, options, old in STEPS:
                if step_kind != kind:
                    continue
                algorithm = get_algorithm(name)
                algo_cfg = AlgorithmConfig(name=name, correction=corr, old_logprobs=old)
                batch = dataclasses.replace(_batch(responses, [torch.full((len(r),), -2.0) for r in responses]),
                                            advantages=algorithm.advantages(REWARDS, algo_cfg))
                cfg = Config(model=ModelConfig(hf_dir=hf_dirs[kind]), algorithm=algo_cfg,
                             trainer=TrainerConfig(world_size=world, **options))
                counters.clear()
                masks.clear()
                metrics = train_on_batch(policy, batch, algorithm, cfg, PAD, 0, 1, lag=0)
                results[label] = ([(c.ops, c.syncs) for c in counters], metrics, list(masks))
        finally:
            destroy_trainer_groups()
    return results


def test_no_host_sync_inside_the_microbatch_loop(checkpoints):  # noqa: F811 - the imported fixture
    """`checkpoints`: test_trainer_invariance's tiny dense and MoE checkpoints (its module fixture)."""
    (results,) = run_distributed(_rank, 1, {"dense": free_port(), "moe": free_port()}, checkpoints, _responses(),
                                 init_dist=False)
    assert set(results) == {s[0] for s in STEPS}
    failures = []
    for label, (loops, metrics, masks) in results.items():
        # no dense causal mask for a padded row (megatron masks causally itself); a packed row's block-diagonal one
        if "packed" in label:
            assert masks and all(m is not None and m[0][:2] == (1, 1) and m[1] == torch.bool for m in masks), masks
        else:
            assert masks and all(m is None for m in masks), f"{label}: {masks}"
        # one loop per schedule run: the training step's, and the forward-only recompute's before it
        want_loops = 2 if "trainer old" in label else 1
        assert len(loops) == want_loops, f"{label}: {len(loops)} microbatch loops, expected {want_loops}"
        assert all(ops > 1000 for ops, _ in loops), f"{label}: the counter saw too few ops: {loops}"
        for _, syncs in loops:
            for name, stack in syncs:
                if not _documented(name, stack):
                    where = [f for f in stack if "/megarl/" in f or "/megatron/" in f][-3:]
                    failures.append(f"{label}: {name} at " + " <- ".join(reversed(where)))
        # the metrics came back to the host once, as plain numbers
        assert isinstance(metrics["loss"], float) and isinstance(metrics["mismatch/k3_kl"], float)
    assert not failures, f"{len(failures)} host syncs inside the microbatch loop:\n" + "\n".join(failures[:40])
