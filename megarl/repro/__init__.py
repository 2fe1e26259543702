"""`megarl repro NAME`: a source paper's central claim, re-run on the real stack at CPU scale.

    megarl repro list                          the studies, their settings and run counts
    megarl repro rec-f1 [--seeds 3] [--steps 96] [--out DIR] [--smoke] [--fleet-url URL] [overrides ...]

A study (`megarl.repro.studies`) is a grid of settings x seeds, each a real training run (megatron-core trainer,
vLLM fleet, the lag schedule) of `configs/repro.yaml` plus the study's overrides. It writes, in `--out`
(default `runs/repro/<study>`): `<study>.json` (every run's per-step metrics, the provenance), `<study>.png`
(mean and spread over seeds) and `<study>.md` (the claim, the settings, what was measured and each comparison's
verdict). `--smoke` runs the short version the test suite uses (2 seeds, 3 steps, one or two settings). Complete runs
already in `--out` with the same config are reused: an interrupted study continues (`--fresh` reruns all).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megarl.repro.studies import STUDIES


def parser() -> argparse.ArgumentParser:
    """`megarl repro`'s options; parse with `parse_intermixed_args` so overrides may follow the options."""
    p = argparse.ArgumentParser(prog="megarl repro", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", help=f"the study to run ({', '.join(STUDIES)}) or `list`")
    p.add_argument("--seeds", type=int, help="seeds per setting (run.seed 0..N-1; default: the study's, 3)")
    p.add_argument("--steps", type=int, help="steps per run (default: the study's)")
    p.add_argument("--smoke", action="store_true", help="the short version: 2 seeds, 3 steps, the study's smoke "
                   "settings")
    p.add_argument("--settings", metavar="KEY,KEY", help="run only these settings, comma-separated (`megarl repro "
                   "list` names them; default: all, or the smoke settings with --smoke)")
    p.add_argument("--out", type=Path, help="output directory (default: runs/repro/<study>)")
    p.add_argument("--config", help="the base job every run starts from (default: the study's: configs/repro.yaml, "
                   "the inflight study's configs/demo_moe.yaml)")
    p.add_argument("--fleet-url", action="append", default=None,
                   help="reuse a running fleet serving the config's model (repeat per replica)")
    p.add_argument("--fresh", action="store_true", help="rerun every run, even complete ones found in --out")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides applied to every run")
    return p


def _list() -> None:
    for study in STUDIES.values():
        runs = len(study.settings) * len(study.seeds)
        print(f"{study.name}: {study.title}\n  {len(study.settings)} settings x {len(study.seeds)} seeds = {runs} "
              f"runs of {study.steps} steps; source: {study.source}\n  settings: "
              + ", ".join(s.key for s in study.settings))


def run(args: argparse.Namespace) -> int:
    from megarl.config.load import ConfigError
    from megarl.launch import TrainerError
    from megarl.repro.report import markdown, plot
    from megarl.repro.runner import ReproError, plan_for, run_study

    name, overrides = args.study, args.overrides
    if name == "list":
        _list()
        return 0
    if name not in STUDIES:
        print(f"megarl repro: no study {name!r}; choose one of: {', '.join(STUDIES)} (or `list`)", file=sys.stderr)
        return 2
    study = STUDIES[name]
    out = args.out or Path("runs/repro") / (study.name + ("-smoke" if args.smoke else ""))
    try:
        plan = plan_for(study, smoke=args.smoke, seeds=args.seeds, steps=args.steps, config=args.config,
                        overrides=tuple(overrides),
                        settings=args.settings.split(",") if args.settings else None)
        print(f"megarl repro {study.name}: {len(plan.settings)} settings x {len(plan.seeds)} seeds, "
              f"{plan.steps} steps each -> {out}", flush=True)
        results = run_study(plan, out, fleet_urls=args.fleet_url, fresh=args.fresh)
    except (ConfigError, ReproError, TrainerError) as err:
        print(f"megarl repro: {err}", file=sys.stderr)
        return 2 if isinstance(err, ConfigError) else 1
    if study.paired:  # the two settings seed by seed, printed and kept in the JSON
        import json

        from megarl.repro.paired import paired_markdown, paired_summary

        results["paired"] = paired_summary(results, *study.paired)
        (out / f"{study.name}.json").write_text(json.dumps(results, indent=1) + "\n")
        print("\n".join(paired_markdown(results["paired"], {k: s["line"] for k, s in results["settings"].items()})))
    png = out / f"{study.name}.png"
    plot(results, study, png)
    (out / f"{study.name}.md").write_text(markdown(results, study, png.name))
    print(f"wrote {out / (study.name + '.json')}, {png} and {out / (study.name + '.md')}")
    return 0
