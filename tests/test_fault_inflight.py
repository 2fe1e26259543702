"""The fault matrix's in-flight cells (issue 48 item 5): with `sync.inflight` (pushes land while the fleet generates,
partial rollouts in the rollout worker) a replica fails while it is paused for a push with requests held in its
engine. Two `megarl train` jobs on the session's two TP-1 replicas (`moe_fleet_2x1`, one set of 2 trainer ranks,
`rollout.min_replicas=1`), each with a thread of the test that arms one fault through the project's failpoints
(`megarl.sync.failpoints`, the session's directory `session_failpoints`, which the fleet's servers and the trainer
ranks see). Nobody waits on anything: the fault fires inside replica 1's own vLLM worker, at full speed, at the
first push that finds a request with an output token held in its model runner (the point's `-if-held` modes); a push
that holds none goes by untouched and the point stays armed. Holding a process of the run would lengthen the pause,
which a user's run does not get (the project's rule for failure tests). The point records what the worker held
(the engine's own ids, which name each request's group, and their token counts) and its pid and process group, in
`<point>.reached`, and the test checks from outside afterwards:

    M  (first job) `push.loading.replica1` armed `fail-if-held`: replica 1's vLLM worker raises inside
       `load_weights`, once vLLM's layerwise reload began, at the first push whose pause (`/pause?mode=keep`) left
       requests held: its model is "mixed". With in-flight updates the replica is given up like one that died
       (`FleetLifecycle._give_up_mixed`): its requests are aborted (`/pause?mode=abort`), it stays paused, the push
       goes on to replica 0, and the rollout worker gives the aborted chunks back (never pools them) and takes
       replica 1 out.
    K  (second job, whose first push, a full one, repairs replica 1: it is resumed and serves again)
       `push.held.replica1` armed `kill-if-held`: replica 1's worker, asked by the push's lifecycle what it holds
       (`megarl_held_requests`, the replica paused in keep mode, its update not open yet), SIGKILLs its own server's
       process group if it holds requests: the push goes on to replica 0, the lost requests' chunks go back to the
       queue.
    E  (its own test and job, on the fleet with replica 1 restarted after K) `push.held.replica1` armed
       `kill-engine-if-held`: asked what it holds, replica 1's worker SIGKILLs its engine core (what a CUDA error or an
       out-of-memory kill does) if it holds requests; its API server answers 503 until it exits by itself.
    W  (its own test and job, after E) `push.held.replica1` armed `stop-engine-if-held`: asked what it holds,
       replica 1's worker SIGSTOPs its engine core (an engine that hangs: a wedged kernel or collective), never
       continued, and answers; the answer never reaches the API server, which lives on. The push's call waits its
       bound and gives up: replica 1 is failed for the push and condemned, but this fleet is one the caller keeps,
       so no launcher acts on that and nobody kills the replica. The push goes on to replica 0; the rollout worker
       drops replica 1 and gives back the chunks it held at once; its `/health` must then fail
       (`megarl.rollout.engine_probe`: the window of the push's call ends when its caller leaves), so that nothing
       else waits on it.

Checked from outside, per cell: the point fired in a process of replica 1's server group, with requests of named
groups held, at a push of that cell's job (step 1 .. LAST_FAULT_STEP: seen from the job's metrics as it fired); the
run trained every step (the job returned); the push at the fault served replica 0 alone and later steps ran on one
replica; every group the replica held was trained exactly once (`partial/groups` in metrics.jsonl) or dropped and
counted, no group was trained twice, every started group is accounted for at every step, and
`fleet/requeued_groups` counts at least the held groups; M: the engine finished every held response as aborted (its
own `vllm:request_success_total` counter, against its value when the point was armed), the calls were answered
(replica 1's access log after the fault's `/pause?mode=keep`: the `/pause?mode=abort`, a 200 for at least every held
request, no `/resume`), and replica 1 is paused afterwards: it computed no token with its half-loaded weights; K: no
process of replica 1's group is left; E: the process killed was not the server, and no process of its group is left;
W: as its test says.

Marked `kills_session_fleet("moe_fleet_2x1")`: it runs after every other test of the session, and a later user of
the fleet gets replica 1 restarted (tests/fleet_fixture.py)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import requests

from megarl.launch import prepare
from megarl.rollout.client import RolloutClient
from megarl.rollout.fleet_auth import SECRET_ENV, bearer_header, read_secret
from megarl.rollout.inflight import group_of_request, held_counts
from megarl.sync import failpoints
from tests.dist_utils import process_group_members, process_state
from tests.shared_ranks import train_jobs_in_one_set_of_ranks
from tests.test_end_to_end import _overrides

M, N, STEPS = 1, 1, 12  # sync (1, 1): a push at the start of every step 1 .. STEPS - 2
PROMPTS, K = 4, 2
HEALTH_S = 8
# long responses, few of them: up to 112 tokens (EOS is rare for the tiny model; prompts are 4 tokens, its context
# 128), 2 per prompt. Decoding costs the fleet about the same per step whatever the few sequences, training costs the
# trainer per token: the fleet is the slower side, so a push finds requests generating, the regime in-flight updates
# are for (with 4 x 4 responses of 48 or 96 tokens the fleet had sometimes finished every group it may start before
# each of three or four pushes in a row, and nothing was held)
JOB = ["algorithm.name=gspo", "algorithm.decoupled.enabled=true", "sync.inflight=true", "sync.inflight_kv=recompute",
       "reward.name=tests.reward_fns:odd_word_count", "rollout.max_new_tokens=112", f"rollout.samples_per_prompt={K}",
       "rollout.min_replicas=1", f"rollout.health_timeout_s={HEALTH_S}"]
LAST_FAULT_STEP = STEPS - 3  # a fault's push leaves at least 2 more steps to train the groups it gave back
LOADING, HELD = "push.loading.replica1", "push.held.replica1"  # the failpoints of cells M and K
PUSH_S = 30.0  # the push at a fault waits for nothing: well within this on a loaded 2-core machine
WEDGED_BOUND_S = 15  # cell W's sync.timeout_fixed_s: the push's bound on each of its calls to a replica


def _records(run_dir: Path) -> list[dict[str, Any]]:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the last line, half written
            break
    return out


def _aborted(url: str) -> float:
    """The engine's own count of requests it finished as aborted (vLLM's `vllm:request_success_total` with
    `finished_reason="abort"`, from its /metrics; each of a prompt's n samples is one request there)."""
    headers = bearer_header(read_secret(os.environ[SECRET_ENV]))
    text = requests.get(f"{url}/metrics", headers=headers, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line)


