"""A replica that hangs while its `/health` answers (a SIGSTOPped vLLM worker leaves the API server healthy) must not
hold a push for the client's 600 s read timeout (issue 36): the push's calls are bounded by the push's own bound
(`FleetLifecycle.call_timeout_s`, from sync.timeout_fixed_s + bytes / sync.timeout_min_gbps), the replica is failed for
the push (the sync store's key its senders watch) and condemned in the run's fleet registry, and `megarl train`'s
watcher kills its whole process group (megarl/sync/lifecycle.py, megarl/rollout/rendezvous.py,
megarl/rollout/restarts.py).

Real processes, no vLLM: the replica is a stand-in HTTP server in a process group of its own (with a child, as a
server's engine core and workers are) that answers `/health` and every call of a push except `/update_weights`, which
it never answers; trainer rank 0's side is the real `FleetLifecycle` with the real `Roster` and a real TCPStore."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from megarl.parallel.spawn import free_port
from megarl.rollout.client import RolloutClient
from megarl.rollout.fleet import FleetHandle, FleetSpec
from megarl.rollout.fleet_auth import new_fleet_secret, read_secret
from megarl.rollout.liveness import Liveness
from megarl.rollout.membership import Roster
from megarl.rollout.rendezvous import condemn_replica, condemned, incarnation
from megarl.rollout.restarts import ReplicaWatcher
from megarl.sync.heartbeat import BeatWatch, Heartbeat, beat_key
from megarl.sync.lifecycle import FleetLifecycle
from megarl.sync.weight_sync import _failed_key, _update_failed
from tests.dist_utils import process_group_members

BOUND_S = 3.0  # the push's bound on each of its calls (a run's is sync.timeout_fixed_s + bytes / min_gbps)
HEALTH_S = 2.0  # rollout.health_timeout_s: /health answers throughout, so it must never fire
SLACK_S = 15.0  # a loaded 2-core machine

_SERVER = """
import json, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
subprocess.Popen(["sleep", "600"])  # a child in its process group, as a server's engine core and workers are
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self.answer({"weight_version": "default"} if self.path == "/weight_info" else {})
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/update_weights":
            time.sleep(600)  # a TP worker stopped: the engine's collective RPC never returns
        self.answer({"results": [{}]} if self.path == "/collective_rpc" else {})
ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_push_gives_up_on_a_hung_replica_within_its_bound_and_the_watcher_kills_it(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The stand-in replica opens the push, then never answers `/update_weights`. The update call fails after the
    push's bound (not before, and not at the client's 600 s read timeout), its failure is in the sync store (the
    key the senders watch), `close` reports the replica dead without asking it anything more, the trainer's roster
    condemns the incarnation it holds, and the watcher (whose /health check alone would never fire) kills the
    replica's whole process group within a poll. A condemnation of another incarnation (a stale one) is ignored."""
    port = free_port("127.0.0.1")
    url, log = f"http://127.0.0.1:{port}", tmp_path / "vllm_replica0.log"
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(port)], start_new_session=True)
    store = None
    try:
        live = Liveness(url, bound_s=60, every_s=0.2)
        deadline = time.monotonic() + 60
        while not live.probe() or len(process_group_members(proc.pid)) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "the stand-in server did not start"
            time.sleep(0.2)
        secret_file = new_fleet_secret(tmp_path)
        secret, run_dir = read_secret(secret_file), tmp_path / "run"
        fleet = FleetHandle([url], [proc], [log], secret_file)
        watcher = ReplicaWatcher(fleet, FleetSpec(model_dir=tmp_path, gpu=False, log_dir=tmp_path), run_dir,
                                 restarts=0, poll_s=0.2, health_timeout_s=HEALTH_S).start()
        try:
            held = incarnation(proc.pid)
            roster = Roster(run_dir, secret, [url])
            assert roster.known == {0: held}
            # a condemnation of an earlier incarnation of replica 0: not this one's
            condemn_replica(run_dir, 0, incarnation(1), secret, "an earlier incarnation hung")
            time.sleep(1.0)
            assert len(process_group_members(proc.pid)) == 2 and "is dead" not in capfd.readouterr().err

            store = dist.TCPStore("127.0.0.1", free_port("127.0.0.1"), 1, True, timeout=timedelta(seconds=30))
            client = RolloutClient(url, timeout_s=600.0, secret_file=secret_file, health_timeout_s=HEALTH_S)
            fleet_side = FleetLifecycle([client], tp=1, call_timeout_s=BOUND_S, condemn=roster.condemn)
            failure, lost = fleet_side.open()
            assert (failure, lost) == (None, {})
            failed_at: list[float] = []

            def on_fail(rep: int, why: str) -> None:
                failed_at.append(time.monotonic())
                store.set(_failed_key(1, rep), why)

            started = time.monotonic()
            updates = fleet_side.start_updates({0: [{"update_id": "u"}]}, on_fail=on_fail)
            reports, failures, dead = fleet_side.close(updates, version=1, update_id="u")
            closed = time.monotonic() - started
            assert failed_at, "the update call's failure was not reported"
            noticed = failed_at[0] - started
            why = _update_failed(store, 1, 0)
            assert why is not None and "did not answer within 3s" in why, why
            assert (reports, dead) == ([], {0}) and "hangs" in failures[0] and "/update_weights" in failures[0]
            assert "its launcher has restarted it" in failures[0], failures[0]
            assert BOUND_S <= noticed < BOUND_S + SLACK_S and closed < noticed + 2.0, (noticed, closed)
            # condemned: the incarnation the trainer held; the watcher kills its group and removes it all
            while process_group_members(proc.pid) or (run_dir / "fleet" / "replica0.json").exists():
                assert time.monotonic() - started < BOUND_S + SLACK_S, "the condemned replica was not killed"
                time.sleep(0.05)
            killed = time.monotonic() - started
        finally:
            watcher.stop()
        err = capfd.readouterr().err
        print(f"a replica whose /update_weights never answers (its /health answering): the push gave up after "
              f"{noticed:.1f} s (bound {BOUND_S:g} s), closed after {closed:.1f} s; its process group was gone after "
              f"{killed:.1f} s")
        assert f"megarl: rollout replica 0 ({url}) is dead: condemned by the trainer: replica 0 ({url}) hangs: " in err
        assert "its process group was killed (log " in err and "it stays down: no restarts left" in err, err
        assert proc.returncode == -signal.SIGKILL
        assert condemned(run_dir, 0, secret, held) is None, "the condemnation outlived the incarnation it ended"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_replica_whose_worker_stops_beating_is_given_up_at_the_health_bound_not_the_push_bound(
        tmp_path: Path) -> None:
    """A TP-2 stand-in replica whose `/update_weights` never answers: its worker 0 beats (a `Heartbeat` on the sync
    store, as a receiving vLLM worker does), its worker 1 never does (stopped before its part began). With the
    watch on (`silent`, a `BeatWatch` at `rollout.health_timeout_s`), the call is given up once worker 1 has been
    silent for that bound, long before the push's own bound; its failure is in the key the senders watch (so they
    move on to the other replicas' buckets), it names the silent worker, and the replica is condemned."""
    port, push_bound_s = free_port("127.0.0.1"), 60.0
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(port)], start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        live, deadline = Liveness(url, bound_s=60, every_s=0.2), time.monotonic() + 60
        while not live.probe():
            assert time.monotonic() < deadline and proc.poll() is None, "the stand-in server did not start"
            time.sleep(0.2)
        store = dist.TCPStore("127.0.0.1", free_port("127.0.0.1"), 1, True, timeout=timedelta(seconds=30))
        condemned_now: list[tuple[int, str]] = []
        client = RolloutClient(url, timeout_s=600.0, health_timeout_s=HEALTH_S)
        fleet_side = FleetLifecycle([client], tp=2, call_timeout_s=push_bound_s,
                                    condemn=lambda rep, why: condemned_now.append((rep, why)))
        assert fleet_side.open() == (None, {})
        watch = BeatWatch(store, lambda worker: beat_key(1, worker), HEALTH_S)
        with Heartbeat(store, beat_key(1, 0), every_s=0.2):  # worker 0 receives: it beats throughout
            started = time.monotonic()
            updates = fleet_side.start_updates(
                {0: [{"update_id": "u"}, {"update_id": "u"}]},
                on_fail=lambda rep, why: store.set(_failed_key(1, rep), why),
                silent=lambda rep: watch.silent(0) or watch.silent(1))
            reports, failures, dead = fleet_side.close(updates, version=1, update_id="u")
            noticed = time.monotonic() - started
        why = _update_failed(store, 1, 0)
        assert why is not None and "WorkerSilent: vLLM worker 1 sent no heartbeat for " in why, why
        assert "never began its part" in why and "vLLM worker 0" not in why, why
        assert (reports, dead) == ([], {0}) and " hangs: " in failures[0] and "push's bound" not in failures[0]
        assert [rep for rep, _ in condemned_now] == [0] and "vLLM worker 1 sent no heartbeat" in condemned_now[0][1]
        assert HEALTH_S <= noticed < HEALTH_S + SLACK_S < push_bound_s, noticed
        print(f"a replica whose TP worker 1 never beat: given up after {noticed:.1f} s (health bound {HEALTH_S:g} s, "
              f"push bound {push_bound_s:g} s)")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
