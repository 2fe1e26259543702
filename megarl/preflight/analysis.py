"""Judge a job's preflight from its steps' reports: the placement table and every problem, each one line naming the
node and step and saying what to fix. A pure function of the reports (and of SLURM's allocation, when known), so it
is tested on hand-made inputs as well as on real steps' reports."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Expected:
    """What the config asks for."""

    world_size: int
    replicas: int
    rollout_tp: int


@dataclass
class Verdict:
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)  # node, step, ranks, GPUs
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def natural_key(text: str) -> list[Any]:
    """node2 before node10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def compact(ids: list[int]) -> str:
    """0,1,2,3,6 -> 0-3,6 (rank lists)."""
    ids, parts, i = sorted(set(ids)), [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def default_step(key: str) -> str:
    return "megarl-rank" if key.startswith("rank") else f"megarl-serve-{key.removeprefix('replica')}"


def describe(key: str) -> str:
    return f"trainer rank {key.removeprefix('rank')}" if key.startswith("rank") else \
        f"replica {key.removeprefix('replica')}"


def _who(reports: list[dict[str, Any]]) -> str:
    """`node1 megarl-rank (ranks 0-7)` for reports of one node and step."""
    first = reports[0]
    if first["role"] == "rank":
        ranks = [r["index"] for r in reports]
        label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {compact(ranks)}"
    else:
        label = f"replica {first['index']}"
    return f"{first['node']} {first['step']} ({label})"


def _groups(reports: dict[str, dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for report in reports.values():
        groups[(report["node"], report["step"])].append(report)
    for members in groups.values():
        members.sort(key=lambda r: r["index"])
    return dict(sorted(groups.items(), key=lambda item: (natural_key(item[0][0]), natural_key(item[0][1]))))


def _missing(expected: Expected, reports: dict[str, Any], hellos: dict[str, Any], where: str) -> list[str]:
    keys = [f"rank{k}" for k in range(expected.world_size)] + [f"replica{i}" for i in range(expected.replicas)]
    problems = []
    for key in keys:
        if key in reports:
            continue
        log = f"trainer_rank{key.removeprefix('rank')}.log" if key.startswith("rank") else \
            f"serve_replica{key.removeprefix('replica')}.log"
        if key in hellos:
            problems.append(f"{hellos[key]['node']} {hellos[key]['step']} ({describe(key)}) said hello but wrote no "
                            f"report: it died during its checks (see its output, {log})")
        else:
            problems.append(f"{default_step(key)} ({describe(key)}) never reported: it did not start or failed "
                            f"before its check (see its output, {log}), or its node does not share the run "
                            f"directory {where}")
    return problems


def _step_problems(groups: dict[tuple[str, str], list[dict[str, Any]]], reports: dict[str, Any]) -> list[str]:
    """The findings the steps made themselves, and the hellos they waited for in vain from steps that did run. The
    same finding from several steps (a truncated checkpoint seen from every node) is one line naming them all."""
    by_text: dict[str, dict[tuple[str, str], list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for where, members in groups.items():
        for report in members:
            texts = list(report["findings"])
            texts += [f"never saw the hello of {describe(key)} ({reports[key]['node']}) within {report['wait_s']:g} s: "
                      "the steps started too far apart (raise --wait-s), or the run directory's files reach this "
                      "node late" for key in report["unseen"] if key in reports]
            for text in texts:
                by_text[text][where].append(report)
    return [f"{', '.join(_who(members) for members in steps.values())}: {text}" for text, steps in by_text.items()]


def _gpu_problems(groups: dict[tuple[str, str], list[dict[str, Any]]], expected: Expected,
                  allocation: dict[str, list[int]] | None, ranks_missing: bool) -> list[str]:
    """GPUs shared by two steps (or two trainer ranks), allocated GPUs no step holds, replicas not holding
    rollout.tp GPUs, trainer nodes whose GPUs and ranks differ in number (not judged while ranks are missing: the
    missing one is the problem)."""
    problems = []
    users: dict[str, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))  # node -> GPU -> steps
    held: dict[str, set[int]] = defaultdict(set)
    gpu_job = any(r["gpus"] for members in groups.values() for r in members) or \
        any(allocation.values() if allocation else [])
    for (node, step), members in groups.items():
        step_held = {g for r in members for g in r["gpus"]}
        held[node] |= step_held
        for r in members:
            if r["role"] == "rank" and r["gpu"] is not None:
                users[node][r["gpu"]].append(f"{step} (rank {r['index']})")
            elif r["role"] == "serve":
                for g in r["gpus"]:
                    users[node][g].append(f"{step} (replica {r['index']})")
        if not gpu_job:
            continue
        if members[0]["role"] == "serve" and len(step_held) != expected.rollout_tp:
            problems.append(f"{_who(members)}: holds {len(step_held)} GPU(s) but rollout.tp={expected.rollout_tp}: "
                            f"start its step with srun --gpus-per-node={expected.rollout_tp} --exact")
        if members[0]["role"] == "rank" and len(step_held) != len(members) and not ranks_missing:
            problems.append(f"{_who(members)}: {len(members)} rank(s) but {len(step_held)} GPU(s) on {node}: run "
                            "as many trainer ranks per node as the step has GPUs (--ntasks-per-node = "
                            "--gpus-per-node)")
    for node in sorted(users, key=natural_key):
        shared: dict[tuple[str, ...], list[int]] = defaultdict(list)
        for gpu, steps in sorted(users[node].items()):
            if len(steps) > 1:
                shared[tuple(steps)].append(gpu)
        for steps, gpus in shared.items():
            problems.append(f"{node}: GPU(s) {','.join(map(str, gpus))} used by {' and '.join(steps)}: give each "
                            "step (and each trainer rank) its own GPUs (srun --gpus-per-node with "
                            "--exact, one rank per GPU)")
    for node, ids in sorted((allocation or {}).items(), key=lambda item: natural_key(item[0])):
        idle = sorted(set(ids) - held[node])
        if idle:
            problems.append(f"{node}: GPU(s) {','.join(map(str, idle))} of the job's allocation are used by no "
                            "step: request only the GPUs the steps use, or place a step on them")
    return problems


def _driver_problems(groups: dict[tuple[str, str], list[dict[str, Any]]], devices: str | None) -> list[str]:
    if devices == "ids":
        return []
    return [f"{_who(members)}: SLURM gave GPU(s) {','.join(map(str, sorted({g for r in members for g in r['gpus']})))}"
            f" but {members[0]['gpu_check']['reason']}: run the job on GPU nodes (or set MEGARL_PREFLIGHT_DEVICES="
            "ids to check SLURM's ids only)" for members in groups.values()
            if any(r["gpus"] and r["gpu_check"]["driver"] is False for r in members)]


def judge(expected: Expected, reports: dict[str, dict[str, Any]], hellos: dict[str, dict[str, Any]],
          allocation: dict[str, list[int]] | None, devices: str | None = None, where: str = "") -> Verdict:
    """`reports` / `hellos` by key (`rank<k>`, `replica<i>`); `allocation`: SLURM's GPUs per node, None when not
    known (not under SLURM); `devices="ids"`: GPUs without a driver are expected (an emulated cluster)."""
    verdict = Verdict()
    groups = _groups(reports)
    for members in groups.values():
        first, held = members[0], sorted({g for r in members for g in r["gpus"]})
        ranks = f"replica {first['index']}" if first["role"] == "serve" else \
            f"rank{'s' if len(members) > 1 else ''} {compact([r['index'] for r in members])}"
        verdict.rows.append((first["node"], first["step"], ranks, ",".join(map(str, held)) or "-"))
    verdict.problems += _missing(expected, reports, hellos, where)
    verdict.problems += _step_problems(groups, reports)
    ranks_missing = any(f"rank{k}" not in reports for k in range(expected.world_size))
    verdict.problems += _gpu_problems(groups, expected, allocation, ranks_missing)
    verdict.problems += _driver_problems(groups, devices)
    if devices == "ids":
        verdict.notes.append("GPUs were checked as SLURM's ids only (MEGARL_PREFLIGHT_DEVICES=ids): no driver was "
                             "asked whether they work")
    if allocation is None:
        verdict.notes.append("not under SLURM (no SLURM_JOB_ID): the steps' GPUs were not compared with the job's "
                             "allocation")
    return verdict
