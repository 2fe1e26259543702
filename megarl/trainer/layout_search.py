"""The least activation recompute that fits, and the trainer layout that needs the least of it: a search over the
memory plan (`megarl.trainer.memory_plan`), no process, no weights.

Recompute costs compute: 'full' reruns every layer's forward in backward (about a third more step compute), or
with `trainer.recompute_layers` = k only the first k layers of each stage (megatron's block method: k / layers of
that cost); 'selective' reruns only the core attention (megatron's `recompute_modules=["core_attn"]`; with flash
attention it saves nothing and is not proposed). So, for a given layout, the plan's answer is the first of none,
selective, full over the fewest layers k, full over every layer, whose worst rank fits `trainer.gpu_memory_gb`.

Across layouts of the same `trainer.world_size` the search prefers, in order: no pipeline (`pp` 1: no 1F1B bubble,
which at the recipes' ~10 microbatches per step costs ~(pp-1)/10 of the step, and no last stage that also carries the
log-prob head), then fewer stages; the least recompute (by the share of layers whose forward runs twice: a rerun
layer adds about a third of its step compute, so a few layers cost less than a bubble); less tensor
parallel (`tp`: an all-reduce per layer); fewer expert ranks (`ep`: a smaller all-to-all), keeping `expert_tp` 1.
Each candidate must pass the layout checks a config passes (`megarl.checks.check_against_model`'s rules on heads,
layers and experts; here restated as divisibility, since no config is built per candidate). MoE at `tp > 1` needs
sequence parallel, which only Transformer Engine's spec does: such layouts are never trained by the CPU suite, so
`best_layouts(..., suite_trains=True)` leaves them out, and `megarl plan` lists them apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megarl.config.schema import Config
from megarl.models.hf_config import num_experts
from megarl.models.layer_backend import planned_layer_spec
from megarl.trainer.memory_plan import GB, microbatch_tokens, stage_activation_bytes, trainer_memory

RECOMPUTE_ORDER = ("none", "selective", "full")
# a candidate fits when its worst rank's plan is within this share of trainer.gpu_memory_gb: the plan's terms are
# estimates (an allowance for the CUDA context and fragmentation, balanced routing), so the search keeps a margin
HEADROOM = 0.9
NODE_GPUS = 8  # experts' all-to-all stays inside one node: ep <= 8 (NVLink), as the anchors' 30B-A3B recipes


@dataclass(frozen=True)
class LayoutFit:
    tp: int
    pp: int
    ep: int
    recompute: str
    worst_bytes: int  # the worst rank's planned peak
    recompute_layers: int | None = None  # with recompute "full": the first this many layers of each stage
    stage_layers: int = 1  # layers per pipeline stage

    @property
    def rerun_share(self) -> float:
        """Share of the stage's layers whose forward runs twice (selective: counted as a small share, 0.1)."""
        if self.recompute == "full":
            return (self.recompute_layers or self.stage_layers) / self.stage_layers
        return 0.1 if self.recompute == "selective" else 0.0

    def describe(self) -> str:
        how = self.recompute
        if self.recompute == "full":
            how = (f"full, recompute_layers={self.recompute_layers} of {self.stage_layers}"
                   if self.recompute_layers is not None else f"full (all {self.stage_layers} layers)")
        return f"tp {self.tp} x pp {self.pp} x ep {self.ep}, recompute {how}: {self.worst_bytes / GB:.1f} GB"


def _worst(hf: dict[str, Any], cfg: Config, **trainer: Any) -> int:
    """The worst rank's planned peak with `trainer` fields changed (the plan itself: the reference `_Layout` keeps)."""
    t = cfg.trainer.model_copy(update=trainer)
    return max(m.total for m in trainer_memory(hf, cfg.model_copy(update={"trainer": t})))


class _Layout:
    """One layout's plan, made once (the parameter shapes per stage are the costly part), and its worst rank under
    any recompute: only the activations change with it (`memory_plan.stage_activation_bytes`)."""

    def __init__(self, hf: dict[str, Any], cfg: Config, **layout: Any) -> None:
        self.hf, self.t = hf, cfg.trainer.model_copy(update={**layout, "recompute": "none", "recompute_layers": None})
        self.cfg = cfg.model_copy(update={"trainer": self.t})
        self.rows = trainer_memory(hf, self.cfg)
        self.tokens, self.longest = microbatch_tokens(self.cfg)
        self.flash = planned_layer_spec(self.t.layer_spec) == "te"

    def worst(self, recompute: str, recompute_layers: int | None = None) -> int:
        act = stage_activation_bytes(self.hf, self.t, self.tokens, self.longest, self.flash, recompute,
                                     recompute_layers)
        return max(m.total - m.activations + m.in_flight * act for m in self.rows)


