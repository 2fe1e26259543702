"""A STAND-IN for Transformer Engine 2.9's `FusedAdam`, for tests on machines without TE (no CUDA here): it
reproduces the optimizer's *state contract*, not its CUDA kernels. Written from a reading of TE at tag `v2.9`
(commit 70f536662ae10a62a54f4ed1ba92e3314c5cfd69), `transformer_engine/pytorch/optimizers/fused_adam.py`; no TE
code is copied. What it holds to, with the lines read:

- the constructor's arguments (`:109-128`): the five positional ones (`params, lr, betas, eps, weight_decay`) then
  `amsgrad`, and keyword-only `bias_correction, adam_w_mode, capturable, master_weights, master_weight_dtype,
  exp_avg_dtype, exp_avg_sq_dtype, use_decoupled_grad, store_param_remainders, set_grad_none`; `amsgrad=True` is
  refused (`:130-131`). megatron-core 0.16.1 passes `params, lr, weight_decay, betas, eps` and `adam_w_mode`
  (`megatron/core/optimizer/__init__.py:349-363`), plus the dtype / master-weight keywords only with its
  precision-aware optimizer (`:365-387`), which megarl does not use and this stand-in refuses (non-fp32 states).
- the param groups' defaults (`:157-164`): `lr, bias_correction, betas, eps, weight_decay`.
- `name_to_dtype_map` (`:191-195`): exactly `exp_avg`, `exp_avg_sq`, `master_param`, the only per-parameter state
  names TE knows. `get_unscaled_state` (`:294-325`), `set_scaled_state` (`:327-359`) and `_initialize_state`
  (`:361-399`) look every name up there, so any other key raises KeyError.
- `initialize_state(param, store_param_remainders)` (`:401-418`): zero `exp_avg` / `exp_avg_sq` (and the master copy
  with `master_weights`); both arguments positional, no default for the second.
- `state_dict()` (`:420-442`): torch's, with each parameter's state re-read through `get_unscaled_state` key by key:
  a per-parameter `step` (as torch's AdamW keeps) raises `KeyError: 'step'`.
- `load_state_dict()` (`:444-473`): torch's, then each parameter's state cleared and every non-None entry set again
  through `set_scaled_state` as fp32 (a `step` key raises KeyError there too).
- `step(closure=None, grad_scaler=None)` (`:475-754`): the step count lives in the PARAM GROUP, `group["step"]`, a
  Python int set to 1 on the first step and incremented after (`:495-504`; not per parameter); a parameter without
  state gets `initialize_state` (`:542-544`); a parameter without gradient is skipped (`:551-552`). The update is
  the one TE's kernel computes (`transformer_engine/common/multi_tensor/adam.cu:125-141`, bias corrections
  `1 - beta**step`, `:395-396`): AdamW mode adds `weight_decay * p` to the bias-corrected update, L2 mode adds it to
  the gradient. Here in plain torch ops, fp32 parameters only (megatron steps fp32 main parameters or shards).

`install_in_megatron()` makes megatron-core 0.16.1 build and drive this stand-in exactly as it builds TE's
`FusedAdam` when TE imports: it rebinds the names that megatron's import-time `try: from
transformer_engine.pytorch.optimizers import FusedAdam as Adam` binds, in the two modules that do so
(`megatron/core/optimizer/__init__.py:12-16`: `Adam`, `USING_PYTORCH_OPTIMIZER = False`;
`megatron/core/optimizer/distrib_optimizer.py:21-27`: `Adam`, `HAVE_APEX_OR_TE = True`,
`USING_TE_OPTIMIZER = True`, `USING_APEX_OPTIMIZER = False`). TE's multi-tensor kernels that megatron also imports
from TE (`multi_tensor_applier`, `multi_tensor_scale`, `multi_tensor_l2norm` in `optimizer.py:16-36` and
`clip_grads.py:10-41`) are not replaced: they compute the same values as megatron's local fallbacks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from copy import deepcopy
from itertools import chain
from typing import Any

import torch

TE_TAG = "v2.9"
TE_COMMIT = "70f536662ae10a62a54f4ed1ba92e3314c5cfd69"
TE_FILE = "transformer_engine/pytorch/optimizers/fused_adam.py"


class FusedAdamStandIn(torch.optim.Optimizer):
    """TE 2.9 `FusedAdam`'s state contract (module docstring) in plain torch; fp32 states and parameters only."""

    def __init__(self, params: Iterable[torch.nn.Parameter | dict], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, *, bias_correction: bool = True, adam_w_mode: bool = True,
                 capturable: bool = False, master_weights: bool = False,
                 master_weight_dtype: torch.dtype = torch.float32, exp_avg_dtype: torch.dtype = torch.float32,
                 exp_avg_sq_dtype: torch.dtype = torch.float32, use_decoupled_grad: bool = False,
                 store_param_remainders: bool = False, set_grad_none: bool | None = None) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if capturable or master_weights or use_decoupled_grad or store_param_remainders:
            raise NotImplementedError("the TE stand-in covers the non-capturable, fp32-state FusedAdam only")
        if {master_weight_dtype, exp_avg_dtype, exp_avg_sq_dtype} != {torch.float32}:
            raise NotImplementedError("the TE stand-in keeps fp32 optimizer states only (no scaled states)")
        super().__init__(params, {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = capturable
        self.master_weights = master_weights
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        # the per-parameter state names TE knows (fused_adam.py:191-195): anything else is a KeyError
        self.name_to_dtype_map: dict[str, torch.dtype] = {
            "exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype, "master_param": master_weight_dtype}
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = store_param_remainders
        self.set_grad_none = set_grad_none

    # ---- state, by name (fused_adam.py:294-418) --------------------------------------------------------------
    def _initialize_state(self, param: torch.Tensor, state_name: str, zero_buffer: bool,
                          store_param_remainders: bool = False) -> None:
        dtype = self.name_to_dtype_map[state_name]
        data = torch.empty_like(param, dtype=dtype)
        if zero_buffer:
            data.zero_()
        self.state[param][state_name] = data

    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool) -> None:
        """Zero moments for `param` (TE 2.9's signature: `store_param_remainders` has no default)."""
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)

    def get_unscaled_state(self, param: torch.Tensor, state_name: str) -> torch.Tensor:
        """The fp32 value of one named state (KeyError for a name TE does not know, e.g. 'step')."""
        dtype = self.name_to_dtype_map[state_name]
        tensor = self.state[param][state_name]
        assert dtype == torch.float32 and tensor.dtype == torch.float32, (state_name, tensor.dtype)
        return tensor

    def set_scaled_state(self, param: torch.Tensor, state_name: str, unscaled_state: torch.Tensor) -> None:
        """Store an fp32 value as one named state, creating it if absent (KeyError for an unknown name)."""
        assert unscaled_state.dtype == torch.float32, unscaled_state.dtype
        if state_name not in self.state[param]:
            self._initialize_state(param, state_name, False)
        self.state[param][state_name].copy_(unscaled_state)

    # ---- checkpoints (fused_adam.py:420-473) -----------------------------------------------------------------
    def _saved_to_live(self, saved_groups: list[dict[str, Any]]) -> dict[int, torch.Tensor]:
        return dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                        chain.from_iterable(g["params"] for g in self.param_groups), strict=True))

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict with every per-parameter entry re-read by name: KeyError on a name TE lacks."""
        state_dict = super().state_dict()
        live = self._saved_to_live(deepcopy(state_dict["param_groups"]))
        for index, entries in state_dict["state"].items():
            if index in live:
                state_dict["state"][index] = {name: self.get_unscaled_state(live[index], name) for name in entries}
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then every parameter's named states set again as fp32 (KeyError on an unknown name)."""
        super().load_state_dict(state_dict)
        live = self._saved_to_live(deepcopy(state_dict["param_groups"]))
        for index, entries in state_dict["state"].items():
            if index in live:
                param = live[index]
                self.state[param] = {}
                for name, value in entries.items():
                    if value is not None:
                        self.set_scaled_state(param, name, value.float())

    # ---- the step (fused_adam.py:475-754; the update of common/multi_tensor/adam.cu:125-141) -----------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, grad_scaler: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if not group["params"]:
                continue  # TE leaves an empty group's step alone
            group["step"] = group["step"] + 1 if "step" in group else 1  # one count per GROUP, a Python int
            beta1, beta2 = group["betas"]
            lr, eps, decay, t = group["lr"], group["eps"], group["weight_decay"], group["step"]
            c1, c2 = (1 - beta1**t, 1 - beta2**t) if group["bias_correction"] else (1.0, 1.0)
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    self.initialize_state(p, False)
                if p.grad is None:
                    continue
                if p.dtype != torch.float32:
                    raise NotImplementedError("the TE stand-in steps fp32 parameters only")
                g, m, v = p.grad, state["exp_avg"], state["exp_avg_sq"]
                if not self.adam_w_mode:
                    g = g + decay * p
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / c1) / ((v / c2).sqrt() + eps)
                if self.adam_w_mode:
                    update = update + decay * p
                p.sub_(lr * update)
        return loss


