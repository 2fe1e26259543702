"""The studies `megarl repro NAME` runs: each a paper's central claim, the grid of runs that tests it at CPU scale,
and the comparisons that decide whether the measurement agrees.

A study is data: its settings are config overrides applied to `configs/repro.yaml` (one run per setting and
seed, all against one fleet), and its claim is a list of `Comparison`s between settings, judged on the
per-seed means of a metric over the last `window` steps (`megarl.repro.report.judge`). Nothing here runs
anything; `megarl.repro.runner` does.

Sizing (docs/repro.md, "How the size was chosen", has the sweep behind it): the task is the demo's single-token
addition on the tiny Qwen3-MoE, 32 prompts x 8 samples per step at lr 0.002; 96 steps leave 80 steps at full lag
even for lag 16 (whose first 16 batches all come from the initial weights) and let `oapl-lag`'s interval-50 runs
sync once inside the run; the reward is read over the last 16 steps, and 3 seeds give a spread to compare
differences against. At 48 steps and 16 prompts the lagged runs were still near their start (0.12-0.17).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class Setting:
    """One configuration of a study, run once per seed."""

    key: str  # unique within the study, used in file names: "reinforce_lag8"
    line: str  # the legend entry (algorithm, clip range): runs sharing it are one colour
    panel: str  # the plot panel (the schedule): "lag 8", "mixed (16, 8)", "sync.interval 50"
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class Comparison:
    """One checkable reading of the paper's claim: the window mean of `metric` in setting `a` against `b`.

    `expect`: "greater" (a above b by more than the noise), "similar" (within `tolerance` or the noise, whichever
    is larger), "not_less" (a not below b by more than that)."""

    a: str
    b: str
    expect: Literal["greater", "similar", "not_less"]
    statement: str  # what the paper says, in this comparison's terms
    metric: str = "reward/mean"
    tolerance: float = 0.05


@dataclass(frozen=True)
class Study:
    name: str
    title: str
    source: str  # paper, section and figure
    claim: str  # the paper's claim, paraphrased
    settings: tuple[Setting, ...]
    comparisons: tuple[Comparison, ...]
    smoke: tuple[str, ...]  # the settings of the short version run by the test suite (2 seeds, 3 steps)
    steps: int = 96
    seeds: tuple[int, ...] = (0, 1, 2)
    window: int = 16  # steps at the end of each run over which a metric is averaged
    plot_metrics: tuple[str, ...] = ("reward/mean",)
    overrides: tuple[str, ...] = field(default=())  # applied to every run of the study, before each setting's
    config: str = "configs/repro.yaml"  # the base job every run starts from (`--config` replaces it)
    # two settings run seed by seed on the same prompts and sampling seeds: the report adds a per-seed table of the
    # two side by side (`megarl.repro.paired`), and their paired difference
    paired: tuple[str, str] | None = None

    def setting(self, key: str) -> Setting:
        for s in self.settings:
            if s.key == key:
                return s
        raise KeyError(f"study {self.name} has no setting {key!r}; it has: {', '.join(s.key for s in self.settings)}")


def _schedule(interval: int, offset: int) -> tuple[str, tuple[str, ...]]:
    """A schedule's panel label and overrides; constant lag n is (1, n)."""
    label = f"lag {offset}" if interval == 1 else f"mixed ({interval}, {offset})"
    return label, (f"sync.interval={interval}", f"sync.offset={offset}")


# REC F1's four methods, with the clip ranges of the paper's Figure 2.
_F1_METHODS = {
    "reinforce": ("REINFORCE (no clip)", ("algorithm.name=reinforce",)),
    "nois": ("REC-OneSide-NOIS (0.6, 2.0)",
             ("algorithm.name=rec_onesided_nois", "algorithm.eps_low=0.6", "algorithm.eps_high=2.0")),
    "is": ("REC-OneSide-IS (0.2, 0.2)",
           ("algorithm.name=rec_onesided_is", "algorithm.eps_low=0.2", "algorithm.eps_high=0.2")),
    "grpo": ("GRPO (0.2, 0.2)", ("algorithm.name=grpo", "algorithm.eps_low=0.2", "algorithm.eps_high=0.2")),
}
_F1_SCHEDULES = {"lag0": (1, 0), "lag4": (1, 4), "lag8": (1, 8), "lag16": (1, 16), "mixed": (16, 8)}


