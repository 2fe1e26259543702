"""Liveness is health, not a pid (megarl/rollout/liveness.py) and no call waits on a dead replica longer than the
bound (`RolloutClient(health_timeout_s=...)`): against a real HTTP server on a local socket whose `/health` answers
200, then 503 (what vLLM answers once its engine died), or stops answering (a hung server), while a long call to it
waits; and `megarl train`'s watcher kills the process group of a replica whose server process hangs (SIGSTOP). And
a real vLLM replica whose engine core hangs while its API server lives fails /health (megarl/rollout/engine_probe.py),
except while a push route is in flight.
The bound is checked from above with slack for a loaded machine, and against the call's own read timeout, which it
must beat by far."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from megarl.parallel.spawn import free_port
from megarl.rollout.client import RolloutClient, RolloutServerHung, RolloutServerLost, Sample
from megarl.rollout.fleet import FleetHandle, FleetSpec
from megarl.rollout.fleet_auth import new_fleet_secret
from megarl.rollout.liveness import Liveness
from megarl.rollout.restarts import ReplicaWatcher
from tests.blackhole_proxy import blackhole_proxy
from tests.dist_utils import engine_core, process_group_members
from tests.fleet_fixture import ENGINE_BOUND_S

SLACK_S = 15.0  # a loaded 2-core machine: thread start-up, probe intervals
GIVE_UP_S = 20.0  # the bound of a push's call to a hung engine (a run's is sync.timeout_fixed_s + bytes / min_gbps);
# well beyond the seconds the checks of the in-flight window take, so that the RPC is in flight through them


def _failure(call: Callable[[], object], into: list[Exception]) -> None:
    """Run `call`, appending what it raised to `into`."""
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the test looks at it
        into.append(err)


class _Replica(ThreadingHTTPServer):
    """`/health` answers `health` (an int status, or None: never answers); POST `/update_weights` answers `{}` after
    `call_s` seconds."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.health: int | None = 200
        self.call_s = 0.0
        self.released = threading.Event()  # ends every request still held (the test's end)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: _Replica

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/health":
            if self.server.health is None:
                self.server.released.wait()  # hung: never answers
                return
            self._answer(self.server.health, {})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.released.wait(self.server.call_s)
        self._answer(200, {"done": True})


@pytest.fixture
def replica() -> Iterator[_Replica]:
    server = _Replica()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.released.set()
    server.shutdown()
    server.server_close()


def _later(seconds: float, fn) -> None:
    timer = threading.Timer(seconds, fn)
    timer.daemon = True
    timer.start()


@pytest.mark.parametrize("failure", [503, None], ids=["engine-dead-503", "hung"])
def test_a_call_gives_up_on_a_replica_whose_health_fails_for_the_bound(replica: _Replica, failure: int | None) -> None:
    """A push's `/update_weights` waits on a replica whose engine dies (or that hangs) 2 s into the call: the call
    raises `RolloutServerLost` naming /health's failure and the bound, after at least the bound and within it plus
    slack, not after the read timeout (300 s)."""
    bound = 3.0
    replica.call_s = 300.0
    client = RolloutClient(replica.url, timeout_s=300.0, health_timeout_s=bound)
    _later(2.0, lambda: setattr(replica, "health", failure))
    started = time.monotonic()
    with pytest.raises(RolloutServerLost) as err:
        client.update_weights({"names": []})
    took = time.monotonic() - started
    print(f"/health {failure or 'hung'} from 2 s: the call gave up after {took:.1f} s (bound {bound:g} s)")
    assert 2.0 + bound <= took < 2.0 + bound + SLACK_S
    assert "/update_weights: gave up waiting, the replica is dead" in str(err.value)
    assert ("/health answered 503" if failure else "/health did not answer") in str(err.value)
    assert "rollout.health_timeout_s, is 3s" in str(err.value)


def test_a_healthy_replica_s_long_call_is_waited_for(replica: _Replica) -> None:
    """Health, not the call's length: a call that takes 4 s on a replica whose /health answers is waited for, with
    a bound of 1 s; a blip shorter than the bound (503 for 0.5 s) does not end it either."""
    replica.call_s = 4.0
    client = RolloutClient(replica.url, timeout_s=60.0, health_timeout_s=1.0)
    _later(1.0, lambda: setattr(replica, "health", 503))
    _later(1.4, lambda: setattr(replica, "health", 200))
    client.update_weights({"names": []})  # returns: no RolloutServerLost


def test_liveness_counts_one_run_of_failures_and_an_answer_ends_it(replica: _Replica) -> None:
    """`Liveness.dead()` after the bound of failed probes, not before; one 200 ends the run; a failure after a gap in
    the probes starts a new run rather than counting the gap."""
    live = Liveness(replica.url, bound_s=1.5, every_s=0.1)
    assert not live.dead() and live.failing_for() == 0.0
    replica.health = 503
    started = time.monotonic()
    while not live.dead():
        assert time.monotonic() - started < 1.5 + SLACK_S
        time.sleep(0.05)
    assert time.monotonic() - started >= 1.5 and "/health answered 503 for" in live.why()
    replica.health = 200
    time.sleep(0.15)
    assert not live.dead() and live.failing_for() == 0.0
    replica.health = 503
    time.sleep(0.15)
    assert not live.dead()  # one failed probe: a new run
    time.sleep(1.0)  # no probe for a while (> 2 probe intervals + the probe's timeout)
    assert not live.probe() and live.failing_for() < 0.5  # the gap is not counted as failing


