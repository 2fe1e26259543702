"""In-flight weight updates with partial rollouts, one run simulated event by event with the engine model of
`megarl.bench.dispatch_sim`.

The engine model (`dispatch_sim`'s, its constants `megarl.bench.pipeline_sim`'s): a replica runs decode steps over
every sequence it holds; a step costs `step_s + per_seq_s x running` and advances each running sequence by one
token; admitting a group costs its prefill, `prefill_per_seq_s` per sequence, during which the replica does not
decode. Progress is fluid between events (a push may land mid-step), so token counts per version are real numbers.

The rules, for `S = SyncSchedule(m, n)`, K steps, R replicas, P prompts (groups of K_s samples) a batch:
  fleet    groups are taken from one stream (prompt batch 0's P groups, then batch 1's, ...), lowest first, by the
           replica with free capacity (ties: replica order, one group per replica per round, as the queue's
           loops fill). Capacity (`admit`): 'groups' -- `in_flight` groups per replica, a group holding its slot
           until its longest response ends (today's queue, `rollout.chunk_prompts=1`); 'sequences' -- `in_flight x
           K_s` sequence slots, a new group admitted when K_s of them are free (the engine kept full; megarl's
           `rollout.refill=sequences`, where vLLM's scheduler refills a freed slot from its waiting queue). The fleet
           may have admitted at most `(v + bound + 1) x P + dropped` groups while it holds version v (AReaL's
           admission rule; with the default bound m + n - 1 it is `S.generation_limit` after the first push), and
           admits nothing while paused.
  push     at step k when `S.push_at_step(k)` names a batch < K: the trainer pushes for `push_s`; every replica
           pauses for those seconds *without waiting for the tail* (requests stay in the engine), then generates
           with version k; with `kv='recompute'` each replica first re-prefills every running sequence's prompt
           and generated tokens (`recompute_per_token_s` a token). A token's version is the version the fleet held
           when it was decoded.
  batch    step k takes complete, scored groups (`score_s` after the group's last response). A group whose oldest
           token has version v is trained at lag k - v; if that exceeds `bound` it is dropped and counted, never
           trained. Which groups, `order`:
             'home' (the default, what `megarl.rollout.partial` implements: `GroupPool.drop_stale`, then
                    `GroupPool.form`): at each take every scored group past the bound is dropped first; then, once
                    at least P scored groups are left, the P of the lowest (home batch, prompt) form the batch
                    (the stream's order: group g is prompt g mod P of home batch g // P; no ties). A group that
                    finished early but belongs to a later home batch waits behind older ones.
             'completion' (AReaL's rule, megarl's first one): the first P scored groups in completion order, a group
                    met past the bound on the way dropped (with `doomed='finish'` every scored group past the bound
                    is dropped first, as above).
           A group still generating whose oldest token could only be trained past the bound: with `doomed='finish'`
           (the default here; `sync.inflight_abort_doomed=false`) it generates to its end, holding its slot and
           its place in the admission limit, and is dropped at the first take after it is scored. With
           `doomed='abort'` (megarl's default since 2026-11-29, `megarl.rollout.partial`, "Doomed groups") it is
           aborted (counted, its tokens wasted) when step k starts waiting (k - v > bound) and once batch k is
           formed (k + 1 - v > bound). (megarl learns a bound on v at the first push that finds the group holding
           tokens, so it aborts later than the sim a group doomed before any push has held it.)
           Then the trainer trains for `train(lengths of the batch's responses)` seconds. The order only matters
           when more than P scored groups within the bound are pooled at the take (`StepOut.pooled`): when the
           trainer reaches the take before P are, the batch forms as the P-th is scored, the same under either.
  control  `quiesce=True`, today's controller on the same engine: a push first waits until every admitted group
           is generated, the fleet admits only prompt batches < `S.generation_limit`, and batch k is prompt batch k.
Pure Python, deterministic. `megarl.bench.inflight_sim.projection` turns it into the 30B projection,
`megarl.bench.inflight_sim.longtail_setting` simulates the CPU bench's setting, and
`megarl.bench.inflight_sim.fleet_setting` the in-flight fleet bench's, against its measured runs.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from megarl.bench.dispatch_sim import EngineCosts
from megarl.schedule import SyncSchedule

_EPS = 1e-9


@dataclass
class _Group:
    gid: int
    lengths: tuple[int, ...]
    replica: int
    version: int  # the oldest token's version: the fleet's version when the group was admitted
    start_pos: float = 0.0  # the replica's decode progress when the group's decode began
    left: int = 0  # sequences still generating
    done_at: float | None = None
    fate: str = "generating"  # generating | trained | dropped | aborted
    taken_at: int | None = None  # the step that trained, dropped or aborted it


@dataclass(frozen=True)
class StepOut:
    start: float
    end: float
    wait_s: float  # neither pushing nor training
    push_s: float
    train_s: float
    groups: tuple[int, ...]  # the trained groups' ids (stream order: prompt batch gid // P)
    tokens_by_lag: dict[int, float]  # response tokens trained at each lag (step - token version)
    responses: int
    responses_spanning: int  # responses whose tokens come from more than one version
    pooled: int = 0  # scored groups within the bound when the batch was formed: above P, the batch order chose


@dataclass
class InflightResult:
    steps: list[StepOut]
    groups: list[_Group]
    replicas: int
    prompts: int
    replica_idle: list[list[tuple[float, float]]]  # per replica: intervals neither decoding, prefilling nor paused
    pushes: list[tuple[float, float]]
    dropped: int = 0  # complete groups past the bound
    aborted: int = 0  # groups stopped while generating (could only be trained past the bound)
    wasted_tokens: float = 0.0  # tokens of dropped and aborted groups
    seq_seconds: dict[float, float] = field(default_factory=dict)  # at each trainer event: sequence-seconds so far
    capacity: int = 0  # sequences a replica may hold (`in_flight` x samples)

    @property
    def wall(self) -> float:
        return self.steps[-1].end

    def window(self, first: int, last: int) -> tuple[float, float]:
        return self.steps[first].start, self.steps[last - 1].end

    def mean_step_s(self, first: int, last: int) -> float:
        lo, hi = self.window(first, last)
        return (hi - lo) / (last - first)

    def trainer_idle_fraction(self, first: int, last: int) -> float:
        lo, hi = self.window(first, last)
        return sum(s.wait_s for s in self.steps[first:last]) / (hi - lo)

    def replica_idle_fraction(self, first: int, last: int) -> float:
        lo, hi = self.window(first, last)
        idle = sum(max(0.0, min(b, hi) - max(a, lo)) for spans in self.replica_idle for a, b in spans)
        return idle / ((hi - lo) * self.replicas)

    def occupancy(self, first: int, last: int) -> float:
        """Mean running sequences per replica over steps [first, last), as a share of its capacity."""
        lo, hi = self.window(first, last)
        return (self.seq_seconds[hi] - self.seq_seconds[lo]) / ((hi - lo) * self.replicas * self.capacity)

    def lag_histogram(self, first: int, last: int) -> dict[int, float]:
        """Share of the trained response tokens at each lag, steps [first, last)."""
        out: dict[int, float] = {}
        for s in self.steps[first:last]:
            for lag, n in s.tokens_by_lag.items():
                out[lag] = out.get(lag, 0.0) + n
        total = sum(out.values())
        return {lag: n / total for lag, n in sorted(out.items())} if total else {}

    def trained_lengths(self, first: int, last: int) -> list[int]:
        return [n for s in self.steps[first:last] for g in s.groups for n in self.groups[g].lengths]


def simulate_inflight(
    schedule: SyncSchedule,
    steps: int,
    replicas: int,
    lengths: Callable[[int], Sequence[Sequence[int]]],
    costs: EngineCosts,
    train: Callable[[list[int]], float] | float,
    push_s: float,
    score_s: float,
    in_flight: int,
    admit: str = "groups",
    bound: int | None = None,
    kv: str = "keep",
    prompt_tokens: int = 0,
    recompute_per_token_s: float = 0.0,
    slowdown: Sequence[float] | None = None,
    quiesce: bool = False,
    doomed: str = "finish",
    order: str = "home",
) -> InflightResult:
    """K = `steps` trainer steps on `replicas` replicas with in-flight pushes and partial rollouts (module doc).
    `lengths(j)[i]`: the response lengths of prompt i of prompt batch j; `train`: seconds of a step given its
    responses' lengths (or a constant); `bound`: the staleness bound (default m + n - 1); `order` and `doomed`: which
    scored groups form a batch and what becomes of a group that can only be trained past the bound (the defaults are
    megarl's rules, `megarl.rollout.partial`; the alternatives: `order='completion'`, `doomed='abort'`).
    `quiesce=True` is today's controller on the same engine model (the control): a push first waits until every
    admitted group is generated, and batch k is prompt batch k (its P groups, once all are scored)."""
    if steps < 1 or replicas < 1 or in_flight < 1:
        raise ValueError(f"need steps, replicas, in_flight >= 1, got {steps}, {replicas}, {in_flight}")
    if (admit not in ("groups", "sequences") or kv not in ("keep", "recompute") or doomed not in ("abort", "finish")
            or order not in ("home", "completion")):
        raise ValueError(f"admit {admit!r} (use 'groups' or 'sequences'), kv {kv!r} (use 'keep' or 'recompute'), "
                         f"doomed {doomed!r} (use 'finish' or 'abort'), order {order!r} (use 'home' or 'completion')")
    bound = schedule.interval + schedule.offset - 1 if bound is None else bound
    if bound < 0:
        raise ValueError(f"the staleness bound must be >= 0, got {bound}")
    prompts = len(lengths(0))
    slow = list(slowdown) if slowdown is not None else [1.0] * replicas
    group_cache: dict[int, tuple[int, ...]] = {}

    def group_lengths(gid: int) -> tuple[int, ...]:
        if gid not in group_cache:
            b = lengths(gid // prompts)
            for i, g in enumerate(b):
                group_cache[gid // prompts * prompts + i] = tuple(max(0, int(n)) for n in g)
        return group_cache[gid]

    groups: list[_Group] = []
    progress = [0.0] * replicas
    heaps: list[list[tuple[float, int]]] = [[] for _ in range(replicas)]  # (finish position, gid)
    running_groups = [0] * replicas
    stall_until = [0.0] * replicas
    marks: list[list[tuple[float, int]]] = [[(0.0, 0)] for _ in range(replicas)]  # (progress, version from there)
    idle: list[list[tuple[float, float]]] = [[] for _ in range(replicas)]
    pushes: list[tuple[float, float]] = []
    ready: deque[tuple[float, int]] = deque()  # (scored at, gid) in completion order
    out = InflightResult([], groups, replicas, prompts, idle, pushes)
    out.capacity = in_flight * max(1, len(group_lengths(0)))
    seq_seconds = 0.0
    scoring: list[float] = []  # the scoring ends still ahead
    open_groups = [0]  # groups admitted and still generating
    limit_batches = schedule.generation_limit(None)  # quiesce: batches the fleet may have started
    t, version, paused_until, pending_version = 0.0, 0, 0.0, None
    k, state, until, batch, step_start, step_push = 0, "start", 0.0, [], 0.0, 0.0

    def cost(r: int) -> float:
        return (costs.step_s + costs.per_seq_s * len(heaps[r])) * slow[r]

    def can_admit(r: int) -> bool:
        if quiesce and len(groups) >= limit_batches * prompts:
            return False
        if len(groups) >= (version + bound + 1) * prompts + out.dropped + out.aborted:
            return False
        if admit == "groups":
            return running_groups[r] < in_flight
        size = len(group_lengths(len(groups)))
        return len(heaps[r]) + size <= in_flight * size

    def resume() -> None:
        """The push's pause is over: the fleet generates with the pushed version (KV recomputed or kept)."""
        nonlocal version, pending_version
        if pending_version is None or paused_until > t + _EPS:
            return
        version, pending_version = pending_version, None
        for r in range(replicas):
            marks[r].append((progress[r], version))
            if kv == "recompute":
                tokens = sum(prompt_tokens + progress[r] - groups[gid].start_pos for _, gid in heaps[r])
                stall_until[r] = max(t, stall_until[r]) + recompute_per_token_s * tokens * slow[r]

    def admit_all() -> None:
        if t < paused_until - _EPS:
            return
        resume()
        more = True
        while more:
            more = False
            for r in range(replicas):
                if can_admit(r):
                    g = _Group(len(groups), group_lengths(len(groups)), r, version, progress[r])
                    groups.append(g)
                    stall_until[r] = max(t, stall_until[r]) + costs.prefill_per_seq_s * len(g.lengths) * slow[r]
                    for n in g.lengths:
                        if n > 0:
                            heapq.heappush(heaps[r], (g.start_pos + n, g.gid))
                            g.left += 1
                    running_groups[r] += 1
                    open_groups[0] += 1
                    if g.left == 0:
                        finish(g)
                    more = True

    def finish(g: _Group) -> None:
        g.done_at = t
        running_groups[g.replica] -= 1
        ready.append((t + score_s, g.gid))
        heapq.heappush(scoring, t + score_s)
        open_groups[0] -= 1

    def tokens_by_version(g: _Group) -> list[dict[int, float]]:
        """Per response: tokens decoded under each version (the replica's version marks over its positions)."""
        m = marks[g.replica]
        res = []
        for n in g.lengths:
            lo, hi, per = g.start_pos, g.start_pos + n, {}
            for i, (pos, v) in enumerate(m):
                end = m[i + 1][0] if i + 1 < len(m) else math.inf
                share = min(hi, end) - max(lo, pos)
                if share > _EPS:
                    per[v] = per.get(v, 0.0) + share
            res.append(per)
        return res

    def abort(g: _Group, fate: str) -> None:
        r = g.replica
        if g.fate == "generating" and g.done_at is None:
            heaps[r] = [(f, gid) for f, gid in heaps[r] if gid != g.gid]
            heapq.heapify(heaps[r])
            running_groups[r] -= 1
            open_groups[0] -= 1
            out.wasted_tokens += sum(min(n, max(0.0, progress[r] - g.start_pos)) for n in g.lengths)
            out.aborted += 1
        else:
            out.wasted_tokens += sum(g.lengths)
            out.dropped += 1
        g.fate, g.taken_at = fate, k

    def trainer() -> None:
        nonlocal k, state, until, batch, step_start, step_push, paused_until, pending_version, ready, limit_batches
        out.seq_seconds[t] = seq_seconds
        while True:
            if state == "start":
                if k >= steps:
                    return
                step_start, step_push, batch = t, 0.0, []
                j = schedule.push_at_step(k)
                if j is not None and j < steps:
                    state = "quiesce"
                    continue
                state = "wait"
                sweep(k)
            elif state == "quiesce":
                if quiesce and open_groups[0]:
                    return
                until = paused_until = t + push_s
                pending_version, step_push = k, push_s
                pushes.append((t, until))
                for r in range(replicas):  # a prefill in progress resumes after the pause
                    if stall_until[r] > t:
                        stall_until[r] += push_s
                limit_batches = schedule.generation_limit(schedule.push_at_step(k))
                state = "push"
            elif state == "push":
                if t < until - _EPS:
                    return
                state = "wait"
                sweep(k)
            elif state == "wait" and quiesce:
                want = range(k * prompts, (k + 1) * prompts)
                if len(groups) < want[-1] + 1 or any(
                        groups[g].done_at is None or groups[g].done_at + score_s > t + _EPS for g in want):
                    return
                batch = [groups[g] for g in want]
                ready = deque(x for x in ready if x[1] not in want)
                form()
            elif state == "wait":
                if doomed == "finish" or order == "home":  # `GroupPool.drop_stale`: every scored group past the bound
                    kept: deque[tuple[float, int]] = deque()
                    for item in ready:
                        g = groups[item[1]]
                        if item[0] <= t + _EPS and g.fate == "generating" and k - g.version > bound:
                            abort(g, "dropped")
                        else:
                            kept.append(item)
                    ready = kept
                if order == "home":  # `GroupPool.form`: the P scored groups of the lowest (home batch, prompt)
                    scored = sorted(gid for at, gid in ready if at <= t + _EPS and groups[gid].fate == "generating")
                    if len(scored) < prompts:
                        return
                    chosen = set(scored[:prompts])
                    batch = [groups[gid] for gid in scored[:prompts]]
                    ready = deque(x for x in ready if x[1] not in chosen)
                    form()
                    continue
                while ready and ready[0][0] <= t + _EPS and len(batch) < prompts:
                    g = groups[ready.popleft()[1]]
                    if g.fate != "generating":
                        continue
                    if k - g.version > bound:
                        abort(g, "dropped")
                    else:
                        batch.append(g)
                if len(batch) < prompts:
                    return
                form()
            elif state == "train":
                if t < until - _EPS:
                    return
                k += 1
                state = "start"

    def form() -> None:
        nonlocal state, until
        lags: dict[int, float] = {}
        spanning = 0
        for g in batch:
            g.fate, g.taken_at = "trained", k
            for per in tokens_by_version(g):
                spanning += len(per) > 1
                for v, n in per.items():
                    lags[k - v] = lags.get(k - v, 0.0) + n
        response_lengths = [n for g in batch for n in g.lengths]
        pooled = len(batch) if quiesce else len(batch) + sum(  # quiesce: batch k is prompt batch k, no choice
            1 for at, gid in ready if at <= t + _EPS and groups[gid].fate == "generating" and k - groups[gid].version
            <= bound)
        train_s = float(train(response_lengths)) if callable(train) else float(train)
        until = t + train_s
        out.steps.append(StepOut(step_start, until, t - step_start - step_push, step_push, train_s,
                                 tuple(g.gid for g in batch), lags, len(response_lengths), spanning, pooled))
        sweep(k + 1)
        state = "train"

    def sweep(step: int) -> None:
        """Abort the groups still generating that could only be trained at `step` or later, past the bound (with
        `doomed='abort'`)."""
        if quiesce or doomed == "finish":
            return
        for g in groups:
            if g.fate == "generating" and g.done_at is None and step - g.version > bound:
                abort(g, "aborted")

    admit_all()
    trainer()
    while k < steps:
        events = []
        if paused_until > t + _EPS:
            events.append(paused_until)
        if state in ("push", "train"):
            events.append(until)
        while scoring and scoring[0] <= t + _EPS:
            heapq.heappop(scoring)
        if state in ("wait", "quiesce") and scoring:
            events.append(scoring[0])
        decoding = []
        for r in range(replicas):
            if paused_until > t + _EPS:
                continue
            if stall_until[r] > t + _EPS:
                events.append(stall_until[r])
            elif heaps[r]:
                at = t + (heaps[r][0][0] - progress[r]) * cost(r)
                events.append(at)
                decoding.append((r, at))
        if not events:
            if state == "quiesce" or (state == "wait" and quiesce):
                raise RuntimeError(f"step {k}: the fleet may not generate the groups it waits for (admission limit)")
            raise RuntimeError(
                f"step {k} waits for a batch no group can complete: the staleness bound {bound} is below the "
                f"schedule's interval - 1 = {schedule.interval - 1} (raise `bound`)")
        t_next = max(t, min(events))
        for r in range(replicas):
            is_paused = paused_until > t + _EPS
            if not is_paused and stall_until[r] <= t + _EPS:
                if heaps[r]:
                    progress[r] += (t_next - t) / cost(r)
                    seq_seconds += (t_next - t) * len(heaps[r])
                elif t_next > t:
                    spans = idle[r]
                    if spans and abs(spans[-1][1] - t) < _EPS:
                        spans[-1] = (spans[-1][0], t_next)
                    else:
                        spans.append((t, t_next))
        for r, at in decoding:
            if abs(at - t_next) <= _EPS * max(1.0, t_next):
                progress[r] = heaps[r][0][0]  # exact: the event was this replica's next completion
        t = t_next
        resume()
        for r in range(replicas):
            while heaps[r] and heaps[r][0][0] <= progress[r] + 1e-6:
                _, gid = heapq.heappop(heaps[r])
                g = groups[gid]
                g.left -= 1
                if g.left == 0:
                    finish(g)
        trainer()
        admit_all()
    return out