FusedAdam = FusedAdamStandIn  # the name `transformer_engine.pytorch.optimizers` exports (its __init__.py:16 at v2.9)

# The names megatron-core 0.16.1 binds from its import-time TE try/except, and their values when TE imports.
MEGATRON_TE_BINDINGS: dict[str, dict[str, Any]] = {
    "megatron.core.optimizer": {"Adam": FusedAdamStandIn, "USING_PYTORCH_OPTIMIZER": False},
    "megatron.core.optimizer.distrib_optimizer": {"Adam": FusedAdamStandIn, "HAVE_APEX_OR_TE": True,
                                                  "USING_TE_OPTIMIZER": True, "USING_APEX_OPTIMIZER": False},
}


def install_in_megatron() -> Callable[[], None]:
    """Rebind megatron's import-time TE names to the stand-in (module docstring), as they read when TE imports;
    returns the function that puts the previous values back. For a test process of its own (a trainer rank)."""
    import importlib

    before: list[tuple[Any, str, Any]] = []
    for module_name, names in MEGATRON_TE_BINDINGS.items():
        module = importlib.import_module(module_name)
        for name, value in names.items():
            before.append((module, name, getattr(module, name)))
            setattr(module, name, value)

    def restore() -> None:
        for module, name, value in before:
            setattr(module, name, value)

    return restore