def _rec_f1() -> Study:
    settings = []
    for sched_key, (m, n) in _F1_SCHEDULES.items():
        panel, sched = _schedule(m, n)
        for method_key, (line, algo) in _F1_METHODS.items():
            settings.append(Setting(f"{method_key}_{sched_key}", line, panel, (*algo, *sched)))
    comparisons = []
    for sched_key in ("lag8", "lag16", "mixed"):
        panel = _schedule(*_F1_SCHEDULES[sched_key])[0]
        comparisons += [
            Comparison(f"nois_{sched_key}", f"reinforce_{sched_key}", "greater",
                       f"{panel}: clipping keeps REC-OneSide-NOIS above unclipped REINFORCE"),
            Comparison(f"grpo_{sched_key}", f"reinforce_{sched_key}", "greater",
                       f"{panel}: clipped GRPO stays above unclipped REINFORCE"),
            Comparison(f"is_{sched_key}", f"grpo_{sched_key}", "similar",
                       f"{panel}: with the same clip range, REC-OneSide-IS and GRPO behave alike"),
        ]
    comparisons += [
        Comparison("reinforce_lag0", "reinforce_lag16", "greater",
                   "REINFORCE degrades as the lag grows (on-policy above lag 16)"),
        Comparison("nois_lag8", "is_lag8", "greater",
                   "lag 8: the wide clip range (0.6, 2.0) without importance sampling learns faster than IS at "
                   "(0.2, 0.2)"),
    ]
    return Study(
        name="rec-f1", title="REC F1: clipping, not importance sampling, carries off-policy stability",
        source="REC (group-relative REINFORCE is off-policy), section 4.1, finding F1, Figure 2",
        claim="GRPO's effectiveness in off-policy settings stems from clipping as regularisation rather than from "
              "importance sampling: unclipped REINFORCE collapses when the data lag, REC-OneSide-IS and GRPO with "
              "the same clip range perform nearly identically, and widening the clip range to (0.6, 2.0) without "
              "importance sampling speeds training up without harming stability.",
        settings=tuple(settings), comparisons=tuple(comparisons),
        smoke=("nois_lag8", "reinforce_lag8"))


def _rec_red() -> Study:
    panel, sched = _schedule(1, 8)
    methods = {
        "reinforce": _F1_METHODS["reinforce"],
        "red_drop": ("RED-Drop", ("algorithm.name=red_drop",)),
        "red_weight": ("RED-Weight (T = 1)", ("algorithm.name=red_weight", "algorithm.temperature=1.0")),
        "nois": _F1_METHODS["nois"],
    }
    settings = tuple(Setting(f"{k}_lag8", line, panel, (*algo, *sched)) for k, (line, algo) in methods.items())
    return Study(
        name="rec-red", title="REC section 4.3: RED-Drop and RED-Weight against REINFORCE off-policy",
        source="REC, section 4.3 and appendix B.6, Figure 4",
        claim="Regularising by the data distribution — dropping excess negative samples (RED-Drop) or up-weighting "
              "high-advantage samples (RED-Weight) — makes group-relative REINFORCE work off-policy, comparable to "
              "REC-OneSide-NOIS with the enlarged clip range, where plain REINFORCE falls behind.",
        settings=settings,
        comparisons=(
            Comparison("red_drop_lag8", "reinforce_lag8", "greater", "lag 8: RED-Drop above REINFORCE"),
            Comparison("red_weight_lag8", "reinforce_lag8", "greater", "lag 8: RED-Weight above REINFORCE"),
            Comparison("red_weight_lag8", "nois_lag8", "similar",
                       "lag 8: RED-Weight comparable to REC-OneSide-NOIS (0.6, 2.0)"),
            Comparison("red_drop_lag8", "nois_lag8", "similar",
                       "lag 8: RED-Drop comparable to REC-OneSide-NOIS (0.6, 2.0)"),
        ),
        smoke=("red_drop_lag8",))


def _oapl_lag() -> Study:
    settings = []
    for m in (1, 8, 50):
        panel = f"sync.interval {m}"
        sched = (f"sync.interval={m}", "sync.offset=0")
        settings += [
            # OAPL's beta2 for one-token responses (the schema's default 1e-3 is for long ones; docs/algorithms.md)
            Setting(f"oapl_every{m}", "OAPL (engine log-probs as reference)", panel,
                    ("algorithm.name=oapl", "algorithm.oapl_beta2=0.5", *sched)),
            Setting(f"grpo_every{m}", "GRPO (0.2, 0.2)", panel,
                    ("algorithm.name=grpo", "algorithm.eps_low=0.2", "algorithm.eps_high=0.2", *sched)),
        ]
    return Study(
        name="oapl-lag", title="OAPL: stable learning when the fleet is synced rarely",
        source="OAPL (off-policy RL with lagged inference), sections 3-4, Figures 1-3",
        claim="OAPL's squared-loss objective against the inference policy's own log-probs stays stable under large "
              "policy lag (the fleet synced only every L = 50 or more steps) without importance weights or "
              "clipping, matching or beating GRPO, and its entropy does not collapse where GRPO's does.",
        settings=tuple(settings),
        comparisons=(
            Comparison("oapl_every50", "grpo_every50", "not_less", "interval 50: OAPL not below GRPO"),
            Comparison("oapl_every8", "grpo_every8", "not_less", "interval 8: OAPL not below GRPO"),
            Comparison("oapl_every50", "oapl_every1", "not_less",
                       "OAPL synced every 50 steps keeps up with OAPL synced every step"),
            Comparison("oapl_every50", "grpo_every50", "greater",
                       "interval 50: OAPL keeps more entropy than GRPO (no entropy collapse)", metric="entropy"),
        ),
        smoke=("oapl_every8",),
        plot_metrics=("reward/mean", "entropy"))


