"""`megarl smoke --gpu` on this CPU machine: its CPU part runs (contracts, layer spec, the distributed-optimizer
checkpoint round trip), every GPU-only check prints SKIPPED with what it needs, and a planted rename in a library
fails the contracts check with that name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.smoke.registry import Needs, Node
from megarl.smoke.runner import run

GPU_ONLY = ("te-packed-bf16", "vllm-pushes", "delta-push", "nccl-sync", "routing-replay")


def test_smoke_runs_its_cpu_part_and_skips_the_rest(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "megarl.cli", "smoke", "--gpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = {line.split()[1]: line for line in done.stdout.splitlines() if line.split()[:1] in (["PASS"], ["FAIL"],
                                                                                                 ["SKIPPED"])}
    for name in ("contracts", "layer-spec", "checkpoint"):
        assert lines[name].startswith("PASS"), lines[name]
    assert "moments equal, the next step bit for bit" in lines["checkpoint"]
    for name in GPU_ONLY:
        assert lines[name].startswith("SKIPPED") and "needs" in lines[name] and "GPU" in lines[name], lines[name]
    report = json.loads((tmp_path / "smoke.json").read_text())
    assert [c["status"] for c in report["checks"]] == ["pass"] * 3 + ["skipped"] * len(GPU_ONLY)
    assert "smoke: 3 passed, 0 failed, 5 skipped" in done.stdout


@pytest.mark.parametrize(("node", "needs", "reason"), [
    (Node(gpus=0, te=False, vllm=True), Needs(gpus=1, vllm=True), "needs a GPU (no GPU here)"),
    (Node(gpus=1, te=False, vllm=True), Needs(gpus=1, te=True), "needs Transformer Engine"),
    (Node(gpus=1, te=True, vllm=False), Needs(gpus=1, vllm=True), "needs vLLM"),
    (Node(gpus=2, te=False, vllm=True), Needs(gpus=3, vllm=True), "needs 3 GPUs (2 GPU(s) here)"),
    (Node(gpus=4, te=True, vllm=True), Needs(gpus=3, te=True, vllm=True), None),
])
def test_a_check_runs_only_where_the_node_has_what_it_needs(node: Node, needs: Needs, reason: str | None) -> None:
    missing = needs.missing(node)
    assert missing == reason if reason is None else reason in missing


def test_a_renamed_library_name_fails_the_contracts_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    monkeypatch.delattr(DistributedOptimizer, "sharded_state_dict")
    seen = []
    [outcome] = run(tmp_path, node=Node(gpus=0, te=False, vllm=False), only=["contracts"], report=seen.append)
    assert outcome.status == "fail" and "sharded_state_dict" in outcome.detail, outcome
    assert "pinned versions" in outcome.next_step