def useful_recomputes(cfg: Config) -> tuple[str, ...]:
    """'selective' drops only the attention scores, which flash attention never keeps: not offered under TE."""
    flash = planned_layer_spec(cfg.trainer.layer_spec) == "te"
    return tuple(r for r in RECOMPUTE_ORDER if not (flash and r == "selective"))


def _least_on(hf: dict[str, Any], cfg: Config, tp: int, pp: int, ep: int, expert_tp: int) -> LayoutFit | None:
    """The least recompute that fits layout (tp, pp, ep, expert_tp): none, selective, full over the fewest first
    layers of each stage, full; None if even full does not fit."""
    budget, stage_layers = HEADROOM * cfg.trainer.gpu_memory_gb * GB, hf["num_hidden_layers"] // pp
    plan = _Layout(hf, cfg, tp=tp, pp=pp, ep=ep, expert_tp=expert_tp)
    for recompute in (r for r in useful_recomputes(cfg) if r != "full"):
        if (worst := plan.worst(recompute)) <= budget:
            return LayoutFit(tp, pp, ep, recompute, worst, None, stage_layers)
    for k in range(1, stage_layers + 1):  # memory falls as k grows: the first k that fits is the fewest
        if (worst := plan.worst("full", k)) <= budget:
            return LayoutFit(tp, pp, ep, "full", worst, None if k == stage_layers else k, stage_layers)
    return None


def least_recompute(hf: dict[str, Any], cfg: Config) -> LayoutFit | None:
    """On the config's own layout: the least recompute whose worst rank fits; None if none does."""
    t = cfg.trainer
    return _least_on(hf, cfg, t.tp, t.pp, t.ep, t.expert_tp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(hf: dict[str, Any], world: int) -> list[tuple[int, int, int]]:
    """(tp, pp, ep) with `expert_tp` 1 that the layout checks accept for this model at `world` ranks (tp, pp and
    ep at most one node's `NODE_GPUS`)."""
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"])
    layers, experts = hf["num_hidden_layers"], num_experts(hf)
    out = []
    for tp in (d for d in _divisors(world) if d <= 8 and heads % d == 0 and kv % d == 0):
        for pp in (d for d in _divisors(world // tp) if layers % d == 0 and d <= 8):
            for ep in ([d for d in _divisors(world // pp) if experts % d == 0 and d <= NODE_GPUS]
                       if experts else [1]):
                out.append((tp, pp, ep))
    return out


def best_layouts(hf: dict[str, Any], cfg: Config, top: int = 3, suite_trains: bool = True) -> list[LayoutFit]:
    """The `top` layouts of `trainer.world_size` ranks that fit with the least recompute, in the module's order;
    `suite_trains`: only layouts the CPU suite trains (MoE at tp 1)."""
    moe = num_experts(hf) > 0
    fits = []
    for tp, pp, ep in candidate_layouts(hf, cfg.trainer.world_size):
        if suite_trains and moe and tp > 1:
            continue
        if (fit := _least_on(hf, cfg, tp, pp, ep, 1)) is not None:
            fits.append(fit)
    fits.sort(key=lambda f: (f.pp, f.rerun_share, f.tp, f.ep))
    return fits[:top]


def format_layout_search(hf: dict[str, Any], cfg: Config) -> list[str]:
    """The `megarl plan` lines: the least recompute on the config's layout, and the best layouts of its world."""
    t = cfg.trainer
    own = least_recompute(hf, cfg)
    lines = ["", f"recompute and layout (megarl.trainer.layout_search; {t.world_size} trainer ranks, fits = within "
                 f"{HEADROOM:.0%} of trainer.gpu_memory_gb={t.gpu_memory_gb:g}, the microbatch above, "
                 f"ep <= {NODE_GPUS}):"]
    if own is None:
        lines.append(f"  this layout (tp {t.tp} x pp {t.pp} x ep {t.ep}) does not fit with any recompute")
    else:
        asked = (t.recompute, t.recompute_layers if t.recompute == "full" else None)
        note = "" if (own.recompute, own.recompute_layers) == asked else (
            f" (the config asks for recompute={t.recompute}"
            + (f", recompute_layers={t.recompute_layers}" if t.recompute_layers else "") + ")")
        lines.append(f"  least recompute that fits this layout: {own.describe()}{note}")
    best = best_layouts(hf, cfg)
    if not best:
        lines.append("  no layout of this world size fits: lower trainer.max_tokens_per_microbatch")
    for i, fit in enumerate(best):
        lines.append(f"  {'best layout' if i == 0 else 'then'}: {fit.describe()}")
    if num_experts(hf):
        te_only = [f for f in best_layouts(hf, cfg, top=8, suite_trains=False) if f.tp > 1][:2]
        for fit in te_only:
            lines.append(f"  needs sequence parallel (TE; never trained by the suite): {fit.describe()}")
    return lines