def _offpolicy_grpo() -> Study:
    settings = [Setting("grpo_v1", "on-policy GRPO (v = 1)", "GRPO", ("algorithm.name=grpo", "sync.interval=1"))]
    settings += [Setting(f"offgrpo_v{v}", f"off-policy GRPO (v = {v})", "off-policy GRPO",
                         ("algorithm.name=off_policy_grpo", f"sync.interval={v}")) for v in (1, 4, 10)]
    return Study(
        name="offpolicy-grpo", title="Off-policy GRPO: serving the model every v steps is on par with on-policy",
        source="GRPO revisited (on- and off-policy), section 4, Figure 2, Table 1",
        claim="GRPO with advantages from the lagged server policy, a clipped surrogate and a KL term to a "
              "periodically reset reference, with the model served to vLLM only every v = 10 steps, performs on par "
              "with or better than on-policy GRPO (v = 1), cutting the communication of serving the model.",
        settings=tuple(settings),
        comparisons=(
            Comparison("offgrpo_v4", "grpo_v1", "not_less", "v = 4 on par with or above on-policy GRPO"),
            Comparison("offgrpo_v10", "grpo_v1", "not_less", "v = 10 on par with or above on-policy GRPO"),
            Comparison("offgrpo_v1", "grpo_v1", "similar", "v = 1: off-policy GRPO's objective reduces to GRPO's"),
        ),
        smoke=("offgrpo_v4",),
        overrides=("sync.offset=0",))


# The stated tolerance of `inflight`: the in-flight arm's reward (mean of the last `window` steps, mean over seeds)
# may fall below the baseline's by at most this much, or two standard errors if those are larger. Chosen before the
# first full run, not fitted to it: the repro module's default band, about a fifth of the demo's final reward.
INFLIGHT_TOLERANCE = 0.05


def _inflight() -> Study:
    """Issue 48 item 7: the demo with in-flight weight updates and partial rollouts learns as the demo does."""
    panel = "demo, sync (2, 1)"
    algo = "algorithm.name=rec_gspo_nois"  # the demo's own, named so that each setting says what it trains
    return Study(
        name="inflight", title="In-flight weight updates + partial rollouts: the demo still learns",
        source="issue 48 item 7 (AReaL's interruptible generation and partial rollouts, PipelineRL's in-flight "
               "updates); the demo job, configs/demo_moe.yaml",
        claim="The demo task trained with in-flight weight updates and partial rollouts (sync.inflight=true, KV "
              "recomputed after each push, batches formed from the finished groups of the lowest (home batch, "
              "prompt), tokens at most the schedule's m + n - 1 = 2 versions old) reaches the reward of the same "
              "run without them: same schedule "
              "(sync.interval 2, sync.offset 1), same steps, same seeds, the reward over the last steps not below "
              f"the baseline's by more than {INFLIGHT_TOLERANCE} (or two standard errors over the seeds).",
        settings=(
            Setting("sync", "without (the demo as shipped: each batch one version)", panel,
                    (algo, "sync.inflight=false")),
            Setting("inflight", "in-flight updates + partial rollouts (KV recompute)", panel,
                    (algo, "sync.inflight=true", "sync.inflight_kv=recompute")),
        ),
        comparisons=(
            Comparison("inflight", "sync", "not_less", "in-flight + partial rollouts reach the reward of the run "
                       "without them", tolerance=INFLIGHT_TOLERANCE),
        ),
        smoke=("sync", "inflight"),
        steps=60, window=10, config="configs/demo_moe.yaml", paired=("inflight", "sync"),
        # no TensorBoard files (the metrics are in metrics.jsonl); the demo's evaluation every 10 steps stays
        overrides=("metrics.tensorboard=false",),
        plot_metrics=("reward/mean", "token_lag/spanning_share"))


STUDIES: dict[str, Study] = {s.name: s for s in (_rec_f1(), _rec_red(), _oapl_lag(), _offpolicy_grpo(), _inflight())}
