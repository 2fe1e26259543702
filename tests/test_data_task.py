"""The data stream and tasks: batch l is a pure function of (l, B, seed) (also in a fresh process), every epoch is a
permutation with its own order, positions are hand-computed, resume checks refuse other data, the prompt-length
filter drops exactly the rows a hand count says, and validate() reports the files."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config.schema import Config
from megarl.data.arithmetic import Problem as ArithmeticProblem
from megarl.data.arithmetic import problem_batch
from megarl.data.datasets import epoch_order, stream_rows
from megarl.data.formats import DataFormatError
from megarl.data.problem import Problem
from megarl.data.samples import SAMPLES_DIR
from megarl.data.task import ArithmeticTask, DataPositionError, DatasetTask, build_task, validate
from megarl.rewards.registry import RewardConfigError
from tests.data_fixtures import word_tokenizer

GSM8K = SAMPLES_DIR / "gsm8k_sample.jsonl"
INSTRUCTION = "Put the answer after ####."


def _config(**data) -> Config:
    return Config(model={"hf_dir": "unused"}, run={"seed": 3}, data=data)


def _gsm8k(batch: int = 10, **data) -> Config:
    return _config(task="gsm8k", train_files=[str(GSM8K)], prompts_per_step=batch, instruction=INSTRUCTION, **data)


def test_each_epoch_is_a_new_permutation_and_batches_tile_the_stream():
    n, seed = 10, 7
    stream = [row for batch in range(9) for row in stream_rows(batch * 4, 4, n, seed, True)]  # 36 = 3.6 epochs
    for epoch in range(3):
        assert sorted(stream[epoch * n:(epoch + 1) * n]) == list(range(n))  # each row once per epoch
    assert len({tuple(stream[e * n:(e + 1) * n]) for e in range(3)}) == 3  # a new order every epoch
    assert stream[8:12] == [*epoch_order(n, seed, 0, True)[8:], *epoch_order(n, seed, 1, True)[:2]]  # wraps
    assert stream_rows(12, 4, n, seed, False) == [2, 3, 4, 5]  # unshuffled: file order, epoch after epoch
    assert stream_rows(0, n, n, seed + 1, True) != stream[:n]  # the seed matters


def test_the_stream_is_the_same_in_a_fresh_process():
    code = "from megarl.data.datasets import stream_rows; print(stream_rows(37, 20, 24, 3, True))"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == stream_rows(37, 20, 24, 3, True)


def test_dataset_task_problems_positions_and_log_text():
    task = build_task(_gsm8k(), word_tokenizer(chat=False))
    assert isinstance(task, DatasetTask) and len(task) == 24
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    problems = task.problems(2)  # stream positions 20..29: rows 20..23 of epoch 0, then 0..5 of epoch 1
    order0, order1 = epoch_order(24, 3, 0, True), epoch_order(24, 3, 1, True)
    assert [p.index for p in problems] == [*order0[20:], *order1[:6]]
    for p in problems:
        assert p.prompt == rows[p.index]["question"] + "\n" + INSTRUCTION  # raw: no chat template
        assert p.answer == rows[p.index]["answer"].rsplit("#### ", 1)[1].replace(",", "")
        assert p.data_source == "gsm8k"
    assert task.problems(2) == problems  # deterministic
    assert task.position(2) == {"task": "gsm8k", "fingerprint": task.position(0)["fingerprint"], "rows": 24,
                                     "seed": 3, "shuffle": True, "batch_size": 10, "batch": 2, "epoch": 0,
                                     "index": 20}
    assert (task.position(3)["epoch"], task.position(3)["index"]) == (1, 6)  # position 30 = 24 + 6
    first = task.problems(0)[:2]
    assert task.describe(2) == (f"--- prompt 0 (gold answer {first[0].answer!r}) ---\n{first[0].prompt}\n"
                                f"--- prompt 1 (gold answer {first[1].answer!r}) ---\n{first[1].prompt}")


def test_chat_template_applies_to_dataset_rows():
    cfg = _config(task="guru", train_files=[str(SAMPLES_DIR / "guru_math_sample.parquet")], shuffle=False)
    task = build_task(cfg, word_tokenizer(chat=True))
    problem = task.problems(0)[5]  # unshuffled: row 5, which has a system message
    assert problem.prompt == ("<|system|>\nYou are a careful mathematician.\n<|user|>\nWhat is the remainder when "
                              "$192$ is divided by $3$? Please output the final answer within \\boxed{}.\n"
                              "<|assistant|>\n")
    assert problem.answer == "0" and 192 % 3 == 0


def test_resume_check_accepts_the_same_data_and_refuses_other_data(tmp_path):
    tokenizer = word_tokenizer(chat=False)
    saved = build_task(_gsm8k(), tokenizer).position(5)
    copy = tmp_path / "copy.jsonl"
    shutil.copy(GSM8K, copy)
    cfg = _config(task="gsm8k", train_files=[str(copy)], prompts_per_step=10, instruction=INSTRUCTION)
    build_task(cfg, tokenizer).check_position(saved)  # the same content elsewhere: accepted
    edited = tmp_path / "edited.jsonl"
    edited.write_text(GSM8K.read_text().replace("Mia buys 5 boxes", "Mia buys 6 boxes"))
    other = build_task(_config(task="gsm8k", train_files=[str(edited)], prompts_per_step=10), tokenizer)
    with pytest.raises(DataPositionError, match="fingerprint: checkpoint '[0-9a-f]{64}', now '[0-9a-f]{64}'"):
        other.check_position(saved)
    with pytest.raises(DataPositionError, match="batch_size: checkpoint 10, now 8"):
        build_task(_gsm8k(batch=8), tokenizer).check_position(saved)
    with pytest.raises(DataPositionError, match="task: checkpoint 'gsm8k', now 'arithmetic'"):
        build_task(_config(), tokenizer).check_position(saved)


def test_prompt_length_filter_drops_long_prompts_and_says_how_many(caplog):
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    words = [len(f"{row['question']}\n{INSTRUCTION}".split()) for row in rows]  # one token per word
    limit = min(words)  # keeps the short (crate) questions, drops the longer (pencil) ones
    expected_kept = [i for i, n in enumerate(words) if n <= limit]
    assert 0 < len(expected_kept) < len(rows)
    with caplog.at_level(logging.WARNING, logger="megarl.data.task"):
        task = build_task(_gsm8k(max_prompt_tokens=limit), word_tokenizer(chat=False))
    assert len(task) == len(expected_kept) and task.dropped == len(rows) - len(expected_kept)
    assert [r.row for r in task.records] == expected_kept
    warnings = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert warnings == [f"data: dropped {task.dropped} of 24 prompts longer than data.max_prompt_tokens={limit} "
                        f"tokens ({GSM8K})"]
    assert all(len(p.prompt.split()) <= limit for p in task.problems(0))
    with pytest.raises(ValueError, match=rf"drops every prompt .* \(the shortest has {min(words)} tokens\)"):
        build_task(_gsm8k(max_prompt_tokens=min(words) - 1), word_tokenizer(chat=False))


def test_arithmetic_task_keeps_the_synthetic_batches():
    cfg = _config(prompts_per_step=5, max_operand=3)
    task = build_task(cfg, tokenizer=None)
    assert isinstance(task, ArithmeticTask)
    assert task.problems(4) == problem_batch(4, 5, 3, seed=3)
    assert ArithmeticProblem is Problem and Problem("1 + 2 =", "3") == Problem(prompt="1 + 2 =", answer="3")
    task.check_position(task.position(4))
    with pytest.raises(DataPositionError, match="max_operand: checkpoint 3, now 4"):
        build_task(_config(prompts_per_step=5), None).check_position(task.position(4))


def test_eval_split_is_unshuffled_file_order():
    cfg = _config(task="math", train_files=[str(SAMPLES_DIR / "math_sample.parquet")],
                  eval_files=[str(SAMPLES_DIR / "math500_sample.jsonl")])
    evaluation = build_task(cfg, word_tokenizer(chat=False), split="eval")
    rows = [json.loads(line) for line in (SAMPLES_DIR / "math500_sample.jsonl").read_text().splitlines()]
    assert [(p.prompt, p.answer) for p in evaluation.all_problems()] == [(r["problem"], r["answer"]) for r in rows]
    with pytest.raises(ValueError, match="no data.eval_files"):
        build_task(_gsm8k(), word_tokenizer(chat=False), split="eval")


def test_validate_reads_every_file_and_the_reward(tmp_path):
    cfg = _config(task="math", train_files=[str(SAMPLES_DIR / "math_sample.parquet")],
                  eval_files=[str(SAMPLES_DIR / "math500_sample.jsonl")])
    cfg.reward.name = "math_verify"
    assert validate(cfg) == [f"data: train file {SAMPLES_DIR / 'math_sample.parquet'}: 24 math rows",
                             f"data: eval file {SAMPLES_DIR / 'math500_sample.jsonl'}: 24 math rows"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "p", "solution": "no box"}\n')
    with pytest.raises(DataFormatError, match="bad.jsonl: row 0: field 'solution'"):
        validate(_config(task="math", train_files=[str(bad)]))
    with pytest.raises(FileNotFoundError, match="missing.parquet does not exist"):
        validate(_config(task="guru", train_files=[str(tmp_path / "missing.parquet")]))
    cfg = _config()
    cfg.reward.name = "no_such_pkg_xyz.rewards:score"
    with pytest.raises(RewardConfigError, match="'no_such_pkg_xyz.rewards:score'"):
        validate(cfg)
