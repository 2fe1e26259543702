"""Partial rollouts: which finished groups form batch `l` when groups keep generating through weight updates.

With in-flight weight updates (`sync.inflight`) a push does not wait for the groups the fleet is generating: they
are frozen in the engine, receive the new weights and go on (`megarl.rollout.inflight`). So a batch can no longer
be "the groups of home batch l": some of them are still generating when the trainer reaches step l. Instead

    the fleet generates a stream of groups, home batch by home batch (home batch j: the same problems and sampling
    seeds as batch j without partial rollouts, `megarl.rollout.task`); each finished group is scored and joins
    the pool (`GroupPool.add`), carrying its per-token versions (`Sample.token_versions`, from the engine);
    when the trainer takes batch l (at policy version l):
      1. every pooled group whose oldest token lags version l by more than the bound is dropped, and counted
         (it could only get older; the bound is `algorithm.max_token_lag`, by default the schedule's own
         maximum lag m + n - 1: `megarl.schedule.VersionClock.bound`);
      2. the P pooled groups of the lowest (home batch, prompt) form batch l, in that order; the trainer waits only
         while fewer than P are pooled. So when every group of home batch l has finished by then, batch l is exactly
         home batch l, as without partial rollouts; only a group still generating is replaced, by the next finished
         one. (AReaL takes the first P to finish instead: that mixes home batches even when nothing straggles, and
         favours groups of short responses, which finish first, over the home batch's others.)
    groups still generating then go on through the next pushes and join a later batch.

So the trainer never waits for the slowest response of a batch, only for P groups; a group is never trained
twice (a group leaves the pool once) nor lost (it is trained, dropped and counted, or still generating). The
fleet's window counts groups, not batches (`admission_limit`, AReaL's rule): while it holds version v it starts a
group only while the groups it has started stay within the ones batches 0 .. v + bound train, plus one for every
group dropped -- so a group started at version v can be trained within the bound. With the default bound this is
the schedule's own window (`SyncSchedule.generation_limit`) once the first push has landed.

Doomed groups (`sync.inflight_abort_doomed`, on by default). A group still generating whose oldest token already
lags the next batch the trainer takes by more than the bound can only be dropped when it finishes. The worker knows
this without a clock: a push's pause reads which requests hold output tokens (`FleetLifecycle.held_requests`, the
engine's own counts), and a request found holding tokens at a push generated its first token before it, under the
weights the fleet held then, version v. So v bounds its oldest token's version from above (the true one may be older,
if earlier pauses missed it: never newer), and once the next batch to take exceeds v + bound the group is doomed for
certain (`RolloutWorker._doomed_requests`, checked after every push and every take). It is then aborted in its engine
(vLLM's `/abort_requests`): the call answers with the tokens it had, and the group is dropped and counted with the
lag of its true oldest token, read from the engine's version spans of those tokens (`partial/aborted_groups`, also in
`partial/dropped_groups`). Its slots in the engine and its place in the window are freed at once, instead of after
the rest of a response that cannot be trained. A group that finishes before its abort lands is pooled and dropped at
the next take as before; a group never found holding tokens at a push is not aborted (it is dropped when it
finishes, if it must be). With `inflight_abort_doomed=false` no group is aborted.

The bias this introduces: short responses finish first, so they are trained sooner, and a response too long to
finish within the bound is dropped, so the trained responses are shorter than the sampled ones. `megarl bench
longtail` measures it (the length distribution of the trained responses with and without partial rollouts on the
same task), and every step records the drops (`partial/dropped_groups`) so it is never silent.

Nothing here is thread-safe: `RolloutWorker` calls it under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megarl.batch import RolloutBatch
from megarl.rollout.client import Sample
from megarl.token_versions import TokenVersions, version_lag


@dataclass(frozen=True)
class ScoredGroup:
    """The K scored samples of prompt `prompt` of home batch `home`."""

    home: int
    prompt: int
    samples: list[Sample]
    rewards: list[float]
    timeouts: int = 0  # samples whose reward passed reward.timeout_s
    flags: dict[str, int] = field(default_factory=dict)  # flag -> samples the reward function flagged

    @property
    def key(self) -> tuple[int, int]:
        return self.home, self.prompt

    def versions(self) -> list[TokenVersions]:
        """Each sample's per-token versions (a sample without tokens: none)."""
        return [s.token_versions if s.token_versions is not None
                else TokenVersions.single(s.policy_version, len(s.response_ids)) for s in self.samples]

    @property
    def oldest(self) -> int:
        """The version of the group's oldest token (a group without any token: its samples' version)."""
        runs = [tv.oldest for tv in self.versions() if tv.runs]
        return min(runs) if runs else min(s.policy_version for s in self.samples)


