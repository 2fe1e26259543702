"""Each replica of a CPU node gets its own cores (megarl/rollout/cpu_binding.py, issue 47): the rule over several
(replicas, TP, cores) cases against hand-written answers and the properties it promises, and on the session's real
two-replica fleet (`moe_fleet_2x1`, TP 1 each) the cores the kernel lets each replica's vLLM worker run on, read from
/proc: different cores, as the rule gives them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megarl.rollout.cpu_binding import NODE_REPLICAS_ENV, node_replicas, rank_cores, threads_bind
from megarl.rollout.fleet import FleetHandle, FleetSpec, replica_env
from tests.proc_cores import cores_of, worker_cores

# (cores, replicas, TP) -> every replica's VLLM_CPU_OMP_THREADS_BIND, written out by hand
CASES = {
    (2, 1, 1): ["0-1"],  # one replica: every core (its worker's main thread on core 0, an OpenMP thread on 1)
    (2, 2, 1): ["0", "1"],  # this machine, two TP-1 replicas: one core each
    (2, 1, 2): ["0|1"],  # one TP-2 replica: a core per rank
    (2, 3, 1): ["nobind"] * 3,  # fewer cores than workers: none pinned
    (2, 2, 2): ["nobind"] * 2,
    (8, 2, 2): ["0-1|2-3", "4-5|6-7"],
    (7, 2, 2): ["0|1", "3|4"],  # block 3: one core per rank, cores 2, 5 and 6 pinned to nobody
    (32, 3, 1): ["0-9", "10-19", "20-29"],
    (16, 4, 4): ["0|1|2|3", "4|5|6|7", "8|9|10|11", "12|13|14|15"],
}


@pytest.mark.parametrize(("cores", "replicas", "tp"), list(CASES))
def test_each_replica_gets_its_own_cores_or_none_is_pinned(cores: int, replicas: int, tp: int) -> None:
    cpus = list(range(cores))
    binds = [threads_bind(cpus, replicas, slot, tp)["VLLM_CPU_OMP_THREADS_BIND"] for slot in range(replicas)]
    assert binds == CASES[cores, replicas, tp]
    if replicas * tp > cores:
        assert all(threads_bind(cpus, replicas, s, tp)["OMP_NUM_THREADS"] == "1" for s in range(replicas))
        return
    owned = [cores_of(b) for b in binds]
    assert sum(map(len, owned)) == len(set().union(*owned)), "two replicas share a core"
    assert all(len(b.split("|")) == tp for b in binds)  # one list per rank
    assert len({len(o) for o in owned}) == 1 and len(owned[0]) >= tp  # equal shares, a core per rank at least
    assert set().union(*owned) <= set(cpus)


def test_the_rule_divides_the_cores_it_is_given_not_the_machine() -> None:
    """A process confined to cores 4-7 (taskset, a SLURM binding) divides those."""
    assert rank_cores([7, 5, 4, 6], 2, 1, 1) == [[6, 7]]
    assert threads_bind([4, 5, 6, 7], 2, 0, 2)["VLLM_CPU_OMP_THREADS_BIND"] == "4|5"
    with pytest.raises(ValueError, match="slot 2 of 2"):
        rank_cores([0, 1], 2, 2, 1)


def test_a_served_replica_shares_its_node_unless_its_step_has_cores_of_its_own() -> None:
    assert node_replicas({NODE_REPLICAS_ENV: "2"}, [0, 1], online=2) == 2  # the job's two replicas on this node
    assert node_replicas({}, [0, 1], online=2) == 1  # no job script: one replica per node
    assert node_replicas({NODE_REPLICAS_ENV: "2"}, [2, 3], online=8) == 1  # SLURM bound the step to 2 of 8 cores
    with pytest.raises(ValueError, match=NODE_REPLICAS_ENV):
        node_replicas({NODE_REPLICAS_ENV: "0"}, [0, 1], online=2)


def test_a_fleet_gives_replica_i_slot_i_also_when_it_starts_one_replica(tmp_path: Path) -> None:
    """A fleet of two and the restart of one of its replicas alone (`node_replicas` set) bind the same cores; one
    started by `megarl serve` for a node of two (`first_replica`, `node_replicas`) too."""
    whole = FleetSpec(model_dir=tmp_path, replicas=2, gpu=False)
    cpus = sorted(os.sched_getaffinity(0))
    for i in range(2):
        expected = threads_bind(cpus, 2, i, 1)
        assert replica_env(whole, i) == expected
        assert replica_env(FleetSpec(model_dir=tmp_path, replicas=1, first_replica=i, node_replicas=2, gpu=False),
                           i) == expected
    assert replica_env(FleetSpec(model_dir=tmp_path, gpu=True), 0) == {}


def test_two_tp1_replicas_workers_run_on_different_cores(moe_fleet_2x1: FleetHandle) -> None:
    """The session's two-replica fleet (TP 1 each): one worker per replica, and the two workers' allowed cores are
    disjoint when this machine has a core for each (as the rule says), none of them pinned when it has not."""
    cores = [worker_cores(p.pid) for p in moe_fleet_2x1.procs]
    assert [len(c) for c in cores] == [1, 1], cores
    first, second = cores[0][0], cores[1][0]
    usable = set(os.sched_getaffinity(0))
    if len(usable) >= 2:
        assert not first & second, f"both replicas' workers may run on core(s) {first & second}"
        assert first | second <= usable
    else:
        assert first == second == usable