def test_a_server_that_refuses_connections_is_dead_after_the_bound() -> None:
    """A replica that is gone (nothing listens on its port) fails every probe: dead after the bound."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    live = Liveness(f"http://127.0.0.1:{port}", bound_s=0.5, every_s=0.1)
    started = time.monotonic()
    while not live.dead():
        assert time.monotonic() - started < 0.5 + SLACK_S
        time.sleep(0.05)
    assert "/health did not answer: ConnectionError" in live.why()



def test_a_call_gives_up_on_a_replica_behind_a_black_holed_network(replica: _Replica) -> None:
    """The network to a replica black-holed 2 s into a push's `/update_weights` (a TCP proxy that then accepts and
    reads but forwards and answers nothing: no refusal, no reset): the call raises `RolloutServerLost` within the
    bound plus slack, each probe giving up after its own timeout (bound / 2 here); once the network forwards again,
    one answered probe ends the run of failures."""
    bound = 3.0
    replica.call_s = 300.0
    with blackhole_proxy("127.0.0.1", replica.server_address[1]) as proxy:
        client = RolloutClient(proxy.url, timeout_s=300.0, health_timeout_s=bound)
        assert client.healthy()
        _later(2.0, proxy.blackhole)
        started = time.monotonic()
        with pytest.raises(RolloutServerLost) as err:
            client.update_weights({"names": []})
        took = time.monotonic() - started
        print(f"network black-holed from 2 s: the call gave up after {took:.1f} s (bound {bound:g} s)")
        assert 2.0 + bound <= took < 2.0 + bound + SLACK_S
        assert "/health did not answer: ReadTimeout" in str(err.value), str(err.value)
        proxy.restore()
        live = Liveness(proxy.url, bound_s=bound, every_s=0.1)
        assert live.probe() and not live.dead()


_SERVER = """
import subprocess, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
subprocess.Popen(["sleep", "600"])  # a child in its process group, as a server's engine core and workers are
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_the_watcher_kills_the_group_of_a_replica_that_hangs(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """`megarl train`'s watcher with a bound of 2 s: a replica's server (a real process serving /health, with a child
    in its process group) stopped for 0.8 s, then continued (SIGCONT), is left alone; then it is stopped for good
    (SIGSTOP): alive, its pid unchanged, not answering. The watcher finds it dead
    after the bound, kills its whole process group, removes its registration and says so (no restarts here:
    rollout.restarts=0, so no vLLM starts; the restart itself is the exited-server path of test_fleet_restarts)."""
    port = free_port("127.0.0.1")
    url, log = f"http://127.0.0.1:{port}", tmp_path / "vllm_replica0.log"
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(port)], start_new_session=True)
    try:
        live = Liveness(url, bound_s=60, every_s=0.2)
        deadline = time.monotonic() + 60
        while not live.probe():
            assert time.monotonic() < deadline and proc.poll() is None, "the stand-in server did not start"
            time.sleep(0.2)
        while len(process_group_members(proc.pid)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        fleet = FleetHandle([url], [proc], [log], new_fleet_secret(tmp_path))
        run_dir = tmp_path / "run"
        watcher = ReplicaWatcher(fleet, FleetSpec(model_dir=tmp_path, gpu=False, log_dir=tmp_path), run_dir,
                                 restarts=0, poll_s=0.2, health_timeout_s=2.0).start()
        try:
            assert (run_dir / "fleet" / "replica0.json").exists()
            # hung for less than the bound, then continued (SIGCONT): it answers again and is left alone
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(0.8)
            os.kill(proc.pid, signal.SIGCONT)
            time.sleep(2.0 + 1.0)  # past the bound, counted from the stop
            assert (run_dir / "fleet" / "replica0.json").exists() and len(process_group_members(proc.pid)) == 2
            assert "is dead" not in capfd.readouterr().err
            os.kill(proc.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            while process_group_members(proc.pid) or (run_dir / "fleet" / "replica0.json").exists():
                assert time.monotonic() - stopped < 2.0 + SLACK_S, "the hung replica was not killed"
                time.sleep(0.1)
            took = time.monotonic() - stopped
        finally:
            watcher.stop()
        err = capfd.readouterr().err
        print(f"a hung replica (SIGSTOP) was found dead and its group killed after {took:.1f} s (bound 2 s)")
        assert took >= 2.0
        assert (f"megarl: rollout replica 0 ({url}) is dead: /health did not answer: ReadTimeout for " in err), err
        assert ("(the bound, rollout.health_timeout_s, is 2s); its process group was killed (log " in err), err
        assert "it stays down: no restarts left (rollout.restarts=0" in err, err
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_hung_engine_core_fails_health_but_not_inside_an_engine_rpc(moe_fleet_2x1: FleetHandle) -> None:
    """A real TP-1 replica (the session's `moe_fleet_2x1`, engine bound `ENGINE_BOUND_S`) whose engine core
    (`VLLM::EngineCore`) is stopped (SIGSTOP) with a generation in flight, its API server alive (vLLM's own /health
    would stay 200: megarl/rollout/engine_probe.py): /health answers 503 after the bound (not before), naming the
    engine core, and `Liveness` judges it dead. A push's `/pause` in flight changes nothing: 503 still (a pause
    lets a live engine core step and answer the probe; a hung one that a push begins to pause is judged, not
    excused). Then an engine RPC that occupies the engine core is called (`/collective_rpc`, as a push's report):
    while it is in flight /health answers 200 although the silence is past the bound. Its caller gives up at its
    bound (`RolloutServerHung`, as a push's call does) and closes the connection: /health answers 503 again the
    engine bound later, although vLLM's handler still waits (without that, a replica no launcher kills would pass
    /health for ever). Continued (SIGCONT): the pause completes, and after `/resume` the generation; /health answers
    200 after the push."""
    url = moe_fleet_2x1.urls[1]
    client = RolloutClient(url)
    engine = engine_core(moe_fleet_2x1.procs[1].pid)
    assert engine is not None, "no engine core in the replica's process group"
    samples: list[list[Sample]] = []

    def health() -> requests.Response:
        return requests.get(f"{url}/health", timeout=5)

    def call(what: Callable[[], object]) -> threading.Thread:
        thread = threading.Thread(target=what, daemon=True)
        thread.start()
        return thread

    try:
        assert health().status_code == 200
        os.kill(engine, signal.SIGSTOP)
        stopped = time.monotonic()
        generating = call(lambda: samples.extend(client.generate([[1, 2, 3]], n=1, max_tokens=16, ignore_eos=True)))
        live = Liveness(url, bound_s=1.0, every_s=0.2)
        while (reply := health()).status_code == 200:
            assert time.monotonic() - stopped < ENGINE_BOUND_S + SLACK_S, "/health stayed 200 with a hung engine core"
            time.sleep(0.2)
        failed = time.monotonic() - stopped
        assert reply.status_code == 503 and "the engine core has not answered for" in reply.text, reply.text
        while not live.dead():
            assert time.monotonic() - stopped < ENGINE_BOUND_S + 2 * SLACK_S, live.why()
            time.sleep(0.2)

        pausing = call(lambda: client.pause(timeout_s=120))  # a push begins; it waits on the stopped engine core
        for _ in range(10):
            assert health().status_code == 503, "a pause excused the hung engine core"
            time.sleep(0.2)
        # an engine RPC that occupies the engine core, as a push's report, whose caller gives up at its bound
        gave_up: list[Exception] = []
        reporting = call(lambda: _failure(lambda: client.collective_rpc("megarl_sync_report", timeout_s=GIVE_UP_S),
                                          gave_up))
        pushed = time.monotonic()
        while health().status_code != 200:
            assert time.monotonic() - pushed < SLACK_S, "/health stayed 503 while an engine RPC was in flight"
            time.sleep(0.2)
        for _ in range(10):
            assert health().status_code == 200, "the engine RPC's window was counted"
            time.sleep(0.2)
        assert pausing.is_alive() and reporting.is_alive()  # both in flight all along
        reporting.join(GIVE_UP_S + SLACK_S)
        assert not reporting.is_alive() and isinstance(gave_up[0], RolloutServerHung), gave_up
        left = time.monotonic()  # the caller left: the window ends, although vLLM's handler still waits
        while (reply := health()).status_code == 200:
            assert time.monotonic() - left < ENGINE_BOUND_S + SLACK_S, "an RPC its caller left excused the hang"
            time.sleep(0.2)
        failed_again = time.monotonic() - left
        assert "the engine core has not answered for" in reply.text, reply.text

        os.kill(engine, signal.SIGCONT)
        pausing.join(30)
        assert not pausing.is_alive()
        client.resume(timeout_s=30)  # the push ends; the generation, queued by the pause, runs
        generating.join(30)
        assert len(samples) == 1 and len(samples[0][0].response_ids) == 16
        assert health().status_code == 200
    finally:
        os.kill(engine, signal.SIGCONT)
        if client.is_paused():
            client.resume(timeout_s=30)
    print(f"a hung engine core failed /health after {failed:.1f} s (bound {ENGINE_BOUND_S} s), and again "
          f"{failed_again:.1f} s after an engine RPC's caller gave up")
    assert failed >= ENGINE_BOUND_S - 0.5  # not before the bound (a probe sent just before the stop counts from then)
    assert failed_again >= ENGINE_BOUND_S - 0.5  # the clock restarts when the caller leaves
