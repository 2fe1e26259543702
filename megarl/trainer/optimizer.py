"""The policy's optimizer with its state sharded over data-parallel replicas (ZeRO-1, `trainer.distributed_optimizer`).

AdamW keeps two fp32-sized tensors per parameter (`exp_avg`, `exp_avg_sq`) plus a step counter: twice the
model's bytes on every rank when every data-parallel replica holds all of it. Here each replica keeps the
state of only its share of the parameters, through torch's `ZeroRedundancyOptimizer` (tested with torch
2.13, gloo on CPU; it only calls `broadcast`, so NCCL works the same way):

- dense parameters are shared out over the data-parallel group, expert parameters (megatron's
  `allreduce=False`) over the expert-data-parallel group: the same groups over which `MegatronPolicy`
  sums their gradients, i.e. the ranks that hold identical copies of them;
- gradients are still all-reduced by the policy (so the global grad-norm clipping is unchanged), each rank
  runs AdamW on the parameters it owns, and the owners then broadcast the updated parameters. The update is
  the same element-wise AdamW as the unsharded optimizer, so the parameters are bitwise the same;
- whole parameters are assigned to ranks (largest first, to the least-loaded rank), so a rank holds about
  1/DP of the state, not exactly.

megatron-core's own `DistributedOptimizer` (flat, element-even shards, reduce-scatter of gradients) was not
used: it needs megatron's `DistributedDataParallel` gradient buffers and `finalize_model_grads` in place of the
policy's gradient reduction and clipping, and megatron's dist-checkpointing for its state.

Checkpoints: `state_dict()` returns THIS rank's shard only (each trainer rank writes its own file), tagged so
that loading it into an unsharded optimizer, or a shard made for other parameters, fails with a clear message.
Resume therefore needs the same trainer layout and the same `trainer.distributed_optimizer`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

SHARDED_FORMAT = "megarl-zero1-shard-v1"


def adamw_param_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Decoupled weight decay on matrices only (norm weights and biases are not decayed); empty groups dropped."""
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class ShardedAdamW:
    """AdamW whose state is sharded over the ranks that hold the same parameters (see the module docstring).
    Offers what `MegatronPolicy` uses of a torch optimizer: `param_groups` (to set the learning rate),
    `zero_grad`, `step`, `state` (parameter -> AdamW state, for this rank's parameters only) and the
    per-rank `state_dict` / `load_state_dict`."""

    def __init__(self, params: list[torch.nn.Parameter], is_expert: Callable[[torch.nn.Parameter], bool],
                 dp_group: dist.ProcessGroup, expert_dp_group: dist.ProcessGroup, *, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float):
        split = {"dense": ([p for p in params if not is_expert(p)], dp_group),
                 "expert": ([p for p in params if is_expert(p)], expert_dp_group)}
        self.shards: dict[str, ZeroRedundancyOptimizer] = {
            name: ZeroRedundancyOptimizer(adamw_param_groups(ps, weight_decay), optimizer_class=torch.optim.AdamW,
                                          process_group=group, lr=lr, betas=betas, eps=eps)
            for name, (ps, group) in split.items() if ps
        }

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every group of every shard optimizer (the dicts themselves: setting `lr` here reaches the next step)."""
        return [g for zero in self.shards.values() for g in zero.param_groups]

    @property
    def state(self) -> dict[torch.nn.Parameter, dict[str, Any]]:
        """AdamW state of the parameters this rank owns."""
        return {p: s for zero in self.shards.values() for p, s in zero.optim.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for zero in self.shards.values():
            zero.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """AdamW on this rank's parameters, then every owner broadcasts its updated parameters to its group."""
        for zero in self.shards.values():
            zero.step()

    def _owned_shapes(self, name: str) -> list[list[int]]:
        return [list(p.shape) for g in self.shards[name].optim.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: the local AdamW state of each shard optimizer and the shapes it covers."""
        return {"format": SHARDED_FORMAT,
                "shards": {name: {"optim": zero.optim.state_dict(), "shapes": self._owned_shapes(name)}
                           for name, zero in self.shards.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_optimizer_state(state, sharded=True)
        if set(state["shards"]) != set(self.shards):
            raise ValueError(f"optimizer shard holds {sorted(state['shards'])}, this model needs {sorted(self.shards)}")
        for name, zero in self.shards.items():
            saved = state["shards"][name]
            if saved["shapes"] != self._owned_shapes(name):
                raise ValueError(
                    f"the {name} optimizer shard was written for other parameters than this rank owns: resume with "
                    "the trainer layout (world_size, tp, pp, ep) of the run that saved it"
                )
            zero.optim.load_state_dict(saved["optim"])


def check_optimizer_state(state: dict[str, Any], sharded: bool) -> None:
    """Refuse an optimizer state saved with the other `trainer.distributed_optimizer` setting."""
    if (state.get("format") == SHARDED_FORMAT) != sharded:
        saved = "a per-rank shard (trainer.distributed_optimizer=true)" if not sharded else \
            "a full optimizer state (trainer.distributed_optimizer=false)"
        raise ValueError(f"the checkpoint's optimizer state is {saved}: resume with the same "
                         "trainer.distributed_optimizer setting as the run that saved it")
