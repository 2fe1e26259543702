"""The contract megarl holds with megatron-core 0.16.1 and Transformer Engine 2.9
(`megarl/trainer/megatron_contract.py`): it holds on the installed megatron-core, each entry's citation points at
the definition it names, a planted rename (one touched attribute, field or module name taken away with pytest's
monkeypatch, put back after) is reported by exactly that name, and TE's part holds on `tests/te_standin.py`'s
stand-in for TE 2.9's `FusedAdam` and flags a FusedAdam that keeps a per-parameter step. No process is started."""

from __future__ import annotations

import inspect
import re
import types
from pathlib import Path

import pytest
import torch

from megarl.trainer import megatron_contract as mc
from tests import te_standin


def test_the_contract_holds_on_the_installed_megatron() -> None:
    assert mc.check_megatron_contract() == []


def test_every_citation_is_the_definition_it_names() -> None:
    """For each entry whose target is a function or class: `read`'s file is the one it is defined in and the first
    line cited is the line its definition starts (decorators included): the citations were read, not guessed."""
    checked = 0
    for entry in mc.CONTRACT:
        obj = mc.resolve(entry.target)
        obj = inspect.unwrap(obj) if callable(obj) else obj  # a decorated method: its own definition
        imports = re.fullmatch(r"(megatron/\S+\.py):(\d+) \(import torch\)", entry.read)
        if isinstance(obj, types.ModuleType) and imports:  # the line binding the module's `torch`
            assert obj.__file__.endswith(imports[1]), entry
            assert Path(obj.__file__).read_text().splitlines()[int(imports[2]) - 1] == "import torch", entry
            checked += 1
            continue
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue  # a module, a flag or a set: cited by the lines that bind it
        cited = re.fullmatch(r"(megatron/\S+\.py):(\d+)(?:-(\d+))?", entry.read)
        assert cited, entry
        lines, start = inspect.getsourcelines(obj)
        assert inspect.getsourcefile(obj).endswith(cited[1]), (entry.target, entry.read)
        assert start == int(cited[2]), (entry.target, entry.read, start)
        if cited[3]:
            assert start + len(lines) - 1 == int(cited[3]), (entry.target, entry.read, start + len(lines) - 1)
        checked += 1
    assert checked >= 50


def test_a_renamed_method_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    monkeypatch.delattr(RouterReplay, "clear_router_replay_action")
    assert mc.check_megatron_contract() == [
        "megarl/trainer/routing_replay.py: megatron.core.transformer.moe.router_replay.RouterReplay: attribute "
        "'clear_router_replay_action' missing (megatron-core 0.16.1: megatron/core/transformer/moe/router_replay.py"
        ":18-161)"]


def test_a_renamed_config_field_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.distributed import DistributedDataParallelConfig

    monkeypatch.delitem(DistributedDataParallelConfig.__dataclass_fields__, "bucket_size")
    problems = mc.check_megatron_contract()
    assert len(problems) == 1 and "DistributedDataParallelConfig: field 'bucket_size' missing" in problems[0]
    assert problems[0].startswith("megarl/trainer/optimizer.py: ")


def test_a_renamed_te_flag_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flag megatron sets when TE's FusedAdam imports, which the TE stand-in rebinds and cpu_compat reads."""
    from megatron.core.optimizer import distrib_optimizer

    monkeypatch.delattr(distrib_optimizer, "USING_TE_OPTIMIZER")
    problems = mc.check_megatron_contract()
    assert len(problems) == 1 and "attribute 'USING_TE_OPTIMIZER' missing" in problems[0], problems


def test_te_contract_holds_on_the_standin() -> None:
    assert mc.check_te_contract(te_standin, attention=False) == []


class _PerParamStep(te_standin.FusedAdamStandIn):
    """A FusedAdam that, like torch's AdamW, counts its steps per parameter."""

    def step(self, closure=None, grad_scaler=None):  # noqa: ANN001, ANN201
        super().step(closure, grad_scaler)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["step"] = torch.tensor(float(group.pop("step")))


def test_te_contract_names_a_per_parameter_step() -> None:
    module = types.ModuleType("te_like")
    module.FusedAdam = _PerParamStep
    problems = mc.check_te_contract(module, attention=False)
    assert len(problems) == 1 and problems[0].startswith("FusedAdam keeps its step per parameter"), problems


def test_te_attention_env_check(tmp_path: Path) -> None:
    """The attention half against a TE-shaped tree: the backend selection file beside the optimizers package reads
    two of the three variables; the check names the third."""
    optimizers = tmp_path / "pytorch" / "optimizers"
    optimizers.mkdir(parents=True)
    (optimizers / "__init__.py").write_text("")
    utils = tmp_path / "pytorch" / mc.TE_ATTENTION_UTILS
    utils.parent.mkdir(parents=True)
    utils.write_text('import os\nflash = os.getenv("NVTE_FLASH_ATTN", "1")\nfused = os.getenv("NVTE_FUSED_ATTN")\n')
    module = types.ModuleType("te_like")
    module.__file__ = str(optimizers / "__init__.py")
    module.FusedAdam = te_standin.FusedAdamStandIn
    problems = mc.check_te_contract(module)
    assert len(problems) == 1 and "NVTE_UNFUSED_ATTN is not read" in problems[0], problems


@pytest.mark.gpu
def test_te_contract_on_real_te() -> None:
    """Where Transformer Engine is installed (the trainer container on a GPU node)."""
    optimizers = pytest.importorskip("transformer_engine.pytorch.optimizers")
    assert mc.check_te_contract(optimizers) == []
