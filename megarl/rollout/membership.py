"""Which replicas take part in the run, kept in step at each push point (trainer rank 0 drives it, every trainer
rank follows):

    before the push  replicas the rollout worker lost leave the weight sync; replicas a launcher restarted (a new
                     registration in <run.dir>/fleet/, `megarl.rollout.rendezvous.registrations`) join it again,
                     each in a sync group of its own (`PartitionedWeightSync.admit`)
    the push         sends the current weights to every replica in the sync: in full to a rejoined one (it holds
                     no delta base); a replica that dies meanwhile leaves it (`PartitionedWeightSync.leave_replicas`)
    after the push   the rollout worker drops the replicas the sync lost and gives chunks to the rejoined ones,
                     which now hold the same version as the others

The fleet is quiesced at a push point (no replica is generating), so a replica joins or leaves between two windows
and every replica of a window holds the same weights: the lags stay those of the schedule. With partial rollouts
(`sync.inflight`) it is not: a replica lost at a push point has given its chunks back already (they are generated
again on the others, `fleet/requeued_groups`; one whose push failed part-way has had its requests aborted, and its
chunks went back the same way: `megarl.rollout.inflight`), and a rejoined one takes new groups after the push, at
the version the others hold; every token's version is still the engine's own record. Below `rollout.min_replicas` live
replicas the run fails (the sync or the rollout worker raises).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from megarl.rollout.client import RolloutClient, RolloutServerError
from megarl.rollout.rendezvous import condemn_replica, registrations
from megarl.rollout.worker import RolloutWorker

logger = logging.getLogger(__name__)


class Roster:
    """Rank 0's view of the replicas' registrations: which slot a launcher has restarted since the trainer last
    let it in. `urls` are the replicas the run started with; `secret` the job's fleet secret (None: no
    registrations are read, so no replica comes back: a fleet the caller started and keeps); `health_timeout_s`:
    the clients' (`RolloutClient`) bound on a dead replica."""

    def __init__(self, run_dir: Path | str, secret: str | None, urls: list[str],
                 health_timeout_s: float | None = None) -> None:
        self.run_dir, self.secret, self.health_timeout_s = run_dir, secret, health_timeout_s
        now = registrations(run_dir, secret) if secret else {}
        # replica -> the incarnation the trainer holds in the sync (None: not registered as the URL it started with)
        self.known: dict[int, str | None] = {
            i: now[i][1] if i in now and now[i][0] == url else None for i, url in enumerate(urls)}
        self._offered: dict[int, str] = {}  # replica -> the incarnation `restarted` last returned a client of

    def new_incarnations(self, replicas: Iterable[int]) -> dict[int, tuple[str, str]]:
        """Among `replicas`, those registered now (this job's secret) as an incarnation the trainer does not hold:
        replica -> (url, incarnation). A replica registered as the incarnation the trainer holds, or not
        registered at all, is not among them."""
        if not self.secret:
            return {}
        now = registrations(self.run_dir, self.secret)
        return {rep: now[rep] for rep in replicas if rep in now and now[rep][1] != self.known.get(rep)}

    def restarted(self, replicas: Iterable[int]) -> dict[int, RolloutClient]:
        """Among `replicas`, those registered as a new incarnation (`new_incarnations`) that answers with this
        job's secret: replica -> a client of it."""
        back = {}
        for rep, (url, incarnation) in self.new_incarnations(replicas).items():
            client = RolloutClient(url, health_timeout_s=self.health_timeout_s)
            try:
                client.weight_version()
            except RolloutServerError as err:  # registered but not serving (yet): asked again at the next push
                logger.info("rollout replica %d registered again at %s but does not answer yet: %s", rep, url, err)
                continue
            back[rep] = client
            self._offered[rep] = incarnation
        return back

    def condemn(self, replica: int, why: str) -> None:
        """Replica `replica` hangs while its `/health` answers (a push's call to it was not answered within the
        push's bound, `megarl.sync.lifecycle`): condemn the incarnation the trainer holds in the sync, so that its
        launcher kills its process group and restarts it (`megarl.rollout.rendezvous.condemn_replica`). Raises if
        there is none to condemn (no registrations are read, or the replica was not registered as it started)."""
        held = self.known.get(replica)
        if not self.secret or held is None:
            raise RuntimeError(f"replica {replica} has no registration the trainer holds (a fleet the caller keeps): "
                               "no launcher to tell")
        condemn_replica(self.run_dir, replica, held, self.secret, why)

    def admitted(self, replicas: Iterable[int]) -> None:
        """These replicas (from `restarted`) joined the sync: the incarnations `restarted` offered are the known
        ones (one that failed to join stays unknown, so the next push point tries it again; one restarted once more
        since it was offered is a new incarnation, let in at the next push point)."""
        for rep in replicas:
            if rep in self._offered:
                self.known[rep] = self._offered[rep]


def before_push(weight_sync: Any, rollout: RolloutWorker | None, roster: Roster | None, version: int) -> None:
    """Collective over the trainer ranks, at a push point (rank 0 passes its rollout worker and roster, the others
    None): replicas the rollout worker lost leave the sync; restarted replicas join it (a replica restarted before
    anyone noticed it died leaves first)."""
    lost: dict[int, str] = {}
    back: dict[int, RolloutClient] = {}
    if rollout is not None:
        lost = {rep: f"replica {rep} ({rollout.clients[rep].url}) stopped answering while generating: {why}"
                for rep, why in rollout.lost().items() if rep in weight_sync.live}
    if roster is not None:
        back = roster.restarted(range(weight_sync.replicas))
        for rep in back:
            if rep in weight_sync.live and rep not in lost:
                lost[rep] = f"replica {rep} was restarted (it registered again at {back[rep].url})"
    weight_sync.leave_replicas(lost, version, bound=False)  # a restarted replica may rejoin just below
    admitted = weight_sync.admit(back)
    if roster is not None:
        roster.admitted(admitted)
    for rep in admitted:
        if rep in back:
            logger.warning("rollout replica %d (%s) rejoined the weight sync: the push to version %d sends it the "
                           "whole model, then it takes prompts", rep, back[rep].url, version)
    weight_sync.require_min_replicas(version)


def after_push(weight_sync: Any, rollout: RolloutWorker | None) -> None:
    """Rank 0, once the push is done: the rollout worker follows the sync (drops the replicas it lost, lets the
    rejoined ones take chunks)."""
    if rollout is None or weight_sync.fleet is None:
        return
    lost = rollout.lost()
    for rep, why in weight_sync.lost.items():
        if rep not in lost:
            rollout.drop(rep, why)
    for rep, client in weight_sync.fleet.clients.items():
        if rep in lost or client is not rollout.clients[rep]:
            rollout.admit(rep, client)
