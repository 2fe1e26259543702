"""The smoke checks' types: what a check needs of the node, how it fails, and its one line of outcome."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Status = Literal["pass", "fail", "skipped"]
TIME_LIMIT_S = 600.0  # the whole command, on one node


class CheckFailed(Exception):
    """A check's failure: `str(self)` says what went wrong, `next_step` what to do about it."""

    def __init__(self, problem: str, next_step: str) -> None:
        super().__init__(problem)
        self.next_step = next_step


@dataclass(frozen=True)
class Node:
    """What this node has, as the checks' `needs` are judged."""

    gpus: int
    te: bool
    vllm: bool

    @classmethod
    def here(cls) -> Node:
        import torch

        find = importlib.util.find_spec
        return cls(gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0,
                   te=find("transformer_engine") is not None, vllm=find("vllm") is not None)


@dataclass(frozen=True)
class Needs:
    """A check's requirements: `gpus` CUDA devices (0: none), Transformer Engine, vLLM."""

    gpus: int = 0
    te: bool = False
    vllm: bool = False

    def missing(self, node: Node) -> str | None:
        """Why `node` cannot run the check (the SKIPPED line's reason), or None."""
        if node.gpus < self.gpus:
            have = "no GPU" if node.gpus == 0 else f"{node.gpus} GPU(s)"
            return f"needs {'a GPU' if self.gpus == 1 else f'{self.gpus} GPUs'} ({have} here)"
        if self.te and not node.te:
            return "needs Transformer Engine (run it in the trainer's container: docs/gpu.md)"
        if self.vllm and not node.vllm:
            return "needs vLLM (run it in the fleet's environment: docs/gpu.md)"
        return None


@dataclass(frozen=True)
class Check:
    name: str
    what: str
    needs: Needs
    run: Callable[[Path], str] = field(repr=False)  # work directory -> the PASS line's detail; raises CheckFailed


@dataclass(frozen=True)
class Outcome:
    name: str
    status: Status
    detail: str
    next_step: str = ""
    seconds: float = 0.0

    def line(self) -> str:
        label = {"pass": "PASS", "fail": "FAIL", "skipped": "SKIPPED"}[self.status]
        tail = f" -> {self.next_step}" if self.next_step else ""
        return f"{label:<8}{self.name:<16}{self.detail}{tail}"
