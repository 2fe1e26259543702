"""Session fixtures for the real rollout fleet: the tiny MoE checkpoint, ONE vLLM server (tensor parallel 2)
shared by every test of the session, and a two-replica fleet (tensor parallel 1 each) for the pipeline tests,
each killed (whole process group) at the end.

Every fleet of the session (these and the module fleets of other test files) is guarded by one session secret,
the `fleet_secret` fixture, and `MEGARL_FLEET_SECRET_FILE` names it for the whole session, so `RolloutClient`s and
spawned trainer ranks send it. (Set once for the session, not per fleet: a module fleet that set and restored it
could unset it under a session fleet made after it.)

Imported by `tests/conftest.py`; tests that change the server's weights must say so, and tests
that need particular weights push them first (`PartitionedWeightSync.push`).

A test that kills a replica of a session fleet (a server, or a worker, which ends its server) says so with
`@pytest.mark.kills_session_fleet("moe_fleet_2x1")`: such tests run after every other test of the session
(`order_fleet_killers_last`, conftest's collection hook), so the fleet serves its other users whole and nobody starts
a fleet of its own to kill; after one, `revive_killed_fleets` restarts the killed replicas of the fleets it names
when a later test of the session still asks for them (another killer of the same fleet), at new URLs in the same
`FleetHandle`. A test that leaves a session fleet serving weights no later test could use (a diverged run's
blown-up weights) says so with `@pytest.mark.spoils_session_fleet("moe_fleet_2x1")`: it runs after every other test
but before the killers, whose every use of the fleet begins with a full push.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from megarl.models.tiny import make_tiny_checkpoint
from megarl.rollout.fleet import FleetHandle, FleetSpec, launch, node_replicas
from megarl.rollout.fleet_auth import SECRET_ENV, new_fleet_secret
from tests.dist_utils import process_group_members

ENGINE_BOUND_S = 10  # moe_fleet_2x1's rollout.step_timeout_s: how long its engine cores may leave a probe unanswered


def perturbed_checkpoint(src: Path, out: Path, seed: int) -> Path:
    """A copy of checkpoint `src` in `out` with every tensor moved by 0.05 * N(0, 1): weights a trainer can push
    that differ from what the fleet serves."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    for f in src.iterdir():
        shutil.copy(f, out / f.name)
    g = torch.Generator().manual_seed(seed)
    tensors = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in load_file(out / "model.safetensors").items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def sparsely_changed(src: Path, out: Path, fraction: float, seed: int) -> Path:
    """A copy of checkpoint `src` in `out` where a `fraction` of each tensor's elements moved (as a small optimizer
    step leaves most bits alone), except: the final norm unchanged, the first layer's q_proj changed everywhere
    (every encoding of a delta push meets a block)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in src.iterdir():
        shutil.copy(f, out / f.name)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        share = 0.0 if name == "model.norm.weight" else 1.0 if name.endswith("0.self_attn.q_proj.weight") else fraction
        mask = torch.rand(t.shape, generator=g) < share
        tensors[name] = torch.where(mask, t + 0.01 * torch.randn(t.shape, generator=g), t)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "moe", kind="moe")


LONG_POSITIONS = 1024  # the context of `tiny_moe_long_dir`, which `moe_fleet` serves


@pytest.fixture(scope="session")
def tiny_moe_long_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny MoE at a context of `LONG_POSITIONS` (`make_tiny_checkpoint(positions=...)`): the same weights as
    `tiny_moe_dir` (rotary positions hold none), so trainers built from `tiny_moe_dir` push into a server of it, and
    transformers' forward of either agrees on the first 128 positions. A response can be ~1,000 tokens long: long
    enough that a test's request is still generating after a push's way to its pause on a loaded machine."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_long") / "moe", kind="moe", positions=LONG_POSITIONS)


@pytest.fixture(scope="session")
def moe_fleet(tiny_moe_long_dir: Path, fleet_secret: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetHandle]:
    """A real vLLM OpenAI-compatible server, TP 2, serving the tiny MoE with megarl's weight-transfer backend, at a
    context of `LONG_POSITIONS` (`tiny_moe_long_dir`: the weights of `tiny_moe_dir`). The only difference a test sees
    is that a request may run past 128 positions (tests/test_inflight_push.py's long responses); vLLM's flags are
    the same (`_cpu_args`: a step's token budget of 4,096 at TP 2 either way)."""
    spec = FleetSpec(model_dir=tiny_moe_long_dir, tp=2, log_dir=tmp_path_factory.mktemp("fleet_logs"),
                     secret_file=fleet_secret)
    with launch(spec) as fleet:
        _SPECS[id(fleet)] = spec
        yield fleet
    _assert_gone(fleet)


@pytest.fixture(scope="session")
def session_failpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's failpoint directory (`megarl.sync.failpoints`), named by `MEGARL_FAILPOINTS` from the start of
    `moe_fleet_2x1` until the session ends, so that its servers (restarted ones too) and the trainer ranks spawned
    against it look there; no point is armed unless a test creates its file (tests/test_fault_inflight.py). A test
    that needs a directory of its own sets the variable itself (tests/test_fault_matrix.py)."""
    from megarl.sync import failpoints

    points = tmp_path_factory.mktemp("failpoints")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(failpoints.ENV, str(points))
        yield points


@pytest.fixture(scope="session")
def moe_fleet_2x1(tiny_moe_dir: Path, fleet_secret: Path, session_failpoints: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetHandle]:
    """Two replicas of the tiny MoE, tensor parallel 1 each: several replicas generate at the same time. Their
    rollout.step_timeout_s is `ENGINE_BOUND_S`: an engine core silent that long is judged hung
    (`megarl.rollout.engine_probe`), and so is a step of their worker (vLLM's CPU backend runs one at TP 1 too).
    Their servers see the session's failpoint directory (`session_failpoints`)."""
    spec = FleetSpec(model_dir=tiny_moe_dir, tp=1, replicas=2, log_dir=tmp_path_factory.mktemp("fleet2_logs"),
                     secret_file=fleet_secret, step_timeout_s=ENGINE_BOUND_S)
    with launch(spec) as fleet:
        _SPECS[id(fleet)] = spec
        yield fleet
    _assert_gone(fleet)


_SPECS: dict[int, FleetSpec] = {}  # id(session FleetHandle) -> the spec it was launched with
KILLS_FLEET = "kills_session_fleet"  # the marker: @pytest.mark.kills_session_fleet("moe_fleet", ...)
SPOILS_FLEET = "spoils_session_fleet"  # @pytest.mark.spoils_session_fleet("moe_fleet_2x1"): leaves unusable weights


def order_fleet_killers_last(items: list[pytest.Item]) -> None:
    """Move the tests marked `spoils_session_fleet`, then those marked `kills_session_fleet`, after every other
    test, each group in its own order (in place)."""
    def group(item: pytest.Item) -> int:
        return 2 if item.get_closest_marker(KILLS_FLEET) else 1 if item.get_closest_marker(SPOILS_FLEET) else 0

    items.sort(key=group)  # stable: the collection order within each group


@pytest.fixture(autouse=True)
def revive_killed_fleets(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test marked `kills_session_fleet(names...)`: each named session fleet that a later test of the session
    asks for gets its dead replicas restarted (`restart_dead_replicas`); nothing for other tests."""
    marker = request.node.get_closest_marker(KILLS_FLEET)
    fleets = {name: request.getfixturevalue(name) for name in marker.args} if marker else {}
    yield
    if not fleets:
        return
    items = request.session.items
    later = items[items.index(request.node) + 1:]
    for name, fleet in fleets.items():
        if any(name in item.fixturenames for item in later):
            restart_dead_replicas(fleet)


def restart_dead_replicas(fleet: FleetHandle) -> list[int]:
    """Start a new server for each replica of session fleet `fleet` whose server exited (its process group killed
    first: workers it left), in place in the handle (new URL and process; the log is appended to); the restarted
    replica indices."""
    spec, restarted = _SPECS[id(fleet)], []
    for i, proc in enumerate(fleet.procs):
        if proc.poll() is None:
            continue
        _kill_leftovers(proc.pid)
        # the replica's own cores, as in the whole fleet (megarl.rollout.cpu_binding)
        new = launch(replace(spec, replicas=1, first_replica=i, node_replicas=node_replicas(spec)), restart=True)
        fleet.urls[i], fleet.procs[i] = new.urls[0], new.procs[0]
        restarted.append(i)
    return restarted


def _kill_leftovers(group: int) -> None:
    """SIGKILL what is left of a dead server's process group (its engine core, workers) and wait until it is gone."""
    import os
    import signal

    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.time() + 10
    while process_group_members(group) and time.time() < deadline:
        time.sleep(0.2)
    assert not process_group_members(group), f"a dead replica's processes outlived it: {process_group_members(group)}"


@pytest.fixture(scope="session")
def fleet_secret(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's one fleet secret (mode 0600), named by `MEGARL_FLEET_SECRET_FILE` until the session ends."""
    secret = new_fleet_secret(tmp_path_factory.getbasetemp())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SECRET_ENV, str(secret))
        yield secret


def _assert_gone(fleet: FleetHandle) -> None:
    groups = {proc.pid for proc in fleet.procs}  # each server leads its own process group
    deadline = time.time() + 10  # SIGKILL is asynchronous
    while process_group_members(*groups) and time.time() < deadline:
        time.sleep(0.2)
    assert not process_group_members(*groups), f"vLLM processes outlived the fleet: {process_group_members(*groups)}"
