"""Evaluation during training: a fixed held-out prompt set, sampled through the same fleet, scored like training.

Every `eval.interval` steps the controller (trainer rank 0) calls the evaluator at the start of the step, after
that step's push if it has one and before it takes its batch. The fleet then holds the weights of its last push
(`eval/policy_version`, reported by the engine for every sample; it trails the trainer by up to
`sync.interval + sync.offset - 1` versions, exactly like the training batches generated at that time).
Evaluation never pushes weights and never changes the rollout worker's state: its requests share the servers
with the batches being generated ahead, so the lag schedule and the training data are the same with or
without it (only wall time changes). Metrics, per evaluation (K = `eval.samples`):

    eval/mean@K   mean reward over every prompt's K samples (accuracy, for 0/1 rewards)
    eval/pass@K   share of prompts with at least one correct sample (reward >= 1), the unbiased estimator
                  of Chen et al. 2021 with n = k = K
    eval/replicas_lost  replicas that stopped answering during this evaluation

A replica that stops answering mid-evaluation (`RolloutServerLost`) is reported through `on_lost` (the rollout
worker takes it out, as it does when one dies generating a batch) and its unfinished prompts are split over the
replicas left; prompt i is seeded by its index, so the metrics are those of an evaluation on the survivors alone.
With no replica left the evaluation raises.

Every evaluation sends the same prompts, so their cached prompt blocks would be reused from one evaluation to the
next, across pushes, wherever a push leaves the prefix cache (with `sync.inflight_kv=keep`). The run salts each
request with the version its replica serves (`salt`, the run's `megarl.schedule.VersionClock.salt`, vLLM's
`cache_salt`): blocks are reused only between requests that run under the same weights.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from megarl.data.problem import Problem
from megarl.rewards.scoring import BatchScorer
from megarl.rollout.client import RolloutClient, RolloutServerLost, Sample


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k from n samples of which `correct` are right: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code", eq. 1)."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= correct <= n and 1 <= k <= n (n={n}, correct={correct}, k={k})")
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


class Evaluator:
    """Samples `sampling["n"]` responses for each of `problems` on the fleet's replicas (the k-th live replica
    takes prompts k, k + R, ...; all replicas at once), scores them with `scorer`, and returns the `eval/...`
    metrics."""

    def __init__(self, clients: list[RolloutClient], problems: Sequence[Problem], encode: Callable[[str], list[int]],
                 scorer: BatchScorer, sampling: dict, seed: int) -> None:
        if not problems:
            raise ValueError("evaluation needs at least one held-out prompt")
        self.clients, self.problems, self.scorer, self.sampling, self.seed = clients, problems, scorer, sampling, seed
        self._prompts = [encode(p.prompt) for p in problems]
        self.k = int(sampling["n"])

    def __call__(self, clients: dict[int, RolloutClient] | None = None,
                 on_lost: Callable[[int, str], None] | None = None,
                 salt: Callable[[int], str] | None = None) -> dict[str, float]:
        """The metrics, generated on `clients` (replica -> client; default: the ones it was built with; the rollout
        worker passes the replicas still serving). Prompt i is seeded by its index, so who serves it does not change
        what is sampled. `on_lost(replica, why)`: called for a replica that stops answering, whose prompts then go
        to the others. `salt(replica)`: the prefix-cache salt of a request sent to that replica now (vLLM's
        `cache_salt`; the rollout worker passes its clock's `VersionClock.salt`), read as each request is sent; None:
        unsalted."""
        start = time.perf_counter()
        live = dict(enumerate(self.clients)) if clients is None else dict(clients)
        samples: dict[int, list[Sample]] = {}
        todo, lost = list(range(len(self._prompts))), 0
        while todo:
            if not live:
                raise RolloutServerLost(f"evaluation: every rollout replica stopped answering ({len(todo)} of "
                                        f"{len(self._prompts)} held-out prompts left unsampled)")
            shares = {rep: todo[k::len(live)] for k, rep in enumerate(sorted(live))}
            with ThreadPoolExecutor(len(shares), thread_name_prefix="megarl-eval") as pool:
                futures = {rep: pool.submit(self._generate, live[rep], share,
                                            None if salt is None else lambda rep=rep: salt(rep))
                           for rep, share in shares.items()}
            todo = []
            for rep, future in futures.items():
                try:
                    samples.update(zip(shares[rep], future.result(), strict=True))
                except RolloutServerLost as err:
                    todo += shares[rep]
                    lost += 1
                    del live[rep]
                    if on_lost is not None:
                        on_lost(rep, f"{type(err).__name__}: {err}")
            todo.sort()
        return self._metrics([samples[i] for i in range(len(self.problems))], lost, start)

    def _generate(self, client: RolloutClient, prompts: list[int],
                  salt: Callable[[], str] | None = None) -> list[list[Sample]]:
        """Prompts `prompts` (indices) sampled on `client`, each seeded by its index, salted with `salt()` if given."""
        return client.generate([self._prompts[i] for i in prompts], **self.sampling,
                               seed=[self.seed + i for i in prompts], cache_salt=None if salt is None else salt())

    def _metrics(self, samples: list[list[Sample]], lost: int, start: float) -> dict[str, float]:
        rewards, timeouts, flags = self.scorer.rewards_of(self.problems, samples)
        versions = sorted({s.policy_version for group in samples for s in group})
        k = self.k
        flat = [x for group in rewards for x in group]
        correct = [sum(x >= 1.0 for x in group) for group in rewards]
        return {
            f"eval/mean@{k}": sum(flat) / len(flat),
            f"eval/pass@{k}": sum(pass_at_k(k, c, k) for c in correct) / len(correct),
            "eval/policy_version": versions[-1] if len(versions) == 1 else versions,
            "eval/response_tokens": sum(len(s.response_ids) for g in samples for s in g) / len(flat),
            "eval/prompts": len(self.problems),
            "eval/timeouts": timeouts,
            "eval/replicas_lost": lost,
            **{f"eval/{flag}": count for flag, count in flags.items()},
            "eval/seconds": time.perf_counter() - start,
        }