def _health(url: str) -> int | None:
    """The status of replica `url`'s /health, None if it does not answer."""
    try:
        return requests.get(f"{url}/health", timeout=5).status_code
    except requests.RequestException:
        return None


def _record(path: Path) -> dict[str, Any] | None:
    """A failpoint's `.reached` record (`megarl.sync.failpoints`: written whole before it appears), None before."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


class _Cells(threading.Thread):
    """Arms the cells of `plan` one after another and watches them fire (see the module docstring): M in the job
    writing `mixed` and K in the one writing `killed` ("MK"), or E or W in the one job writing `mixed`."""

    def __init__(self, points: Path, fleet: Any, mixed: Path, killed: Path, plan: str = "MK") -> None:
        super().__init__(daemon=True)
        self.points, self.fleet, self.mixed, self.killed = points, fleet, mixed, killed
        self.plan = [getattr(self, f"_cell_{name.lower()}") for name in plan]
        self.cells: dict[str, dict[str, Any]] = {}
        self.error: str | None = None
        self.deadline = time.monotonic() + 900

    def run(self) -> None:
        try:
            for cell in self.plan:
                cell()
        except Exception as err:  # noqa: BLE001 - reported by the test
            self.error = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
        finally:  # never leave a point armed
            for name in (LOADING, HELD):
                (self.points / name).unlink(missing_ok=True)

    def _until(self, condition: Any, what: str, every_s: float = 0.02) -> Any:
        while not (value := condition()):
            assert time.monotonic() < self.deadline, f"{what}: not before the test's deadline"
            time.sleep(every_s)
        return value

    def _log(self) -> Path:
        return self.fleet.logs[1]

    def _fired(self, point: str, mode: str, run_dir: Path, other: Path | None) -> dict[str, Any]:
        """Arm `point` with `mode` and wait (this thread only) until replica 1's worker fires it at a push of the job
        writing `run_dir` (not `other`'s), or that job passed `LAST_FAULT_STEP` (then it is disarmed: a failure).
        Returns the cell: the point's record, the step whose push it was, the held requests and their groups."""
        armed, reached, passed = (self.points / f"{point}{end}" for end in ("", ".reached", ".passed"))
        reached.unlink(missing_ok=True)
        passed.unlink(missing_ok=True)
        cell: dict[str, Any] = {"log_at": self._log().stat().st_size, "aborted_before": _aborted(self.fleet.urls[1])}
        armed.write_text(mode)
        late = self._until(lambda: reached.exists() or len(_records(run_dir)) > LAST_FAULT_STEP,
                           f"{point} fired or step {LAST_FAULT_STEP} written")
        step = len(_records(run_dir))  # the push at the start of step `step` (its record not written yet)
        armed.unlink(missing_ok=True)
        record = _record(reached)
        pushes = len(passed.read_text().splitlines()) if passed.exists() else 0
        assert record is not None, (f"no push of {run_dir.name} up to step {LAST_FAULT_STEP} found a request with a "
                                    f"token held in replica 1 ({pushes} passes of {point} held none)", late)
        assert other is None or not (other / "metrics.jsonl").exists(), "the other job's push fired the point"
        held = held_counts(record["held"])
        cell.update(step=step, record=record, passes=pushes, held=held, server=self.fleet.procs[1].pid,
                    groups={group_of_request(rid) for rid, _ in held})
        return cell

    def _cell_m(self) -> None:
        self._until(lambda: _records(self.mixed), "the first job's first step", every_s=0.2)
        cell = self.cells["M"] = self._fired(LOADING, failpoints.FAIL_IF_HELD, self.mixed, self.killed)
        cell["loader_in_replica"] = cell["record"]["pid"] in process_group_members(cell["server"])
        self._until(lambda: len(_records(self.mixed)) > cell["step"], f"step {cell['step']} written")
        # replica 1 after the push that gave it up (the second job, whose push would resume it, has not begun)
        cell["paused"] = RolloutClient(self.fleet.urls[1], timeout_s=60).is_paused()
        cell["aborted"] = _aborted(self.fleet.urls[1]) - cell["aborted_before"]
        with self._log().open("rb") as f:
            f.seek(cell["log_at"])
            cell["log"] = f.read().decode(errors="replace")

    def _cell_k(self) -> None:  # replica 1's server leads its process group: the kill takes all of it
        self._killed_cell("K", failpoints.KILL_IF_HELD, self.killed, "the second job's first step")

    def _cell_e(self) -> None:  # its API server exits by itself once its engine is dead
        self._killed_cell("E", failpoints.KILL_ENGINE_IF_HELD, self.mixed, "the job's first step")

    def _cell_w(self) -> None:  # nothing kills it: a fleet the caller keeps has no launcher to act on a condemnation
        self._until(lambda: _records(self.mixed), "the job's first step", every_s=0.2)
        cell = self.cells["W"] = self._fired(HELD, failpoints.STOP_ENGINE_IF_HELD, self.mixed, None)
        self._until(lambda: _health(self.fleet.urls[1]) == 503, "replica 1's /health 503", every_s=0.2)
        cell["unhealthy_s"] = time.time() - cell["record"]["time"]

    def _killed_cell(self, name: str, mode: str, run_dir: Path, first_step: str) -> None:
        """Cells K and E: `push.held.replica1` armed `mode` once the job writing `run_dir` has a step, then wait
        until replica 1's whole process group is gone."""
        self._until(lambda: _records(run_dir), first_step, every_s=0.2)
        cell = self.cells[name] = self._fired(HELD, mode, run_dir, None)
        server = cell["server"]
        self._until(lambda: not process_group_members(server), "replica 1's process group gone", every_s=0.2)
        cell["gone_s"] = time.time() - cell["record"]["time"]

def _accounting(records: list[dict[str, Any]], held: set[tuple[int, int]]) -> dict[str, Any]:
    """The groups of a partial-rollout run from its metrics: every step whole, no group trained twice, every started
    group trained, dropped, pooled or in flight at each step; each `held` group trained (the step) or dropped."""
    trained: list[tuple[int, int]] = []
    dropped: list[tuple[int, int]] = []
    at: dict[tuple[int, int], int] = {}
    for r in records:
        assert r["batch/samples"] == PROMPTS * K and len(r["partial/groups"]) == PROMPTS, r
        for g in r["partial/groups"]:
            trained.append(tuple(g))
            at[tuple(g)] = r["step"]
        dropped += [(h, p) for h, p, _ in r["partial/dropped"]]
        assert r["partial/started_groups"] == (len(trained) + len(dropped) + r["partial/in_flight_groups"]
                                               + r["partial/pooled_groups"]), r
    assert len(set(trained)) == len(trained) and not set(trained) & set(dropped), trained
    missing = held - set(trained) - set(dropped)
    assert not missing, f"groups the replica held were never trained nor dropped: {sorted(missing)}"
    return {g: at.get(g, "dropped") for g in sorted(held)}


def _check_cell(name: str, cell: dict[str, Any], records: list[dict[str, Any]], waited_s: float = 0.0) -> str:
    """The checks every cell shares (see the module docstring) on its job's metrics; a line for the report.
    `waited_s`: the bound the push at the fault waited on replica 1 (a hung one), none for the others."""
    step = cell["step"]
    # the point fired in replica 1's own server group, at a push of this job that left room to train what it
    # gave back, with requests of named groups held, one at least with an output token
    assert 1 <= step <= LAST_FAULT_STEP, (name, step)
    assert cell["record"]["pgid"] == cell["server"], (name, cell["record"], cell["server"])
    assert cell["groups"] and None not in cell["groups"], (name, cell["record"])
    assert max(cell["held"].values()) >= 1, (name, cell["held"])
    # every step trained at its version; the fault's push reached replica 0 alone, later steps had one replica
    assert [r["step"] for r in records] == list(range(STEPS))
    assert [r["policy_version"] for r in records] == list(range(STEPS))
    assert all(set(r["sync/served_versions"]) == {"0", "1"} for r in records[:step]), (name, records[:step])
    hit = records[step]
    assert hit["sync/versions"] == [step] and hit["sync/served_versions"] == {"0": str(step)}, (name, hit)
    assert waited_s - 1.0 <= hit["sync/seconds"] < waited_s + PUSH_S, (name, hit["sync/seconds"])
    assert all(r["fleet/replicas_in_sync"] == 1 for r in records[step:]), name
    assert all(r["fleet/replicas"] == 1 for r in records[step + 1:]), name
    # nothing lost, nothing trained twice; the held groups generated again and trained
    held = cell["groups"]
    where = _accounting(records, held)
    requeued = records[-1]["fleet/requeued_groups"]
    assert requeued >= len(held), (name, requeued, held)
    return (f"{name}: push at step {step} ({cell['passes']} earlier pushes held nothing); replica 1 held "
            f"{len(cell['held'])} responses of groups {sorted(held)} -> trained at steps {where}; "
            f"requeued {requeued}; push {hit['sync/seconds']:.1f} s")


@pytest.mark.slow  # as the other fault matrices: `make test-all` (its step-0 k3 failure: docs/sync.md's stale KV)
@pytest.mark.kills_session_fleet("moe_fleet_2x1")
@pytest.mark.timeout(900)
def test_a_replica_failing_while_it_holds_requests_loses_no_group(moe_fleet_2x1, tiny_moe_dir, session_failpoints,
                                                                  tmp_path, capfd):
    root = tmp_path
    mixed_dir, killed_dir = root / "mixed", root / "killed"
    cfgs = [prepare(None, _overrides(tiny_moe_dir, d, M, N, STEPS, *JOB)) for d in (mixed_dir, killed_dir)]
    cells = _Cells(session_failpoints, moe_fleet_2x1, mixed_dir, killed_dir)
    cells.start()
    started = time.monotonic()
    try:
        train_jobs_in_one_set_of_ranks(cfgs, 2, moe_fleet_2x1.urls, root)
    finally:
        cells.deadline = 0  # a cell still waiting gives up (and disarms its points)
        cells.join(10)
    wall = time.monotonic() - started
    said = capfd.readouterr().err
    assert cells.error is None and set(cells.cells) == {"M", "K"}, (cells.error, cells.cells.keys(), said[-3000:])
    report = [_check_cell(name, cells.cells[name], _records(run_dir))
              for name, run_dir in (("M", mixed_dir), ("K", killed_dir))]
    m = cells.cells["M"]
    # M: the load failed in replica 1's own worker (not the trainer); the held requests' calls were answered after an
    # abort (replica 1's access log), it was never resumed and stays paused: no token from its half-loaded model
    assert m["loader_in_replica"], (m["record"], m["server"])
    # replica 1's access log from the pause of the push at the fault (earlier pushes since the point was armed went
    # by: each paused and resumed it)
    since = m["log"]
    abort = since.find("POST /pause?mode=abort")
    assert abort >= 0, since[-3000:]
    log = since[since.rfind("POST /pause?mode=keep", 0, abort):]
    assert log.startswith("POST /pause?mode=keep") and "POST /resume" not in log, since[-3000:]
    assert m["aborted"] >= len(m["held"]), (m["aborted"], m["held"])  # the engine's count: every held response
    answered = log.count('"POST /inference/v1/generate HTTP/1.1" 200')
    assert answered >= len({rid for rid, _ in m["held"]}), (answered, m["held"], log[-3000:])
    assert m["paused"] is True
    # what the trainer said (its ranks' stderr reaches this test's capture only where their forkserver started
    # under it, so it is shown, not asserted)
    lines = [ln for ln in said.splitlines() if "given up like a replica that died" in ln
             or "the replica dropped its requests" in ln]
    # K: the killed server's whole group is gone
    k = cells.cells["K"]
    assert not process_group_members(k["server"])
    print("\n".join(report) + f"\nM: the engine aborted {m['aborted']:.0f} responses, {answered} generate calls "
          f"answered 200; K: replica 1's group gone "
          f"{k['gone_s']:.1f} s after the kill; both jobs: {wall:.0f} s; the trainer said: {lines}")


@pytest.mark.slow
@pytest.mark.kills_session_fleet("moe_fleet_2x1")
@pytest.mark.timeout(900)
def test_an_engine_dying_while_its_replica_holds_requests_loses_no_group(moe_fleet_2x1, tiny_moe_dir,
                                                                         session_failpoints, tmp_path):
    """Cell E: one job; `push.held.replica1` armed `kill-engine-if-held`: replica 1's worker, asked by the push's
    lifecycle what it holds, SIGKILLs its engine core (what a CUDA error or an out-of-memory kill does) if it holds
    requests. Its API server lives on for a moment: the held requests' calls and the push's RPC are answered with
    errors, not refused; the push goes on to replica 0, the lost requests' chunks go back to the queue, and the API
    server exits by itself (`megarl.rollout.engine_death`). The checks every cell shares, and: the engine core the
    worker killed is gone, and so is replica 1's whole process group."""
    run_dir = tmp_path / "engine"
    cfg = prepare(None, _overrides(tiny_moe_dir, run_dir, M, N, STEPS, *JOB))
    cells = _Cells(session_failpoints, moe_fleet_2x1, run_dir, run_dir, "E")
    cells.start()
    try:
        train_jobs_in_one_set_of_ranks([cfg], 2, moe_fleet_2x1.urls, tmp_path)
    finally:
        cells.deadline = 0
        cells.join(10)
    assert cells.error is None and set(cells.cells) == {"E"}, (cells.error, cells.cells.keys())
    e = cells.cells["E"]
    line = _check_cell("E", e, _records(run_dir))
    assert e["record"]["engine_core"] != e["server"] and not process_group_members(e["server"]), e["record"]
    print(f"{line}; replica 1's group gone {e['gone_s']:.1f} s after its engine core was killed")


@pytest.mark.slow
@pytest.mark.kills_session_fleet("moe_fleet_2x1")
@pytest.mark.timeout(900)
def test_an_engine_hanging_while_its_replica_holds_requests_loses_no_group(moe_fleet_2x1, tiny_moe_dir,
                                                                           session_failpoints, tmp_path):
    """Cell W (a wedged engine; see the module docstring): the checks every cell shares (the push at the fault
    waited its bound, `sync.timeout_fixed_s` = WEDGED_BOUND_S, and no more), and: replica 1's /health answered 503,
    its engine core was still stopped when the job ended (nothing continued it), and the held groups were requeued
    by the step whose push dropped the replica (`RolloutWorker.drop` gives back the chunks of a replica the sync
    dropped, whose calls still wait on the hung engine), not once its /health had failed for the bound."""
    run_dir = tmp_path / "hung"
    cfg = prepare(None, _overrides(tiny_moe_dir, run_dir, M, N, STEPS, *JOB, f"sync.timeout_fixed_s={WEDGED_BOUND_S}"))
    cells = _Cells(session_failpoints, moe_fleet_2x1, run_dir, run_dir, "W")
    cells.start()
    server = moe_fleet_2x1.procs[1].pid
    try:
        train_jobs_in_one_set_of_ranks([cfg], 2, moe_fleet_2x1.urls, tmp_path)
    finally:
        cells.deadline = 0
        cells.join(10)
        record = cells.cells.get("W", {}).get("record") or {}
        stopped = process_state(record["engine_core"]) if "engine_core" in record else None
        if process_group_members(server):  # the test's own clean-up, after the job: the fixture restarts it
            os.killpg(server, signal.SIGKILL)
    assert cells.error is None and set(cells.cells) == {"W"}, (cells.error, cells.cells.keys())
    w = cells.cells["W"]
    records = _records(run_dir)
    line = _check_cell("W", w, records, waited_s=WEDGED_BOUND_S)
    assert stopped == "T", (stopped, w["record"])
    # the held groups went back to the queue when the push dropped the replica (`RolloutWorker.drop`), not once its
    # /health had failed for the bound (tens of seconds later): the step the push preceded counts them
    assert records[w["step"]]["fleet/requeued_groups"] >= len(w["groups"]), (records[w["step"]], w["groups"])
    print(f"{line}; replica 1's /health 503 {w['unhealthy_s']:.1f} s after its engine core was stopped")
