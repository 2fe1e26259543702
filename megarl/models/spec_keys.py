"""Loading a distributed checkpoint saved on one megatron-core layer spec into a model built on the other.

megarl builds Transformer Engine's layer spec on GPUs and megatron's local spec on CPUs
(`megarl.models.layer_backend`), and `megarl export` always builds the local spec. The sharded state dict names
(the keys `dist_checkpointing` saves and looks up) agree between the two specs except for one norm
(megatron-core 0.16.1, `megatron/core/models/gpt/gpt_layer_specs.py`):

- the local spec maps the pre-MLP norm to `mlp.linear_fc1.layer_norm_` for every layer, MoE layers included
  (`sharded_state_dict_keys_map`, lines 417-420, applied by `TransformerLayer.sharded_state_dict`,
  `megatron/core/transformer/transformer_layer.py:837-858`);
- Transformer Engine's spec fuses that norm into `mlp.linear_fc1` (`TELayerNormColumnParallelLinear`:
  `mlp.linear_fc1.layer_norm_weight`) for dense layers only; a MoE layer keeps a separate
  `pre_mlp_layernorm=backend.layer_norm()` (`TENorm`, line 291) and its key map (lines 294-301) has no entry for
  it, so a MoE checkpoint saved on TE's spec holds `decoder.layers.pre_mlp_layernorm.weight` where the local spec
  asks for `decoder.layers.mlp.linear_fc1.layer_norm_weight`. The distributed optimizer's `fully_reshardable`
  state keys (`optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`) follow the model keys.

The names that agree, checked: the input norm (TE: `self_attention.linear_qkv.layer_norm_weight`, fused in
`linear_qkv`; local: `input_layernorm.` mapped there, line 418), the q/k norms (`self_attention.q_layernorm.weight`
on both, lines 282-287 and 405-410), the experts (TE's grouped `TEGroupedMLP` writes the keys of the local spec's
`SequentialMLP`, `experts.linear_fc{1,2}.weight` with a global-expert axis:
`megatron/core/transformer/moe/experts.py:768-806` and `:935-976`), the router, the embedding, the final norm and
the output layer. MoE models with dense layers are refused (`megarl.models.qwen_provider`), so within one checkpoint
the pre-MLP norm has one name. Transformer Engine's norms (`TENorm`: the MoE pre-MLP norm, the q/k norms,
`extensions/transformer_engine_spec_provider.py:48-55`, and the final norm, `transformer/transformer_block.py:61`)
carry an `_extra_state` that megatron saves as a `ShardedObject`; the local spec's torch norms have none.

`load_across_specs` is megatron's `dist_checkpointing.load`, after renaming each requested key that the checkpoint
does not hold to its other spec's name when the checkpoint holds that one (read from the checkpoint's own metadata,
`dist_checkpointing.serialization.load_sharded_metadata`). A requested `_extra_state` object the checkpoint does not
hold (a `TENorm`'s, when the checkpoint was saved on the local spec) keeps the module's own value. Both load paths use
it: a resume (`megarl.checkpoint.Checkpoint.load_sharded`) and `megarl export` (`megarl.models.hf_export`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# (local spec name, Transformer Engine spec name) of one tensor, as the end of a sharded key (module docstring)
SPEC_KEY_ALIASES: tuple[tuple[str, str], ...] = (
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
)
EXTRA_STATE = "._extra_state"


def other_spec_key(key: str) -> str | None:
    """`key` as the other layer spec names it (a model key, or an optimizer state key ending in one); None when
    both specs name it alike."""
    for local, te in SPEC_KEY_ALIASES:
        for mine, theirs in ((local, te), (te, local)):
            if key.endswith("." + mine):
                return key.removesuffix(mine) + theirs
    return None


def checkpoint_keys(directory: str | Path) -> set[str]:
    """The sharded keys (tensors and objects) distributed checkpoint `directory` holds, from its metadata."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    return {entry.key for entry in load_sharded_metadata(str(directory)).values()}


def align_to_checkpoint(sharded_state: dict[str, Any], held: set[str]) -> dict[str, Any]:
    """Rename, in place, each sharded entry of `sharded_state` whose key is not in `held` (the checkpoint's keys)
    to the other spec's name when that one is held; take the `_extra_state` objects not held out of
    `sharded_state`'s dicts and return them (same nesting) as the modules' own values, to merge into the loaded
    state."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    for entry in nested_values(sharded_state):
        key = getattr(entry, "key", None)
        if not isinstance(key, str) or key in held:
            continue
        other = other_spec_key(key)
        if other is not None and other in held:
            entry.key = other
    return _take_unheld_extra_states(sharded_state, held)


def _take_unheld_extra_states(state: dict[str, Any], held: set[str]) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    taken: dict[str, Any] = {}
    for name, value in list(state.items()):
        if isinstance(value, dict):
            if sub := _take_unheld_extra_states(value, held):
                taken[name] = sub
        elif isinstance(value, ShardedObject) and value.key.endswith(EXTRA_STATE) and value.key not in held:
            taken[name] = state.pop(name).data
    return taken


def load_across_specs(sharded_state: dict[str, Any], directory: str | Path) -> dict[str, Any]:
    """Collective: megatron's `dist_checkpointing.load` of `sharded_state` from `directory`, whichever layer spec
    saved it (module docstring)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import merge

    own = align_to_checkpoint(sharded_state, checkpoint_keys(directory))
    return merge(dist_checkpointing.load(sharded_state, str(directory)), own)
