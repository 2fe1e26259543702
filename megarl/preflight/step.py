"""One check step: `megarl preflight rank` (each trainer rank) or `megarl preflight serve --replica I`.

The step listens where its real counterpart would, says hello, checks the model files and its GPUs, waits (at most
`wait_s`) for every other step's hello, probes the endpoints the real run connects to, writes its report, and waits
(at most `wait_s` again) for the reports of the steps that said hello, so its listeners stay up while they probe.
It exits 0 whatever it found (the findings are in its report, for `megarl preflight report`); 1 only when it
cannot write its files."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from megarl.config.load import ConfigError
from megarl.config.schema import Config
from megarl.models.layer_backend import te_installed
from megarl.preflight import files
from megarl.preflight.analysis import describe
from megarl.preflight.gpu import DRIVER_FILE, check_gpus
from megarl.preflight.host_memory import host_memory_finding, step_memory_bytes
from megarl.preflight.identity import visible_devices, who
from megarl.preflight.model_files import check_model
from megarl.preflight.net import Listeners, probe
from megarl.preflight.versions import check_versions, layer_spec_problems
from megarl.roles import SYNC_PORT_ENV, gpu_replica_host_mb, node_address
from megarl.stacks import stack_for

RENDEZVOUS, SYNC, HTTP = "rendezvous store", "weight-sync store", "HTTP server"
_LISTEN_FIX = {RENDEZVOUS: "set MEGARL_MASTER_PORT to a free port (or MEGARL_MASTER_ADDR to this node's address)",
               SYNC: f"set {SYNC_PORT_ENV} to a free port (or MEGARL_MASTER_ADDR to this node's address)",
               HTTP: "set rollout.port to the first of a free port range, or 0 (any free port)"}
Plan = Callable[[dict[str, dict[str, Any]]], list[dict[str, Any]]]


def _say(line: str) -> None:
    print(f"megarl preflight: {line}", file=sys.stderr, flush=True)


def _endpoint(hello: dict[str, Any] | None, what: str) -> dict[str, Any] | None:
    return next((e for e in (hello or {}).get("listens", []) if e["what"] == what), None)


def _probe_listed(what: str, host: str, port: int, to: str, owner: dict[str, Any] | None) -> dict[str, Any]:
    """Probe host:port unless its owner's hello says it could not listen there (its own finding says why)."""
    listed = _endpoint(owner, what)
    if listed is not None and not listed["ok"]:
        return {"what": what, "to": to, "target": f"{host}:{port}", "ok": None, "seconds": 0.0,
                "error": f"{to} could not listen there"}
    return probe(what, host, port, to)


def _findings(listeners: Listeners, probes: list[dict[str, Any]], model: dict[str, Any],
              gpus: dict[str, Any], versions: dict[str, Any]) -> list[str]:
    found = [f"cannot listen on {e['host']}:{e['port']} for the {e['what']}: {e['error']}: {_LISTEN_FIX[e['what']]}"
             for e in listeners.endpoints if not e["ok"]]
    found += [f"cannot reach the {p['what']} of {describe(p['to'])} at {p['target']}: {p['error']}: check that it "
              "runs and that this node reaches that address (firewall; MEGARL_MASTER_ADDR / MEGARL_BIND_ADDR on the "
              "job's network)" for p in probes if p["ok"] is False]
    return found + model["problems"] + gpus["problems"] + versions["problems"]


def run_step(cfg: Config, me: dict[str, Any], listeners: Listeners, plan: Plan, findings: list[str],
             wait_s: float, use_gpus: list[int] | None) -> int:
    """The common course of a check step; `me` is its identity (`identity.who`), `plan` turns the hellos seen
    into its probes."""
    directory = files.preflight_dir(cfg.run.dir)
    key = files.step_key(me["role"], me["index"])
    listeners.start()
    try:
        hello = me | {"key": key, "listens": listeners.endpoints, "time": time.time()}
        try:
            files.write(directory, "hello", key, hello)
        except OSError as err:
            _say(f"{describe(key)} on {me['node']} cannot write to {directory} ({err.strerror or err}): the run "
                 "directory must exist and be writable on every node (run `megarl prepare --preflight` first)")
            return 1
        model = check_model(cfg.model.hf_dir)
        visible = visible_devices()
        try:
            gpus = check_gpus(me["node"], None if visible is None else len(visible), use_gpus)
        except Exception as err:  # torch itself broken on a GPU node: a finding, and the report still gets written
            gpus = {"driver": True, "usable": False, "reason": None, "devices": [],
                    "problems": [f"the GPU check failed: {type(err).__name__}: {err}"]}
        try:  # the role's lock, on a GPU node or a CPU node, or the one $MEGARL_STACK names
            versions = check_versions(stack_for(me["role"], gpus["driver"]), role=me["role"])
        except ValueError as err:
            versions = {"stack": None, "lock": None, "packages": {}, "problems": [str(err)]}
        versions["problems"] += layer_spec_problems(cfg.trainer.layer_spec, me["role"], gpus["driver"], te_installed())
        others = [k for k in files.expected_keys(cfg) if k != key]
        hellos = files.wait_for(directory, "hello", others, wait_s) | {key: hello}
        probes = plan(hellos)
        report = hello | {"unseen": [k for k in others if k not in hellos], "probes": probes, "model": model,
                          "gpu_check": gpus, "versions": versions,
                          "findings": findings + _findings(listeners, probes, model, gpus, versions),
                          "wait_s": wait_s, "time": time.time()}
        try:
            files.write(directory, "report", key, report)
        except OSError as err:
            _say(f"{describe(key)} on {me['node']} cannot write its report to {directory}: {err.strerror or err}")
            return 1
        _say(f"{describe(key)} on {me['node']}: {sum(p['ok'] is True for p in probes)}/{len(probes)} probe(s) ok, "
             f"{len(report['findings'])} finding(s); waiting for the others' reports")
        files.wait_for(directory, "report", [k for k in hellos if k != key], wait_s)
        return 0
    finally:
        listeners.close()


