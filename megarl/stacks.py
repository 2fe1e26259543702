"""The pinned dependency sets ("stacks"), one per role, and how their lock files in `locks/` are resolved.

A stack is an extra of pyproject.toml resolved for one Python and one platform from wheels only (`uv pip compile
--no-build`) into `locks/<name>.txt`. `python -m megarl.stacks` (`make locks`) regenerates them;
tests/test_locks.py re-resolves each one and fails when the lock and pyproject.toml disagree; `megarl preflight`
compares a step's installed torch / megatron-core / vLLM / Transformer Engine with its role's lock.

    cpu          both roles on a CPU machine (the test suite's venv), Python 3.11; torch's +cpu build comes from the
                 wheels pip is configured with (find-links) or PyTorch's CPU index; torchvision, torchaudio and
                 torchcodec are left out (the Makefile uninstalls them: they break transformers' imports)
    gpu-trainer  the trainer on GPUs, Python 3.12, inside TRAINER_IMAGE: the image provides torch and Transformer
                 Engine (CONTAINER_PROVIDES), so they are overridden out of the resolution and the lock holds the
                 rest (megatron-core, transformers, megarl's own dependencies)
    gpu-fleet    the vLLM fleet on GPUs, Python 3.12: the vllm wheel with vLLM's own torch pin
    gpu-single   both roles in one venv on one GPU machine (what `make env` installs where nvidia-smi exists, and
                 what a job whose steps share one environment runs): gpu-fleet + gpu-trainer on vLLM's torch,
                 without Transformer Engine

Standard library only: the preflight imports it on every node.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCKS_ENV = "MEGARL_LOCKS_DIR"
# The trainer's image: the NGC PyTorch release megatron-core 0.16.1's own CI names as its development image
# (Megatron-LM core_v0.16.1, docker/.ngc_version.dev); published listings of it: CUDA 13.0.2, Python 3.12, NCCL 2.28.8.
TRAINER_IMAGE = "nvcr.io/nvidia/pytorch:25.11-py3"
# What TRAINER_IMAGE provides (not installed from the lock; checked by the preflight). torch: the image's build
# string; Transformer Engine 2.9 as its listings give it, inside megatron-core 0.16.1's declared range
# (transformer-engine>=2.9.0a0,<2.12.0 in its `dev` extra). Neither was read from the image here (docs/gpu.md).
CONTAINER_PROVIDES = {"torch": "2.10.0a0+b558c986e8.nv25.11", "transformer-engine": "2.9.*"}
PLATFORM = "x86_64-manylinux_2_31"  # glibc >= 2.31: vllm 0.32.0 needs llguidance 1.7, whose wheels are 2_31
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
COMPILE_COMMAND = "make locks"


@dataclass(frozen=True)
class Stack:
    name: str  # the lock's file name: locks/<name>.txt
    extras: tuple[str, ...]  # the pyproject extras it resolves (with megarl's own dependencies)
    python: str
    drop: tuple[str, ...] = ()  # packages overridden out of the resolution (provided otherwise, or removed)
    provides: dict[str, str] = field(default_factory=dict)  # versions a container provides instead of the lock
    cpu_wheels: bool = False  # torch's +cpu build: from pip's find-links, else PyTorch's CPU index


STACKS = {
    "cpu": Stack("cpu", ("cpu",), "3.11", drop=("torchvision", "torchaudio", "torchcodec"), cpu_wheels=True),
    "gpu-trainer": Stack("gpu-trainer", ("gpu-trainer",), "3.12", drop=tuple(CONTAINER_PROVIDES),
                         provides=dict(CONTAINER_PROVIDES)),
    "gpu-fleet": Stack("gpu-fleet", ("gpu-fleet",), "3.12"),
    "gpu-single": Stack("gpu-single", ("gpu-fleet", "gpu-trainer"), "3.12"),
}
STACK_ENV = "MEGARL_STACK"  # names the stack a step runs, where the default below is not it (gpu-single)


def stack_for(role: str, gpu: bool, env: dict[str, str] | None = None) -> Stack:
    """The stack a cluster step runs: `$MEGARL_STACK` if set, else by role (`rank`: a trainer rank, `serve`: a
    replica) on a GPU node, else the CPU stack."""
    chosen = (os.environ if env is None else env).get(STACK_ENV)
    if chosen:
        if chosen not in STACKS:
            raise ValueError(f"{STACK_ENV}={chosen}: the stacks are {', '.join(STACKS)}")
        return STACKS[chosen]
    if not gpu:
        return STACKS["cpu"]
    return STACKS["gpu-trainer" if role == "rank" else "gpu-fleet"]


def locks_dir() -> Path:
    """`$MEGARL_LOCKS_DIR`, else the checkout's locks/ (megarl installed editable, as every recipe does)."""
    return Path(os.environ.get(LOCKS_ENV) or REPO / "locks")


