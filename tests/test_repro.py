"""`megarl repro`: the studies are valid configs that say what they run, the verdicts follow their rule on
hand-made numbers, and the smoke settings of every study run on the real stack (the shared TP-2 fleet; rec-f1 with
the smoke's two seeds, the others with one) and write complete, finite metrics, with each run's measured lags equal
to its schedule's formula and the same seed giving the same curve."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from megarl.cli import main as cli_main
from megarl.config.load import load_config
from megarl.repro.report import judge
from megarl.repro.runner import KEPT, REQUIRED, find_reusable
from megarl.repro.studies import STUDIES, Comparison

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(STUDIES))
def test_study_settings_are_valid_configs(name):
    study = STUDIES[name]
    keys = [s.key for s in study.settings]
    assert len(set(keys)) == len(keys)
    assert set(study.smoke) <= set(keys) and study.smoke
    for c in study.comparisons:
        assert {c.a, c.b} <= set(keys), c
    for s in study.settings:
        cfg = load_config(str(ROOT / study.config), [*study.overrides, *s.overrides])
        # the panel names the schedule the overrides set
        if s.panel.startswith("lag "):
            assert (cfg.sync.interval, cfg.sync.offset) == (1, int(s.panel.split()[1]))
        elif s.panel.startswith("mixed"):
            assert (cfg.sync.interval, cfg.sync.offset) == (16, 8)
        elif s.panel.startswith("sync.interval"):
            assert cfg.sync.interval == int(s.panel.split()[-1])
        assert cfg.algorithm.name in s.overrides[0], (s.key, cfg.algorithm.name)


def test_inflight_study_is_the_demo_with_and_without_inflight():
    """The two arms are the demo job (configs/demo_moe.yaml, its 60 steps) with the same schedule, which lets the fleet
    run ahead (sync.offset >= 1, so pushes can land mid-generation), and differ in sync.inflight alone; the comparison
    is the in-flight arm not below the baseline, at the stated tolerance."""
    from megarl.repro.studies import INFLIGHT_TOLERANCE

    study = STUDIES["inflight"]
    demo = load_config(str(ROOT / "configs/demo_moe.yaml"), []).model_dump(mode="json")
    arms = {s.key: load_config(str(ROOT / study.config), [*study.overrides, *s.overrides]).model_dump(mode="json")
            for s in study.settings}
    assert set(arms) == {"sync", "inflight"} and study.paired == ("inflight", "sync") and study.steps == 60
    assert arms["inflight"]["sync"]["inflight"] and not arms["sync"]["sync"]["inflight"]
    assert arms["inflight"]["sync"]["inflight_kv"] == "recompute"
    assert arms["sync"]["sync"]["offset"] >= 1 and demo["run"]["steps"] == study.steps
    assert not demo["sync"].pop("inflight")  # the demo as shipped runs without
    for arm in arms.values():
        arm["sync"].pop("inflight")
        assert arm["sync"] == demo["sync"] and arm["algorithm"] == demo["algorithm"]
    assert arms["sync"] == arms["inflight"]
    arms["sync"]["metrics"]["tensorboard"] = demo["metrics"]["tensorboard"]  # the study's one change to the demo
    assert arms["sync"] == demo
    (c,) = study.comparisons
    assert (c.a, c.b, c.expect, c.tolerance) == ("inflight", "sync", "not_less", INFLIGHT_TOLERANCE)


def test_rec_f1_grid_is_the_papers():
    """Four methods at constant lags 0, 4, 8, 16 and REC's mixed (16, 8) schedule, with Figure 2's clip ranges."""
    study = STUDIES["rec-f1"]
    assert len(study.settings) == 20
    seen = set()
    for s in study.settings:
        cfg = load_config(str(ROOT / "configs/repro.yaml"), list(s.overrides))
        a = cfg.algorithm
        seen.add((a.name, a.eps_low if a.name != "reinforce" else None, a.eps_high if a.name != "reinforce" else None,
                  cfg.sync.interval, cfg.sync.offset))
    for m, n in ((1, 0), (1, 4), (1, 8), (1, 16), (16, 8)):
        assert {("reinforce", None, None, m, n), ("rec_onesided_nois", 0.6, 2.0, m, n),
                ("rec_onesided_is", 0.2, 0.2, m, n), ("grpo", 0.2, 0.2, m, n)} <= seen


@pytest.mark.parametrize(("expect", "a", "b", "verdict"), [
    ("greater", [0.5, 0.6, 0.7], [0.1, 0.2, 0.3], "agrees"),  # d = 0.4, se = sqrt(0.01/3 * 2) = 0.0816
    ("greater", [0.1, 0.2, 0.3], [0.5, 0.6, 0.7], "contradicts"),
    ("greater", [0.3, 0.4, 0.5], [0.2, 0.3, 0.4], "inconclusive"),  # d = 0.1 < 2 se = 0.163
    ("similar", [0.30, 0.31, 0.32], [0.33, 0.34, 0.35], "agrees"),  # |d| = 0.03 <= tolerance 0.05
    ("similar", [0.30, 0.31, 0.32], [0.50, 0.51, 0.52], "contradicts"),  # 0.2 > max(2 se = 0.016, 0.05)
    ("not_less", [0.30, 0.31, 0.32], [0.34, 0.35, 0.36], "agrees"),  # d = -0.04 within the tolerance
    ("not_less", [0.10, 0.11, 0.12], [0.34, 0.35, 0.36], "contradicts"),
])
def test_judge_by_hand(expect, a, b, verdict):
    v = judge(Comparison("a", "b", expect, "claim"), {"a": a, "b": b})
    assert v["verdict"] == verdict
    assert math.isclose(v["diff"], sum(a) / 3 - sum(b) / 3)


def _fake_run(run_dir: Path, overrides: list[str], steps: int) -> None:
    """A run directory as `megarl train` leaves it: its config (run.dir = where it is), one metrics line per step,
    a summary."""
    import yaml

    run_dir.mkdir(parents=True)
    cfg = load_config(str(ROOT / "configs/repro.yaml"), [*overrides, f"run.dir={run_dir}"]).model_dump(mode="json")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": k, "reward/mean": 0.5}) + "\n"
                                                   for k in range(steps)))
    (run_dir / "summary.json").write_text("{}")


def test_a_run_of_the_same_job_is_reused_across_studies(tmp_path):
    """rec-red's REINFORCE at lag 8 is rec-f1's run: found in the sibling study's directory (its run.dir differs,
    nothing else); a different seed, setting or step count, or an incomplete run, is not reused."""
    job = ["algorithm.name=reinforce", "sync.interval=1", "sync.offset=8", "run.seed=0", "run.steps=3"]
    _fake_run(tmp_path / "rec-f1" / "runs" / "reinforce_lag8_seed0", job, 3)
    _fake_run(tmp_path / "rec-f1" / "runs" / "short_seed0", [*job[:-1], "run.steps=4"], 2)  # stopped part-way
    mine = tmp_path / "rec-red" / "runs" / "reinforce_lag8_seed0"
    found = find_reusable(mine, [*job, f"run.dir={mine}"], str(ROOT / "configs/repro.yaml"), 3)
    assert found is not None and found[0] == tmp_path / "rec-f1" / "runs" / "reinforce_lag8_seed0"
    assert [r["step"] for r in found[1]] == [0, 1, 2]
    config = str(ROOT / "configs/repro.yaml")
    assert find_reusable(mine, [*job[:3], "run.seed=1", "run.steps=3", f"run.dir={mine}"], config, 3) is None
    assert find_reusable(mine, ["algorithm.name=grpo", *job[1:], f"run.dir={mine}"], config, 3) is None
    assert find_reusable(mine, [*job[:-1], "run.steps=4", f"run.dir={mine}"], config, 4) is None


def test_runs_say_which_commit_trained_them(tmp_path):
    """A run trained by megarl repro records its commit in its directory; the report lists each commit with its
    run count, and a run without the record (made before megarl kept it) as unknown."""
    from megarl.repro.report import _made_at
    from megarl.repro.runner import RUN_PROVENANCE, run_provenance

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / RUN_PROVENANCE).write_text(json.dumps({"commit": "abc123", "dirty": True}))
    assert run_provenance(tmp_path / "a") == {"commit": "abc123", "dirty": True}
    assert run_provenance(tmp_path / "b") == {"commit": "unknown", "dirty": False}
    runs = [{"made_at": {"commit": "abc123", "dirty": False}}] * 2 + [{"made_at": {"commit": "def456", "dirty": True}},
                                                                      {}]
    assert _made_at(runs) == ("`abc123` (2 runs), `def456` (with uncommitted changes) (1 run), `unknown` (1 run)")


def test_judge_without_runs():
    assert judge(Comparison("a", "b", "greater", "x"), {"a": [0.5], "b": []})["verdict"] == "not run"


def _smoke(capsys: pytest.CaptureFixture[str], study: str, fleet_url: str, model_dir: Path, out: Path,
           *extra: str) -> subprocess.CompletedProcess:
    """`megarl repro STUDY --smoke ...` through the CLI's own entry point, in this process (no interpreter, imports
    or forkserver of its own to start for each invocation): its exit code and what it printed."""
    # the shared fleet is TP 2; small batches keep each run to a few seconds of steps
    argv = ["repro", study, "--smoke", "--fleet-url", fleet_url, "--out", str(out), *extra, f"model.hf_dir={model_dir}",
            "rollout.tp=2", "data.prompts_per_step=4", "rollout.samples_per_prompt=4"]
    capsys.readouterr()  # what earlier invocations printed is theirs
    code = cli_main(argv)
    printed = capsys.readouterr()
    return subprocess.CompletedProcess(["megarl", *argv], code, printed.out, printed.err)


def _expected_lag(m: int, n: int, batch: int) -> int:
    """REC appendix B.2, written out: batch l is generated by version m*floor(l/m) - n (0 before the pipeline
    fills) and consumed at version l."""
    generated_by = m * (batch // m) - n
    return batch - max(generated_by, 0)


@pytest.mark.parametrize("name", sorted(STUDIES))
def test_repro_smoke(name, moe_fleet, tiny_moe_dir, tmp_path, capsys, monkeypatch):
    """Changes the fleet's weights (every run pushes its trainer's initial weights first). rec-f1 runs the smoke
    version as shipped (its settings, 2 seeds, 3 steps) and reruns a seed for the same curve; the other studies run
    their smoke settings with one seed (`--seeds 1`): a second seed differs only in `run.seed`, and the seeds'
    handling (two per setting, the mean and spread, the rerun) is rec-f1's to show."""
    study = STUDIES[name]
    seeds = (0, 1) if name == "rec-f1" else (0,)
    monkeypatch.chdir(ROOT)  # the CLI's default --config is relative to the repository
    one_seed = () if len(seeds) == 2 else ("--seeds", "1")
    proc = _smoke(capsys, name, moe_fleet.base_url, tiny_moe_dir, tmp_path, *one_seed)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / f"{name}.json").read_text())
    assert (tmp_path / f"{name}.png").stat().st_size > 10_000
    report = (tmp_path / f"{name}.md").read_text()
    assert study.claim in report and results["provenance"]["commit"] in report
    assert sorted((r["setting"], r["seed"]) for r in results["runs"]) == sorted(
        (k, s) for k in study.smoke for s in seeds)
    for run in results["runs"]:
        records = run["records"]
        assert [r["step"] for r in records] == [0, 1, 2]
        assert run["made_at"]["commit"] == results["provenance"]["commit"]  # trained by this invocation
        for r in records:
            assert set(REQUIRED) <= set(r) <= {"step", *KEPT}
            assert all(math.isfinite(r[k]) for k in REQUIRED)
        cfg = load_config(str(Path(run["dir"]) / "config.yaml"), [])
        assert cfg.run.seed == run["seed"] and cfg.run.steps == 3 and cfg.sync.push_initial
        if cfg.sync.inflight:  # batches of the first groups to finish: every token within the bound m + n - 1
            bound = cfg.sync.interval + cfg.sync.offset - 1
            assert all(0 <= r["token_lag/max"] <= r["batch_lag"] <= bound for r in records), records
            assert all("partial/dropped_groups" in r and 0 <= r["token_lag/spanning_share"] <= 1 for r in records)
        else:
            assert not any(k.startswith(("partial/", "token_lag/")) for r in records for k in r)
            assert [r["batch_lag"] for r in records] == [
                _expected_lag(cfg.sync.interval, cfg.sync.offset, step) for step in range(3)]
        assert [r["reward/mean"] for r in records] == [
            json.loads(line)["reward/mean"] for line in (Path(run["dir"]) / "metrics.jsonl").read_text().splitlines()]
    # every comparison has its row and verdict; rec-f1's smoke runs both settings of one
    rows = [line for line in report.splitlines() if line.startswith("| ") and "**" in line]
    assert len(rows) == len(study.comparisons)
    assert any("not run" not in row for row in rows) == (len(study.smoke) == 2)
    if study.paired:  # the per-seed table, from each run's own metrics.jsonl
        a, b = study.paired
        assert [row["seed"] for row in results["paired"]["rows"]] == list(seeds)
        for row in results["paired"]["rows"]:
            for key in (a, b):
                (run,) = [r for r in results["runs"] if (r["setting"], r["seed"]) == (key, row["seed"])]
                steps = [json.loads(line) for line in (Path(run["dir"]) / "metrics.jsonl").read_text().splitlines()]
                tail = steps[-results["window"]:]
                assert row[key]["reward"] == pytest.approx(sum(r["reward/mean"] for r in tail) / len(tail))
                assert row[key]["dropped"] == sum(r.get("partial/dropped_groups", 0) for r in steps)
                assert row[key]["lag_max"] == max(r.get("token_lag/max", r["batch_lag"]) for r in steps)
            assert row["diff"] == pytest.approx(row[a]["reward"] - row[b]["reward"])
        assert "## Per seed" in report and f"| {seeds[0]} | {results['settings'][a]['line']} |" in report
        assert f"{a} - {b}" in proc.stdout  # the table is printed too
    if name == "rec-f1":  # the same seed gives the same curve: rerun one setting's seed 0 from scratch
        again = tmp_path / "again"
        proc = _smoke(capsys, name, moe_fleet.base_url, tiny_moe_dir, again, "--seeds", "1", "--settings",
                      study.smoke[0], "--fresh")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        first = {r["setting"]: r["records"] for r in results["runs"] if r["seed"] == 0}
        rerun = json.loads((again / f"{name}.json").read_text())["runs"]
        assert [r["setting"] for r in rerun] == [study.smoke[0]]
        for run in rerun:
            for a, b in zip(first[run["setting"]], run["records"], strict=True):
                for key in ("reward/mean", "loss", "entropy", "batch_lag", "grad_norm"):
                    assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (run["setting"], key)
        # a rerun into the same directory reuses the complete runs instead of training again
        proc = _smoke(capsys, name, moe_fleet.base_url, tiny_moe_dir, tmp_path)
        assert proc.returncode == 0 and proc.stdout.count("(reused;") == 4, proc.stdout[-2000:]
