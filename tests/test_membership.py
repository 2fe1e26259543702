"""Which rollout replicas the trainer judges restarted (`megarl.rollout.membership.Roster`), from real registration
files in a run directory (`megarl.rollout.rendezvous.register_replica`, as `megarl serve` writes them): a replica is
restarted when it is registered, with this job's secret, as an incarnation (node and pid) other than the one the
trainer holds; one registered as the incarnation the run started with, or not registered, is not."""

from __future__ import annotations

import socket

from megarl.rollout.membership import Roster
from megarl.rollout.rendezvous import register_replica, unregister_replica
from tests.dist_utils import free_port

SECRET = "this-jobs-secret"
URLS = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]  # nothing listens there: a probe is refused at once
HOST = socket.gethostname()


def _started(run_dir) -> Roster:
    """A run that started with three replicas registered by processes 100, 101, 102."""
    for i, url in enumerate(URLS):
        register_replica(run_dir, i, url, SECRET, pid=100 + i)
    return Roster(run_dir, SECRET, URLS)


def test_the_replicas_the_run_started_with_are_not_restarted(tmp_path):
    roster = _started(tmp_path)
    assert roster.known == {0: f"{HOST}:100", 1: f"{HOST}:101", 2: f"{HOST}:102"}
    assert roster.new_incarnations(range(3)) == {}
    assert roster.restarted(range(3)) == {}


def test_a_replica_registered_again_by_another_process_is_restarted(tmp_path):
    roster = _started(tmp_path)
    register_replica(tmp_path, 1, URLS[1], SECRET, pid=201)  # same URL, new process: a new incarnation
    assert roster.new_incarnations(range(3)) == {1: (URLS[1], f"{HOST}:201")}
    assert roster.new_incarnations([0, 2]) == {}  # only among the replicas asked about
    register_replica(tmp_path, 2, "http://127.0.0.1:9", SECRET, pid=202)  # elsewhere
    assert roster.new_incarnations(range(3)) == {1: (URLS[1], f"{HOST}:201"), 2: ("http://127.0.0.1:9",
                                                                                  f"{HOST}:202")}


def test_unregistered_replicas_and_other_jobs_files_are_not_restarted(tmp_path):
    roster = _started(tmp_path)
    unregister_replica(tmp_path, 0)  # stopped, not back yet
    register_replica(tmp_path, 1, URLS[1], "an-earlier-jobs-secret", pid=301)  # another job's file
    assert roster.new_incarnations(range(3)) == {}
    assert Roster(tmp_path, None, URLS).new_incarnations(range(3)) == {}  # no secret: a fleet the caller keeps


def test_a_replica_that_started_elsewhere_is_held_as_unknown(tmp_path):
    """Registered at another URL than the run started with: the trainer holds no incarnation of it, so the
    registration is a new one."""
    register_replica(tmp_path, 0, URLS[0], SECRET, pid=100)
    register_replica(tmp_path, 1, "http://127.0.0.1:7", SECRET, pid=101)
    roster = Roster(tmp_path, SECRET, URLS[:2])
    assert roster.known == {0: f"{HOST}:100", 1: None}
    assert roster.new_incarnations(range(2)) == {1: ("http://127.0.0.1:7", f"{HOST}:101")}


def test_a_restarted_replica_that_does_not_answer_yet_is_asked_again(tmp_path):
    """Registered, but nothing serves at its URL yet: not offered, so `admitted` keeps it unknown and the next push
    point judges it restarted again."""
    roster = _started(tmp_path)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    register_replica(tmp_path, 1, dead, SECRET, pid=401)
    assert roster.restarted(range(3)) == {}
    roster.admitted([1])
    assert roster.known[1] == f"{HOST}:101"
    assert roster.new_incarnations(range(3)) == {1: (dead, f"{HOST}:401")}