def normalize(name: str) -> str:
    """PEP 503: `Transformer_Engine` and `transformer-engine` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(text: str) -> dict[str, str]:
    """`name==version` lines of a lock (uv's output), by normalized name."""
    pins = {}
    for line in text.splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;#\\]+)", line.strip())
        if match:
            pins[normalize(match.group(1))] = match.group(2)
    return pins


def version_matches(installed: str, pinned: str) -> bool:
    """A lock pins the exact build it installs: `2.13.0` (PyPI's torch) is not `2.13.0+cpu` (a CPU build that
    would serve nothing on a GPU). `2.9.*` (what a container provides, known by release only) accepts every 2.9
    release and its local builds (`2.9.0+70f53666`)."""
    if pinned.endswith(".*"):
        public = installed.split("+", 1)[0]
        return public == pinned[:-2] or public.startswith(pinned[:-1])
    return installed == pinned


def uv_binary() -> str:
    """uv from the `dev` extra (the `uv` package knows where its binary is), else the one on PATH."""
    try:
        from uv import find_uv_bin  # type: ignore[import-not-found]

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        pass
    beside = Path(sys.executable).parent / "uv"
    if beside.exists():
        return str(beside)
    found = shutil.which("uv")
    if found is None:
        raise FileNotFoundError("uv is not installed: it comes with the dev extra (pip install -e '.[dev]', which "
                                "`make env` runs)")
    return found


def _pip_find_links() -> list[str]:
    """The find-links pip is configured with (PIP_FIND_LINKS, else `pip config get global.find-links`): where this
    machine's pip gets torch's +cpu build, so the CPU lock names the build `make env` installs."""
    value = os.environ.get("PIP_FIND_LINKS")
    if not value:
        done = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                              capture_output=True, text=True)
        value = done.stdout.strip() if done.returncode == 0 else ""
    return value.split()


def compile_command(stack: Stack, out: Path, overrides: Path | None) -> list[str]:
    """The `uv pip compile` that writes `out` (an existing `out` is read as preferences: its pins are kept unless
    pyproject.toml no longer allows them)."""
    cmd = [uv_binary(), "pip", "compile", str(REPO / "pyproject.toml"),
           *(arg for extra in stack.extras for arg in ("--extra", extra)), "--python-version", stack.python,
           "--python-platform", PLATFORM, "--no-build", "--no-python-downloads",
           "--custom-compile-command", COMPILE_COMMAND, "--quiet", "--output-file", str(out)]
    if overrides is not None:
        cmd += ["--override", str(overrides)]
    if stack.cpu_wheels:
        links = _pip_find_links()
        cmd += [arg for link in links for arg in ("--find-links", link)] if links else \
            ["--extra-index-url", PYTORCH_CPU_INDEX, "--index-strategy", "unsafe-best-match"]
    return cmd


def resolve(stack: Stack, out: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Resolve `stack` into `out` from wheels only; the packages it drops are overridden to a marker no platform
    has (`torch; sys_platform == 'never'`, as Megatron-LM does for its container builds)."""
    with tempfile.TemporaryDirectory(prefix="megarl-stack-") as tmp:
        overrides = None
        if stack.drop:
            overrides = Path(tmp) / "overrides.txt"
            overrides.write_text("".join(f"{name}; sys_platform == 'never'\n" for name in stack.drop))
        return subprocess.run(compile_command(stack, out, overrides), capture_output=True, text=True,
                              timeout=timeout, cwd=REPO)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.stacks", description="regenerate locks/<stack>.txt "
                                     "(existing pins are kept where pyproject.toml allows them; delete a lock to "
                                     "re-resolve it from scratch)")
    parser.add_argument("stacks", nargs="*", metavar="STACK", help=f"which ({', '.join(STACKS)}; default all)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.stacks if name not in STACKS]
    if unknown:
        parser.error(f"unknown stack(s) {', '.join(unknown)}: the stacks are {', '.join(STACKS)}")
    directory = locks_dir()
    directory.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in args.stacks or list(STACKS):
        done = resolve(STACKS[name], directory / f"{name}.txt")
        if done.returncode != 0:
            failed += 1
            print(f"{name}: does not resolve from wheels:\n{done.stderr.strip()}", file=sys.stderr)
        else:
            print(f"{name}: {len(read_pins((directory / f'{name}.txt').read_text()))} pins in "
                  f"{directory / f'{name}.txt'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