def rank_step(cfg: Config, wait_s: float) -> int:
    """A trainer rank's check: rank 0 listens on the rendezvous and weight-sync ports and probes every replica's
    HTTP port; the other ranks probe rank 0's two ports, at the addresses the real ranks would use."""
    from megarl.parallel.launcher_env import LauncherEnvError, process_place

    try:
        place = process_place()
    except LauncherEnvError as err:
        raise ConfigError(str(err)) from None
    if place is None:
        raise ConfigError("megarl preflight rank runs under srun or torchrun (no SLURM_PROCID or RANK/WORLD_SIZE in "
                          "the environment)")
    findings = []
    if place.world_size != cfg.trainer.world_size:
        findings.append(f"{place.launcher} started {place.world_size} ranks but trainer.world_size="
                        f"{cfg.trainer.world_size}: start exactly trainer.world_size ranks (srun --ntasks)")
    sync_port = int(os.environ.get(SYNC_PORT_ENV) or place.master_port + 1)
    listeners = Listeners()
    if place.rank == 0:
        if not place.launcher_store:  # under torchrun its agent holds the rendezvous port
            listeners.add(RENDEZVOUS, place.master_addr, place.master_port)
        listeners.add(SYNC, place.master_addr, sync_port)

    def plan(hellos: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        if place.rank != 0:
            return [_probe_listed(what, place.master_addr, port, "rank0", hellos.get("rank0"))
                    for what, port in ((RENDEZVOUS, place.master_port), (SYNC, sync_port))]
        probes = []
        for i in range(cfg.rollout.replicas):
            key = files.step_key("serve", i)
            http = _endpoint(hellos.get(key), HTTP)
            if http is None:
                probes.append({"what": HTTP, "to": key, "target": None, "ok": None, "seconds": 0.0,
                               "error": f"{describe(key)} never said hello" if key not in hellos
                               else f"{describe(key)} has no address to listen on"})
            else:
                probes.append(_probe_listed(HTTP, http["host"], http["port"], key, hellos[key]))
        return probes

    me = who("rank", place.rank, place.local_rank)
    return run_step(cfg, me, listeners, plan, findings, wait_s, [place.local_rank])  # the device it computes on


def _sync_target(hellos: dict[str, dict[str, Any]]) -> tuple[str, int] | None:
    """Where rank 0's weight-sync store is: from its hello, else from this step's own environment (what the job
    script gave every step), else unknown."""
    listed = _endpoint(hellos.get("rank0"), SYNC)
    if listed is not None:
        return listed["host"], listed["port"]
    addr, port = os.environ.get("MEGARL_MASTER_ADDR"), os.environ.get("MEGARL_MASTER_PORT")
    sync = os.environ.get(SYNC_PORT_ENV) or (str(int(port) + 1) if port and port.isdigit() else None)
    return (addr, int(sync)) if addr and sync and sync.isdigit() else None


def serve_step(cfg: Config, replica: int, wait_s: float, host: str | None = None) -> int:
    """A replica's check: listen on its HTTP port at the address the real server would use; probe trainer rank 0's
    weight-sync store (the replica's workers join it during every weight push)."""
    if not 0 <= replica < cfg.rollout.replicas:
        raise ConfigError(f"--replica {replica}: the config has rollout.replicas={cfg.rollout.replicas} "
                          f"(replicas 0..{cfg.rollout.replicas - 1})")
    findings: list[str] = []
    if DRIVER_FILE.exists():  # a GPU node: the staged receivers' pinned shards must fit the step's memory
        need_mb = gpu_replica_host_mb(cfg)
        memory = None if need_mb is None else host_memory_finding(need_mb, step_memory_bytes(), replica)
        if memory is not None:
            findings.append(memory)
    listeners = Listeners()
    try:
        address = host or node_address()
    except ConfigError as err:
        findings.append(str(err))
    else:
        listeners.add(HTTP, address, cfg.rollout.port + replica if cfg.rollout.port else 0)

    def plan(hellos: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        target = _sync_target(hellos)
        if target is None:
            return [{"what": SYNC, "to": "rank0", "target": None, "ok": None, "seconds": 0.0,
                     "error": "trainer rank 0 never said hello"}]
        return [_probe_listed(SYNC, *target, "rank0", hellos.get("rank0"))]

    return run_step(cfg, who("serve", replica, 0), listeners, plan, findings, wait_s, None)
