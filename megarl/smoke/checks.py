"""The smoke checks (`megarl.smoke`'s table), registered in the order they run."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from megarl.smoke.registry import Check, CheckFailed, Needs

# the suite's own tests of the GPU-only paths, run from the checkout megarl is installed from
REPO = Path(__file__).resolve().parents[2]


def _contracts(work: Path) -> str:
    problems: list[str] = []
    held = []
    if importlib.util.find_spec("megatron") is not None:
        from megarl.trainer.megatron_contract import check_megatron_contract

        problems += check_megatron_contract()
        held.append("megatron-core")
    if importlib.util.find_spec("transformer_engine") is not None:
        import transformer_engine

        from megarl.trainer.megatron_contract import check_te_contract

        problems += check_te_contract(transformer_engine)
        held.append("Transformer Engine")
    if importlib.util.find_spec("vllm") is not None:
        from megarl.sync.vllm_contract import check_vllm_contract

        problems += check_vllm_contract()
        held.append("vLLM (both model runners)")
    if not held:
        raise CheckFailed("neither megatron-core nor vLLM is installed here", "run it in the trainer's or the fleet's "
                          "environment (docs/gpu.md)")
    (work / "problems.txt").write_text("".join(f"{p}\n" for p in problems))
    if problems:
        more = f" (and {len(problems) - 1} more: {work / 'problems.txt'})" if len(problems) > 1 else ""
        raise CheckFailed(problems[0] + more, "install the pinned versions (`megarl preflight versions --stack ...`, "
                          "docs/gpu.md), or re-read the changed library source before moving the pin")
    return f"every name megarl touches holds in {', '.join(held)}"


def _layer_spec(work: Path) -> str:
    import torch

    from megarl.models.layer_backend import (
        TransformerEngineMissing,
        precision_problem,
        resolve_layer_spec,
        te_installed,
    )

    cuda = torch.cuda.is_available()
    try:
        spec = resolve_layer_spec("auto", cuda, te_installed())
    except TransformerEngineMissing as err:
        raise CheckFailed(str(err).split(": ", 1)[1], "run the trainer in its container (docs/gpu.md)") from None
    problem = precision_problem(spec, "bf16")
    if problem is not None:  # never for bf16: the refusal is fp32's
        raise CheckFailed(problem, "report it: bf16 is the precision TE's spec runs in")
    if spec == "te":
        return "trainer ranks here build Transformer Engine's layer spec; train with trainer.precision=bf16"
    return "trainer ranks here build megatron's local spec (no GPU: the CPU stack)"


def _checkpoint(work: Path) -> str:
    from megarl.smoke.trainer_checks import checkpoint_round_trip

    return checkpoint_round_trip(work)


def _te_packed(work: Path) -> str:
    from megarl.smoke.trainer_checks import te_packed_step

    return te_packed_step(work)


def _pytest(*node_ids: str, limit_s: float) -> Callable[[Path], str]:
    """A check that runs these tests of the suite in their own process (they start their own fleet), within
    `limit_s` seconds, its output kept in the check's work directory."""

    def check(work: Path) -> str:
        missing = [n for n in node_ids if not (REPO / n.split("::")[0]).is_file()]
        if missing:
            raise CheckFailed(f"the suite's tests are not here ({', '.join(missing)})",
                              "run megarl smoke from the checkout megarl is installed from (pip install -e)")
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", *node_ids]
        log = work / "pytest.log"
        try:
            with log.open("w") as out:
                code = subprocess.run(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=limit_s,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"did not finish within {limit_s:.0f} s", f"read {log}") from None
        last = (log.read_text().strip().splitlines() or ["no output"])[-1]
        if code != 0:
            raise CheckFailed(f"pytest exit {code}: {last}", f"read {log}")
        return last

    return check


# the checks, in the order they run
FULL_PUSH = "tests/test_weight_sync.py::test_sync_moves_exactly_each_ranks_slices"
DELTA_PUSH = "tests/test_weight_sync.py::test_delta_pushes_from_an_expert_parallel_trainer"
NCCL_SYNC = "tests/test_sync_gpu.py::test_partitioned_sync_over_nccl_moves_exactly_each_ranks_slices[tp1]"
CHECKS: list[Check] = [
    Check("contracts", "library names megarl touches", Needs(), _contracts),
    Check("layer-spec", "the layer spec a trainer rank builds here", Needs(), _layer_spec),
    Check("checkpoint", "distributed-optimizer checkpoint saved and resumed", Needs(), _checkpoint),
    Check("te-packed-bf16", "TE layer spec forward/backward on THD-packed bf16 sequences", Needs(gpus=1, te=True),
          _te_packed),
    Check("vllm-pushes", "vLLM GPU fleet: full and in-flight pushes (keep, recompute), held counts",
          Needs(gpus=2, vllm=True), _pytest(FULL_PUSH, "tests/test_inflight_push.py", limit_s=240)),
    Check("delta-push", "delta pushes into a vLLM GPU fleet", Needs(gpus=2, vllm=True),
          _pytest(DELTA_PUSH, limit_s=120)),
    Check("nccl-sync", "partitioned sync over an NCCL group", Needs(gpus=3, vllm=True),
          _pytest(NCCL_SYNC, limit_s=120)),
    Check("routing-replay", "vLLM's routed experts replayed by the trainer", Needs(gpus=1, vllm=True),
          _pytest("tests/test_routing_replay_gpu.py", limit_s=120)),
]
