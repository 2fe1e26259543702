"""In-flight weight updates with partial rollouts, simulated with the engine model of `megarl.bench.dispatch_sim`.

The engine model (`dispatch_sim`'s, its constants `megarl.bench.pipeline_sim`'s): a replica runs decode steps over
every sequence it holds; a step costs `step_s + per_seq_s x running` and advances each running sequence by one
token; admitting a group costs its prefill, `prefill_per_seq_s` per sequence, during which the replica does not
decode. Progress is fluid between events (a push may land mid-step), so token counts per version are real numbers.

The rules, for `S = SyncSchedule(m, n)`, K steps, R replicas, P prompts (groups of K_s samples) a batch:
  fleet    groups are taken from one stream (prompt batch 0's P groups, then batch 1's, ...), lowest first, by the
           replica with free capacity (ties: replica order, one group per replica per round, as the queue's
           loops fill). Capacity (`admit`): 'groups' -- `in_flight` groups per replica, a group holding its slot
           until its longest response ends (today's queue, `rollout.chunk_prompts=1`); 'sequences' -- `in_flight x
           K_s` sequence slots, a new group admitted when K_s of them are free (the engine kept full). The fleet
           may have admitted at most `(v + bound + 1) x P + dropped` groups while it holds version v (AReaL's
           admission rule; with the default bound m + n - 1 it is `S.generation_limit` after the first push), and
           admits nothing while paused.
  push     at step k when `S.push_at_step(k)` names a batch < K: the trainer pushes for `push_s`; every replica
           pauses for those seconds *without waiting for the tail* (requests stay in the engine), then generates
           with version k; with `kv='recompute'` each replica first re-prefills every running sequence's prompt
           and generated tokens (`recompute_per_token_s` a token). A token's version is the version the fleet held
           when it was decoded.
  batch    step k takes complete, scored groups (`score_s` after the group's last response) in completion order.
           A group whose oldest token has version v is trained at lag k - v; if that exceeds `bound` it is dropped
           and counted, never trained. A group still generating whose oldest token could only be trained past the
           bound is, with `doomed='abort'` (the default), aborted (counted, its tokens wasted): when step k starts
           waiting (k - v > bound) and once batch k is formed (k + 1 - v > bound). With `doomed='finish'` (what
           `megarl.rollout.partial` implements) it is not: it generates to its end, holding its slot and its place
           in the admission limit, and is dropped at the first take after it is scored (every scored group past
           the bound is dropped then, as `GroupPool.drop_stale`). Then the trainer trains for `train(lengths of
           the batch's responses)` seconds.
  control  `quiesce=True`, today's controller on the same engine: a push first waits until every admitted group
           is generated, the fleet admits only prompt batches < `S.generation_limit`, and batch k is prompt batch k.
Pure Python, deterministic. `inflight_projection` turns it into the 30B projection next to the sequential
controller and a colocated synchronous baseline on the same GPUs; `bench_setting` simulates the CPU bench.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from megarl.bench import pipeline_sim as cluster
from megarl.bench.dispatch_sim import CLUSTER_COSTS, EngineCosts, guru_lengths
from megarl.sync.schedule import SyncSchedule

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
    doomed: str = "abort",
) -> InflightResult:
    """K = `steps` trainer steps on `replicas` replicas with in-flight pushes and partial rollouts (module doc).
    `lengths(j)[i]`: the response lengths of prompt i of prompt batch j; `train`: seconds of a step given its
    responses' lengths (or a constant); `bound`: the staleness bound (default m + n - 1).
    `quiesce=True` is today's controller on the same engine model (the control): a push first waits until every
    admitted group is generated, and batch k is prompt batch k (its P groups, once all are scored)."""
    if steps < 1 or replicas < 1 or in_flight < 1:
        raise ValueError(f"need steps, replicas, in_flight >= 1, got {steps}, {replicas}, {in_flight}")
    if admit not in ("groups", "sequences") or kv not in ("keep", "recompute") or doomed not in ("abort", "finish"):
        raise ValueError(f"admit {admit!r} (use 'groups' or 'sequences'), kv {kv!r} (use 'keep' or 'recompute'), "
                         f"doomed {doomed!r} (use 'abort' or 'finish')")
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
        g.fate = fate

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
                if doomed == "finish":  # `GroupPool.drop_stale`: every scored group past the bound, at the take
                    kept: deque[tuple[float, int]] = deque()
                    for item in ready:
                        g = groups[item[1]]
                        if item[0] <= t + _EPS and g.fate == "generating" and k - g.version > bound:
                            abort(g, "dropped")
                        else:
                            kept.append(item)
                    ready = kept
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
            g.fate = "trained"
            for per in tokens_by_version(g):
                spanning += len(per) > 1
                for v, n in per.items():
                    lags[k - v] = lags.get(k - v, 0.0) + n
        response_lengths = [n for g in batch for n in g.lengths]
        train_s = float(train(response_lengths)) if callable(train) else float(train)
        until = t + train_s
        out.steps.append(StepOut(step_start, until, t - step_start - step_push, step_push, train_s,
                                 tuple(g.gid for g in batch), lags, len(response_lengths), spanning))
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


# ---- the 30B projection (assumptions: `megarl.bench.pipeline_sim`'s, plus those below) ----
SCORE_GROUP_S = cluster.SCORE_S / cluster.PROMPTS  # assumption: the reward pool scores 1,152 responses in SCORE_S,
#                  so a group completing alone is scored in SCORE_S / 72 (groups are scored as they complete)
RECOMPUTE_PER_TOKEN_S = cluster.PREFILL_S / (cluster.PROMPTS * cluster.SAMPLES / cluster.REPLICAS
                                             * cluster.PROMPT_TOKENS)  # the model's prefill rate, per token
COLOCATED_GPUS = cluster.TRAINER_GPUS + cluster.REPLICAS * 4  # the same 64 GPUs
COLOCATED_REPLICAS = COLOCATED_GPUS // 4  # every GPU generates: 16 vLLM TP-4 replicas
COLOCATED_MODE_SWITCH_S = 2.0  # assumption: one train <-> generate memory transition (offload / onload of the
#                  trainer's weights and optimizer state, vLLM sleep / wake-up of weights and KV cache): verl's
#                  hybrid engine switches in "1-3 s" (deepwiki.com/volcengine/verl, hybrid engine architecture)
COLOCATED_SWITCH_S = 2 * COLOCATED_MODE_SWITCH_S + cluster.PUSH_FIXED_S  # two transitions a step, plus the
#                  weights resharded into the engine: the push model's fixed part (layerwise reload of 48 layers,
#                  lifecycle), without its network part (the weights stay on the node)
IN_FLIGHT = math.ceil(cluster.PROMPTS / cluster.REPLICAS)  # 9 groups (144 sequences) per replica, as today
INFLIGHT_SCHEDULES = ((1, 0), (1, 1), (1, 2), (4, 1), (8, 0), (8, 1), (8, 2))


def _lengths(per_prompt: bool) -> Callable[[int], list[list[int]]]:
    return lambda j: guru_lengths(j, per_prompt)


def static_share_s(groups: Sequence[Sequence[int]], costs: EngineCosts = CLUSTER_COSTS) -> float:
    """One replica's static share, the projection's formula: prefill + step x longest + per-seq x total tokens."""
    seqs = [n for g in groups for n in g]
    if not seqs:
        return 0.0
    return costs.prefill_per_seq_s * len(seqs) + costs.step_s * max(seqs) + costs.per_seq_s * sum(seqs)


def sequential_times(per_prompt: bool, replicas: int = cluster.REPLICAS,
                     costs: EngineCosts = CLUSTER_COSTS) -> cluster.StageTimes:
    """`pipeline_sim.StageTimes` on the same batches as the in-flight runs (`guru_lengths`), static shares
    (replica r: prompts i = r mod R; with windows of one batch the queue takes the same time: `dispatch_sim`)."""
    def generate(r: int, j: int) -> float:
        b = guru_lengths(j, per_prompt)
        return static_share_s([g for i, g in enumerate(b) if i % replicas == r], costs)

    def train(k: int) -> float:
        return cluster.train_seconds([n for g in guru_lengths(k, per_prompt) for n in g])

    return cluster.StageTimes(generate=generate, score=cluster.SCORE_S, train=train, push=cluster.PUSH_S)


@dataclass(frozen=True)
class ColocatedStep:
    generate_s: float  # the slowest of the replicas' static shares
    score_s: float
    train_s: float
    switch_s: float

    @property
    def step_s(self) -> float:
        return self.generate_s + self.score_s + self.train_s + self.switch_s


def colocated_step(batch: Sequence[Sequence[int]], replicas: int = COLOCATED_REPLICAS,
                   gpus: int = COLOCATED_GPUS, switch_s: float = COLOCATED_SWITCH_S,
                   costs: EngineCosts = CLUSTER_COSTS, score_s: float = cluster.SCORE_S,
                   train_32: Callable[[list[int]], float] | None = None) -> ColocatedStep:
    """A synchronous colocated step (verl / NeMo-RL's default): all `gpus` generate the batch as `replicas` static
    shares of the same engine, then score, then all train: the trainer's `TRAINER_GPUS` time x TRAINER_GPUS /
    gpus (linear scaling, the optimizer step included: the most favourable assumption for this baseline), plus
    the switch."""
    train_32 = train_32 or cluster.train_seconds
    gen = max(static_share_s([g for i, g in enumerate(batch) if i % replicas == r], costs) for r in range(replicas))
    train = train_32([n for g in batch for n in g]) * cluster.TRAINER_GPUS / gpus
    return ColocatedStep(gen, score_s, train, switch_s)


def project_inflight(m: int, n: int, per_prompt: bool = False, admit: str = "sequences", kv: str = "keep",
                     steps: int = 64, bound: int | None = None, quiesce: bool = False,
                     costs: EngineCosts = CLUSTER_COSTS, doomed: str = "abort") -> InflightResult:
    return simulate_inflight(
        SyncSchedule(m, n), steps, cluster.REPLICAS, _lengths(per_prompt), costs, cluster.train_seconds,
        cluster.PUSH_S, SCORE_GROUP_S, IN_FLIGHT, admit, bound, kv, cluster.PROMPT_TOKENS, RECOMPUTE_PER_TOKEN_S,
        quiesce=quiesce, doomed=doomed)


def summarize(r: InflightResult, first: int, last: int, stream_mean: float) -> dict:
    """Steady figures over steps [first, last); `stream_mean`: the mean response length of prompt batches
    [first, last), what the same steps would train without partial rollouts."""
    lags = r.lag_histogram(first, last)
    trained = r.trained_lengths(first, last)
    admitted = [n for g in r.groups for n in g.lengths]
    lost = [n for g in r.groups if g.fate in ("dropped", "aborted") for n in g.lengths]
    steps = r.steps[first:last]
    return {
        "steady_step_s": r.mean_step_s(first, last),
        "trainer_idle": r.trainer_idle_fraction(first, last),
        "replica_idle": r.replica_idle_fraction(first, last),
        "engine_occupancy": r.occupancy(first, last),
        "lag_share": {str(k): v for k, v in lags.items()},
        "mean_lag": sum(k * v for k, v in lags.items()),
        "max_lag": max(lags) if lags else 0,
        "responses_spanning_versions": sum(s.responses_spanning for s in steps) / sum(s.responses for s in steps),
        "dropped_groups": r.dropped,
        "aborted_groups": r.aborted,
        "groups_admitted": len(r.groups),
        "wasted_token_share": r.wasted_tokens / max(1.0, sum(admitted)),
        "trained_mean_length": statistics.fmean(trained),
        "stream_mean_length": stream_mean,
        "lost_mean_length": statistics.fmean(lost) if lost else None,
        "length_bias": statistics.fmean(trained) / stream_mean - 1.0,
    }


ROWS = (  # (controller, sync (m, n), admission, KV)
    *(("queue", mn, admit, "keep") for admit in ("groups", "sequences") for mn in ((1, 1), (8, 1))),
    *(("in-flight", mn, admit, "keep") for admit in ("groups", "sequences") for mn in INFLIGHT_SCHEDULES),
    ("in-flight", (8, 1), "sequences", "recompute"),
)


def inflight_projection(steps: int = 64, lengths: Sequence[str] = ("per-sample", "per-prompt"),
                        doomed: str = "abort") -> dict:
    """The 30B projection: the sequential controller, today's best pipelined schedule (static shares,
    `pipeline_sim`), the colocated synchronous baseline on the same 64 GPUs, today's queue on the engine model
    (the control: pushes wait for the tail) and in-flight + partial rollouts, per schedule and admission policy;
    steady = steps [K/4, 3K/4). Every row on the same batches (`dispatch_sim.guru_lengths`)."""
    first, last = steps // 4, 3 * steps // 4
    out: dict = {"steps": steps, "steady_steps": [first, last], "assumptions": assumptions(), "scenarios": []}
    for name in lengths:
        per_prompt = name == "per-prompt"
        stream = statistics.fmean(n for j in range(first, last) for g in guru_lengths(j, per_prompt) for n in g)
        seq = cluster.simulate(SyncSchedule(1, 0), steps, cluster.REPLICAS, sequential_times(per_prompt), False)
        best = cluster.simulate(SyncSchedule(8, 1), steps, cluster.REPLICAS, sequential_times(per_prompt), True)
        colo = [colocated_step(guru_lengths(j, per_prompt)) for j in range(first, last)]
        base = {
            "sequential_step_s": seq.mean_step_s(first, last),
            "pipelined_8_1_step_s": best.mean_step_s(first, last),
            "colocated_step_s": statistics.fmean(c.step_s for c in colo),
            "colocated_parts_s": {p: statistics.fmean(getattr(c, p) for c in colo)
                                  for p in ("generate_s", "score_s", "train_s", "switch_s")},
        }
        base["colocated_free_switch_step_s"] = base["colocated_step_s"] - base["colocated_parts_s"]["switch_s"]
        rows = []
        for controller, (m, n), admit, kv in ROWS:
            r = project_inflight(m, n, per_prompt, admit, kv, steps, quiesce=controller == "queue", doomed=doomed)
            row = summarize(r, first, last, stream)
            row.update({"controller": controller, "doomed": doomed, "interval": m, "offset": n, "bound": m + n - 1,
                        "admit": admit,
                        "kv": kv, "vs_sequential": base["sequential_step_s"] / row["steady_step_s"],
                        "vs_colocated": base["colocated_step_s"] / row["steady_step_s"],
                        "vs_pipelined_8_1": base["pipelined_8_1_step_s"] / row["steady_step_s"]})
            rows.append(row)
        out["scenarios"].append({"lengths": name, **base, "rows": rows})
    return out


def assumptions() -> dict:
    return {
        "engine": "dispatch_sim.CLUSTER_COSTS (pipeline_sim: DECODE_STEP_S, DECODE_PER_SEQ_S, PREFILL_S)",
        "decode_step_s": cluster.DECODE_STEP_S, "decode_per_seq_s": cluster.DECODE_PER_SEQ_S,
        "prefill_per_seq_s": CLUSTER_COSTS.prefill_per_seq_s,
        "push_s": cluster.PUSH_S, "score_s_batch": cluster.SCORE_S, "score_s_group": SCORE_GROUP_S,
        "in_flight_groups_per_replica": IN_FLIGHT, "recompute_per_token_s": RECOMPUTE_PER_TOKEN_S,
        "colocated_gpus": COLOCATED_GPUS, "colocated_replicas": COLOCATED_REPLICAS,
        "colocated_train_scaling": f"train_s(32 GPUs) x {cluster.TRAINER_GPUS}/{COLOCATED_GPUS} (linear, optimizer "
                                   "included)",
        "colocated_mode_switch_s": COLOCATED_MODE_SWITCH_S, "colocated_switch_s": COLOCATED_SWITCH_S,
    }


def projection_markdown(result: dict) -> str:
    lines = []
    for sc in result["scenarios"]:
        c = sc["colocated_parts_s"]
        lines += [
            f"\n{sc['lengths']} lengths: sequential controller (1, 0) {sc['sequential_step_s']:.1f} s/step; "
            f"pipelined (8, 1) today (static shares) {sc['pipelined_8_1_step_s']:.1f} s/step; colocated "
            f"synchronous, {COLOCATED_GPUS} GPUs {sc['colocated_step_s']:.1f} s/step (generate {c['generate_s']:.1f} + "
            f"score {c['score_s']:.1f} + train {c['train_s']:.1f} + switch {c['switch_s']:.1f}; with a free switch "
            f"{sc['colocated_free_switch_step_s']:.1f})\n",
            "| controller | sync (m, n) | bound | admission | KV | steady s/step | vs sequential | vs colocated | "
            "vs (8, 1) today | trainer idle | replica idle | engine occupancy | token lag 0 / 1 / 2 / 3+ | max lag | "
            "responses spanning versions | dropped + aborted groups (of admitted) | tokens wasted | "
            "trained mean length (bias) |",
            "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---:|---|",
        ]
        for r in sc["rows"]:
            share = {int(k): v for k, v in r["lag_share"].items()}
            three = sum(v for k, v in share.items() if k >= 3)
            lines.append(
                f"| {r['controller']} | ({r['interval']}, {r['offset']}) | {r['bound']} | {r['admit']} | {r['kv']} | "
                f"{r['steady_step_s']:.1f} | {r['vs_sequential']:.2f}x | {r['vs_colocated']:.2f}x | "
                f"{r['vs_pipelined_8_1']:.2f}x | {r['trainer_idle']:.0%} | {r['replica_idle']:.0%} | "
                f"{r['engine_occupancy']:.0%} | "
                f"{share.get(0, 0):.0%} / {share.get(1, 0):.0%} / {share.get(2, 0):.0%} / {three:.0%} | "
                f"{r['max_lag']} | {r['responses_spanning_versions']:.0%} | {r['dropped_groups']} + "
                f"{r['aborted_groups']} (of {r['groups_admitted']}) | {r['wasted_token_share']:.1%} | "
                f"{r['trained_mean_length']:.0f} ({r['length_bias']:+.1%}) |")
    return "\n".join(lines)


def bench_markdown(result: dict) -> str:
    lines = [
        f"stream: {result['stream_long_responses']} long responses, mean length {result['stream_mean_length']:.1f} "
        f"tokens; static split {result['static_per_batch']:.1f}, queue {result['queue_per_batch']:.1f} decode steps "
        "per batch (per window, as the bench)",
        "",
        "| run | decode steps per batch | vs today's queue | replica idle | max lag | dropped + aborted groups | "
        "long responses trained | trained mean length |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    base = result["runs"][0]["per_batch"]
    for r in result["runs"]:
        lines.append(f"| {r['run']} | {r['per_batch']:.1f} | {r['per_batch'] / base:.2f}x | {r['replica_idle']:.0%} | "
                     f"{r['max_lag']} | {r['dropped']} + {r['aborted']} | {r['long_responses_trained']} | "
                     f"{r['trained_mean_length']:.1f} |")
    return "\n".join(lines)


def decode_split_sensitivity(steps: int = 48, fixed_s: Sequence[float] = (0.007, 0.0035)) -> str:
    """`sync (8, 1)`, per-sample lengths, with a decode step's fixed cost moved to its per-sequence cost while a step
    of 144 sequences keeps its 14.2 ms: the sequential controller, today's queue and in-flight, group and sequence
    slots (steady steps [K/4, 3K/4)). A markdown table."""
    first, last = steps // 4, 3 * steps // 4
    full = cluster.DECODE_STEP_S + cluster.DECODE_PER_SEQ_S * 144
    lines = ["| decode step | sequential | queue, group slots | in-flight, group slots | queue, sequence slots | "
             "in-flight, sequence slots |", "|---|---:|---:|---:|---:|---:|"]
    for fixed in fixed_s:
        costs = EngineCosts(fixed, (full - fixed) / 144, CLUSTER_COSTS.prefill_per_seq_s)
        seq = cluster.simulate(SyncSchedule(1, 0), steps, cluster.REPLICAS, sequential_times(False, costs=costs),
                               False).mean_step_s(first, last)
        cells = [f"{fixed * 1e3:.1f} ms + {(full - fixed) / 144 * 1e3:.4f} ms a sequence", f"{seq:.1f} s"]
        for admit in ("groups", "sequences"):
            for quiesce in (True, False):
                r = project_inflight(8, 1, False, admit, "keep", steps, quiesce=quiesce, costs=costs)
                step = r.mean_step_s(first, last)
                cells.append(f"{step:.1f} s ({seq / step:.2f}x, occupancy {r.occupancy(first, last):.0%})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- the CPU bench's setting (`megarl bench longtail` defaults), in decode steps ----
UNIT_STEP = EngineCosts(step_s=1.0, per_seq_s=0.0, prefill_per_seq_s=0.0)  # seconds = decode steps


def bench_setting(windows: int = 4, window: int = 4, replicas: int = 2, prompts: int = 16, samples: int = 4,
                  long_share: float = 0.1, long_tokens: int = 256, short_tokens: int = 16,
                  costs: EngineCosts = UNIT_STEP, doomed: str = "abort") -> dict:
    """`megarl bench longtail`'s task (the same batches: `longtail.long_prompts`), windows 1..`windows` of `window`
    batches on `replicas` replicas: static and queue per window as the bench runs them (`dispatch_sim`), and the
    same batches as one run with no trainer cost, pushes of no cost at each window (`sync (window, 0)`): today's
    queue (`quiesce`) and in-flight + partial rollouts (bound window - 1), group loops as the bench's queue
    (ceil(P / R) chunks of one prompt in flight). With `UNIT_STEP` every second is one decode step."""
    from megarl.bench.dispatch_sim import simulate_window
    from megarl.bench.longtail import long_prompts
    from megarl.rollout.task import chunks_in_flight

    def batch(j: int) -> list[list[int]]:
        return [[long_tokens if long else short_tokens] * samples for long in long_prompts(j, prompts, long_share)]

    flight = chunks_in_flight(prompts, replicas, 1)
    per_window = {"static": [], "queue": []}
    for w in range(1, windows + 1):
        b = [batch(j) for j in range(w * window, (w + 1) * window)]
        per_window["static"].append(simulate_window(b, replicas, "static", costs).wall_s)
        per_window["queue"].append(simulate_window(b, replicas, "queue", costs, 1, flight).wall_s)
    steps = (windows + 1) * window
    runs = []
    for name, offset, bound, quiesce in (
        (f"today's queue, sync ({window}, 0)", 0, None, True),
        (f"in-flight, sync ({window}, 0), bound {window - 1}", 0, None, False),
        (f"in-flight, sync ({window}, 0), bound {window}", 0, window, False),
        (f"in-flight, sync ({window}, 1), bound {window}", 1, None, False),
    ):
        r = simulate_inflight(SyncSchedule(window, offset), steps, replicas, batch, costs, 0.0, 0.0, 0.0, flight,
                              "groups", bound, quiesce=quiesce, doomed=doomed)
        lo, hi = r.window(window, steps)
        runs.append({"run": name, "per_batch": (hi - lo) / (steps - window), "dropped": r.dropped,
                     "aborted": r.aborted, "replica_idle": r.replica_idle_fraction(window, steps),
                     "max_lag": max(r.lag_histogram(window, steps)),
                     "trained_mean_length": statistics.fmean(r.trained_lengths(window, steps)),
                     "long_responses_trained": sum(n == long_tokens for n in r.trained_lengths(window, steps))})
    stream = [n for j in range(window, steps) for g in batch(j) for n in g]
    return {
        "stream_mean_length": statistics.fmean(stream),
        "stream_long_responses": sum(n == long_tokens for n in stream),
        "static_per_batch": sum(per_window["static"]) / (windows * window),
        "queue_per_batch": sum(per_window["queue"]) / (windows * window),
        "static_windows": per_window["static"], "queue_windows": per_window["queue"], "runs": runs,
    }
