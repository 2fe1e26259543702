"""A task: which problems batch `l` holds, the record a checkpoint stores about its data position, and the text
of its first prompts for the run log. `build_task(cfg, tokenizer)` picks it from `data.task`; `validate(cfg)`
(for `megarl check`) opens the dataset files and checks their schema and the reward before anything starts.

- `ArithmeticTask`: the synthetic CPU-demo task (megarl/data/arithmetic.py), plain prompts, no files.
- `DatasetTask`: rows of `data.train_files` (or `eval_files`) in a `megarl.data.formats` format, rendered by
  `megarl.data.prompts`, filtered by `data.max_prompt_tokens`, streamed in seeded epochs (megarl/data/datasets.py).
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from megarl.config.schema import Config, DataConfig
from megarl.data.arithmetic import problem_batch
from megarl.data.datasets import fingerprint, load_records, stream_rows
from megarl.data.formats import Record
from megarl.data.problem import Problem
from megarl.data.prompts import describe_prompts, prompt_tokens, render_prompt

logger = logging.getLogger(__name__)


class DataPositionError(ValueError):
    """A checkpoint's data position does not belong to this run's data (different files, seed or batch size)."""


class Task(Protocol):
    def problems(self, batch_index: int) -> list[Problem]: ...

    def position(self, batch_index: int) -> dict[str, Any]: ...

    def check_position(self, saved: dict[str, Any]) -> None: ...

    def describe(self, count: int = 2) -> str: ...


def _check(saved: dict[str, Any], current: dict[str, Any], keys: tuple[str, ...]) -> None:
    """Raise DataPositionError naming every key of `keys` whose saved and current values differ."""
    differ = [f"{k}: checkpoint {saved.get(k)!r}, now {current[k]!r}" for k in keys if saved.get(k) != current[k]]
    if differ:
        raise DataPositionError(
            "the checkpoint was written for other data than this run's (" + "; ".join(differ) + "): resume with "
            "the data.* settings and files it was written with, or start a new run (a new run.dir)"
        )


class ArithmeticTask:
    """The synthetic addition task; batch l is `problem_batch(l, ...)`."""

    def __init__(self, data: DataConfig, seed: int) -> None:
        self._batch = partial(problem_batch, size=data.prompts_per_step, max_operand=data.max_operand, seed=seed,
                              digits=data.answer_digits)
        self._record = {"task": "arithmetic", "seed": seed, "batch_size": data.prompts_per_step,
                        "max_operand": data.max_operand, "answer_digits": data.answer_digits}

    def problems(self, batch_index: int) -> list[Problem]:
        return self._batch(batch_index)

    def position(self, batch_index: int) -> dict[str, Any]:
        return {**self._record, "batch": batch_index}

    def check_position(self, saved: dict[str, Any]) -> None:
        _check(saved, self._record, tuple(self._record))

    def describe(self, count: int = 2) -> str:
        problems = self.problems(0)[:count]
        return describe_prompts([p.prompt for p in problems], [p.answer for p in problems])


class DatasetTask:
    """Rows of dataset files, rendered and length-filtered once, streamed in seeded epochs (see datasets.py)."""

    def __init__(self, data: DataConfig, files: list[Path], tokenizer: Any, seed: int, shuffle: bool,
                 batch_size: int, fmt: str | None = None) -> None:
        fmt = fmt or data.task  # the files' row format (the eval files may have their own: data.eval_format)
        self._render = partial(render_prompt, tokenizer=tokenizer, template=data.prompt_template,
                               instruction=data.instruction)
        records = load_records(files, fmt)
        texts = [self._render(r.prompt) for r in records]
        self.dropped = 0
        if data.max_prompt_tokens is not None:
            lengths = prompt_tokens(texts, tokenizer)
            keep = [i for i, n in enumerate(lengths) if n <= data.max_prompt_tokens]
            self.dropped = len(records) - len(keep)
            if self.dropped:
                logger.warning("data: dropped %d of %d prompts longer than data.max_prompt_tokens=%d tokens (%s)",
                               self.dropped, len(records), data.max_prompt_tokens, ", ".join(map(str, files)))
            if not keep:
                raise ValueError(f"data.max_prompt_tokens={data.max_prompt_tokens} drops every prompt of "
                                 f"{', '.join(map(str, files))} (the shortest has {min(lengths)} tokens)")
            records, texts = [records[i] for i in keep], [texts[i] for i in keep]
        self.records: list[Record] = records
        self._texts, self._seed, self._shuffle, self._batch_size = texts, seed, shuffle, batch_size
        self._record = {"task": fmt, "fingerprint": fingerprint(files), "rows": len(records), "seed": seed,
                        "shuffle": shuffle, "batch_size": batch_size}

    def __len__(self) -> int:
        return len(self.records)

    def problem(self, i: int) -> Problem:
        """Row i (after the filter) as a Problem."""
        r = self.records[i]
        return Problem(prompt=self._texts[i], answer=r.answer, data_source=r.data_source, index=i)

    def all_problems(self) -> list[Problem]:
        """Every row, in file order (for evaluation sets)."""
        return [self.problem(i) for i in range(len(self))]

    def problems(self, batch_index: int) -> list[Problem]:
        rows = stream_rows(batch_index * self._batch_size, self._batch_size, len(self), self._seed, self._shuffle)
        return [self.problem(i) for i in rows]

    def position(self, batch_index: int) -> dict[str, Any]:
        """Where batch `batch_index` starts: epoch, index within the epoch, and what identifies the data."""
        start = batch_index * self._batch_size
        return {**self._record, "batch": batch_index, "epoch": start // len(self), "index": start % len(self)}

    def check_position(self, saved: dict[str, Any]) -> None:
        _check(saved, self._record, tuple(self._record))

    def describe(self, count: int = 2) -> str:
        problems = self.problems(0)[:count]
        return describe_prompts([p.prompt for p in problems], [p.answer for p in problems])


def build_task(cfg: Config, tokenizer: Any, split: str = "train") -> ArithmeticTask | DatasetTask:
    """The run's task from `data.task`: the training stream (`split="train"`), or for `split="eval"` the
    `data.eval_files` rows, unshuffled (`all_problems()`)."""
    d = cfg.data
    if d.task == "arithmetic":
        if split != "train":
            raise ValueError("the arithmetic task has no eval split (data.eval_files is for dataset tasks)")
        return ArithmeticTask(d, cfg.run.seed)
    if split == "train":
        return DatasetTask(d, list(d.train_files), tokenizer, cfg.run.seed, d.shuffle, d.prompts_per_step)
    if split == "eval":
        if not d.eval_files:
            raise ValueError("no data.eval_files: the eval split of a dataset task needs them")
        return DatasetTask(d, list(d.eval_files), tokenizer, cfg.run.seed, False, d.prompts_per_step,
                           fmt=d.eval_format or d.task)
    raise ValueError(f"unknown split {split!r} (expected 'train' or 'eval')")


def validate(cfg: Config) -> list[str]:
    """Open every dataset file, check every row against the format, import the reward function; one summary line
    per file (for `megarl check`). Raises DataFormatError / FileNotFoundError / RewardConfigError naming the
    problem. Prompts are not rendered here (that needs the tokenizer): build_task checks those."""
    from megarl.rewards.registry import load_reward

    load_reward(cfg.reward.name)
    d = cfg.data
    if d.task == "arithmetic":
        return [f"data: arithmetic task (operands 0..{d.max_operand}), no files"]
    lines = []
    for kind, files, fmt in (("train", d.train_files, d.task), ("eval", d.eval_files, d.eval_format or d.task)):
        for path in files:
            records = load_records([Path(path)], fmt)
            lines.append(f"data: {kind} file {path}: {len(records)} {fmt} rows")
    return lines