@dataclass(frozen=True)
class CarriedGroups:
    """What a checkpoint saves of partial rollouts: the finished groups not yet trained, the first home batch not
    opened yet, and the prompts of opened home batches not started yet (home batch -> prompt indices). The fleet
    finishes every group it started before the checkpoint is written (`RolloutWorker.quiesce`), so nothing is
    generating; a resumed run trains the carried groups and starts the unstarted prompts like any others."""

    groups: list[ScoredGroup]
    next_home: int
    unstarted: dict[int, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Formed:
    """Batch `l`'s groups (in (home, prompt) order) and the groups dropped past the staleness bound on the way."""

    groups: list[ScoredGroup]
    dropped: list[ScoredGroup]


class GroupPool:
    """The finished, scored groups the trainer has not taken yet (see the module docstring)."""

    def __init__(self, groups: list[ScoredGroup] | None = None) -> None:
        self._groups: dict[tuple[int, int], ScoredGroup] = {}
        self.taken: set[tuple[int, int]] = set()  # every group that left the pool, trained or dropped
        for group in groups or []:
            self.add(group)

    def __len__(self) -> int:
        return len(self._groups)

    def groups(self) -> list[ScoredGroup]:
        return [self._groups[k] for k in sorted(self._groups)]

    def add(self, group: ScoredGroup) -> None:
        if group.key in self._groups or group.key in self.taken:
            raise RuntimeError(f"home batch {group.home}, prompt {group.prompt} was generated twice")
        self._groups[group.key] = group

    def drop_stale(self, trainer_version: int, bound: int) -> list[ScoredGroup]:
        """Remove and return the groups whose oldest token lags `trainer_version` by more than `bound`."""
        stale = [g for g in self.groups() if version_lag(trainer_version, g.oldest) > bound]
        for group in stale:
            self._remove(group)
        return stale

    def form(self, size: int) -> list[ScoredGroup] | None:
        """Remove and return the `size` groups of the lowest (home batch, prompt), or None while fewer are pooled."""
        if len(self._groups) < size:
            return None
        chosen = self.groups()[:size]
        for group in chosen:
            self._remove(group)
        return chosen

    def _remove(self, group: ScoredGroup) -> None:
        del self._groups[group.key]
        self.taken.add(group.key)


def admission_limit(version: int, bound: int, batch_groups: int, start: int, end: int, dropped: int,
                    carried: int) -> int:
    """How many groups the fleet may have started since batch `start` while it holds policy `version`: those that
    batches `start .. min(version + bound, end - 1)` train (`batch_groups` each), plus `dropped` (groups dropped
    since `start`), less the `carried` ones a checkpoint saved (they fill batches too)."""
    return (min(version + bound + 1, end) - start) * batch_groups + dropped - carried


def batch_of_groups(index: int, groups: list[ScoredGroup]) -> RolloutBatch:
    """Batch `index` from its groups (in the order given): `policy_version` is the version of its oldest token (so
    the recorded `batch_lag` is the largest lag of any token in it), and `token_versions` records every token's."""
    flat = [s for g in groups for s in g.samples]
    with_routes = sum(s.routed_experts is not None for s in flat)
    if with_routes not in (0, len(flat)):
        raise RuntimeError(f"batch {index}: {with_routes} of {len(flat)} samples carry routed experts (a replica "
                           "started without rollout.return_routed_experts?)")
    flags: dict[str, int] = {}
    for g in groups:
        for flag, n in g.flags.items():
            flags[flag] = flags.get(flag, 0) + n
    return RolloutBatch(
        index=index,
        prompt_ids=[list(s.prompt_ids) for s in flat],
        response_ids=[list(s.response_ids) for s in flat],
        engine_logprobs=[list(s.response_logprobs) for s in flat],
        rewards=torch.tensor([g.rewards for g in groups], dtype=torch.float32),
        advantages=None,
        policy_version=min(g.oldest for g in groups),
        reward_timeouts=sum(g.timeouts for g in groups),
        reward_flags=flags,
        routed_experts=[torch.from_numpy(s.routed_experts) for s in flat] if with_routes else None,
        token_versions=[tv for g in groups for tv in g.versions()],
    )
