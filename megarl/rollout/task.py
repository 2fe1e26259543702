"""The task side of rollouts: which problems batch `l` holds (`data.task`: megarl/data/task.py), how prompts are
tokenized, the sampling arguments and seeds, the reward (`reward.name`: megarl/rewards/registry.py) and the held-out
evaluation. `start_rollout_worker` wires them into a `RolloutWorker`.

Problems and seeds of batch `l` are a deterministic function of `l`, the data and `run.seed`, so which version
generates which batch is decided by the schedule alone, and a resumed run regenerates nothing it saved and continues
the data stream where the checkpoint left it (checked against the position the checkpoint recorded).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from megarl.batch import RolloutBatch
from megarl.config.schema import Config
from megarl.data.arithmetic import problem_batch
from megarl.data.problem import Problem
from megarl.data.task import build_task
from megarl.metrics.timeline import Timeline
from megarl.rewards.pool import RewardPool
from megarl.rewards.registry import reward_function
from megarl.rewards.scoring import BatchScorer
from megarl.rollout.client import RolloutClient
from megarl.rollout.evaluation import Evaluator
from megarl.rollout.partial import CarriedGroups
from megarl.rollout.worker import PartialRollouts, RolloutWorker
from megarl.schedule import VersionClock

logger = logging.getLogger(__name__)
PROMPTS_FILE = "prompts.txt"  # in run.dir: the exact text of the first prompts, written once per run


def start_rollout_worker(cfg: Config, clients: list[RolloutClient], timeline: Timeline, clock: VersionClock,
                         start: int = 0, ready: dict[int, RolloutBatch] | CarriedGroups | None = None,
                         data_position: dict[str, Any] | None = None) -> RolloutWorker:
    """The run's rollout worker, generating from batch `start` on (`ready`: batches a checkpoint saved, or its
    groups with partial rollouts; `data_position`: the data position it recorded, checked against this run's data),
    following the run's version clock `clock` (its schedule, staleness bound and salts). With `sync.inflight` it runs
    partial rollouts (`megarl.rollout.partial`)."""
    r = cfg.rollout
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.model.hf_dir))
    task = build_task(cfg, tokenizer)
    if data_position is not None:
        task.check_position(data_position)
    text = task.describe()
    Path(cfg.run.dir, PROMPTS_FILE).write_text(text + "\n")
    logger.info("data: the first prompts of the run, as the engine gets them:\n%s", text)
    prompts_per_batch = cfg.data.prompts_per_step
    rewards = RewardPool(reward_function(cfg.reward.name), workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s)
    try:
        def encode(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        scorer = BatchScorer(rewards, lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        evaluator = None
        if cfg.eval.interval:
            evaluator = _evaluator(cfg, clients, encode, scorer, _eval_problems(cfg, tokenizer))
        return RolloutWorker(
            clients, clock, problems=task.problems, encode=encode,
            sampling={"n": r.samples_per_prompt, "max_tokens": r.max_new_tokens, "temperature": r.temperature,
                      "top_p": r.top_p, **({"min_tokens": r.min_new_tokens} if r.min_new_tokens else {})},
            seed=lambda index: cfg.run.seed * 100_003 + index * prompts_per_batch,
            score=scorer, timeline=timeline, end=cfg.run.steps, overlap=r.overlap, start=start, ready=ready,
            evaluator=evaluator, position=task.position, chunk_prompts=r.chunk_prompts,
            chunks_in_flight=cfg.rollout_chunks_in_flight(),
            replica_log=lambda i: replica_log(cfg.run.dir, i), min_replicas=r.min_replicas,
            partial=PartialRollouts(prompts_per_batch, clock.bound, cfg.sync.inflight_abort_doomed)
            if cfg.sync.inflight else None,
        )
    except BaseException:
        rewards.close()
        raise


def replica_log(run_dir: str | Path, replica: int) -> str:
    """Where replica `replica`'s vLLM server writes: <run.dir>/logs/ on a cluster job, <run.dir>/ when `megarl
    train` started the fleet; either path if neither exists yet (a fleet started elsewhere)."""
    paths = [Path(run_dir) / "logs" / f"vllm_replica{replica}.log", Path(run_dir) / f"vllm_replica{replica}.log"]
    found = [str(p) for p in paths if p.is_file()]
    return found[0] if found else " or ".join(map(str, paths))


EVAL_BATCH_INDEX = -1  # the arithmetic held-out set: its own seed stream, apart from training batches 0, 1, ...


def _eval_problems(cfg: Config, tokenizer) -> list[Problem]:
    """The held-out set: arithmetic draws its own fixed set; dataset tasks take the first rows of data.eval_files."""
    d, e = cfg.data, cfg.eval
    if d.task == "arithmetic":
        return problem_batch(EVAL_BATCH_INDEX, e.prompts, d.max_operand, cfg.run.seed, digits=d.answer_digits)
    return build_task(cfg, tokenizer, split="eval").all_problems()[:e.prompts]


def _evaluator(cfg: Config, clients: list[RolloutClient], encode, scorer: BatchScorer,
               problems: list[Problem]) -> Evaluator:
    """The same prompts and sampling seeds at every evaluation, so two evaluations differ only by the weights."""
    e = cfg.eval
    sampling = {"n": e.samples, "max_tokens": e.max_new_tokens or cfg.rollout.max_new_tokens,
                "temperature": e.temperature, "top_p": 1.0}
    return Evaluator(clients, problems, encode, scorer, sampling, seed=cfg.run.seed * 100_003 - 1_000_003)
