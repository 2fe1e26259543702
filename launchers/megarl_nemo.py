#!/usr/bin/env python3
"""nemo-run experiments that start a megarl job: the same roles and counts as `slurm/megarl_job.sh`, read from
the same typed config as `megarl train`.

    python launchers/megarl_nemo.py --config configs/qwen3_30b_a3b_guru.yaml --executor slurm --dryrun [overrides]
    python launchers/megarl_nemo.py --config configs/demo_moe.yaml --executor local

Roles: `megarl prepare` once, before the others; `megarl serve --replica I` per rollout replica (rollout.tp GPUs
on one node); `megarl rank` per trainer rank (trainer.world_size of them, placed by srun or torchrun).
  slurm  one heterogeneous job: group 0 = trainer nodes (one task per GPU), group 1 = rollout nodes (one replica
         per rollout.tp GPUs); prepare runs first on the first trainer node, then the rank step and one serve step
         per replica. nemo-run restarts no replica: when any step ends it kills the others (launchers/README.md).
  local  one machine: prepare, the replicas in the background, `torchrun --nproc-per-node=trainer.world_size`
         for the ranks; the replicas are stopped (SIGTERM) when the ranks end.
Runs in the launch environment (`make launch-env`, launchers/README.md): nemo-run and megarl's base dependencies,
no torch or vLLM; the nodes (or, for local, --venv) run the training stack. Each role may run from its own
environment: --trainer-venv / --fleet-venv (a venv each: prepare and the ranks run the trainer's megarl, the replicas
the fleet's) and, on slurm, --trainer-container-image / --fleet-container-image.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.config.load import ConfigError, load_config
from megarl.config.schema import Config
from megarl.rollout.cpu_binding import NODE_REPLICAS_ENV

if TYPE_CHECKING:  # nemo-run takes seconds to import: the functions that use it import it, after the config is valid
    import nemo_run as run

REPO = Path(__file__).resolve().parents[1]


def load_recipe(recipe: Path, overrides: list[str]) -> Config:
    """The recipe with its overrides, validated as `megarl train` does, every field included (the algorithm names
    come from the torch-free `megarl/algorithms/catalog.py`, so the launch environment needs no torch)."""
    return load_config(recipe, overrides)


@dataclass(frozen=True)
class Topology:
    """Where the roles go, from the config and the nodes' size."""

    world_size: int  # trainer ranks
    replicas: int  # rollout replicas
    rollout_tp: int  # GPUs per replica
    gpus_per_node: int  # 0: CPU nodes
    trainer_tasks_per_node: int
    replicas_per_node: int

    @classmethod
    def of(cls, cfg: Config, gpus_per_node: int, trainer_tasks_per_node: int | None = None,
           replicas_per_node: int | None = None) -> Topology:
        world, tp = cfg.trainer.world_size, cfg.rollout.tp
        tasks = trainer_tasks_per_node or gpus_per_node or world
        per_node = replicas_per_node or (gpus_per_node // tp if gpus_per_node else 1)
        if gpus_per_node and tp > gpus_per_node:
            raise ConfigError(f"rollout.tp={tp} exceeds --gpus-per-node={gpus_per_node}: a replica runs on one node")
        if gpus_per_node and per_node * tp > gpus_per_node:
            raise ConfigError(f"{per_node} replicas x rollout.tp={tp} do not fit --gpus-per-node={gpus_per_node}")
        if gpus_per_node and tasks > gpus_per_node:
            raise ConfigError(f"{tasks} trainer ranks per node exceed --gpus-per-node={gpus_per_node} (one GPU each)")
        replicas = cfg.rollout.replicas
        return cls(world, replicas, tp, gpus_per_node, min(tasks, world), min(per_node, replicas))

    @property
    def trainer_nodes(self) -> int:
        return -(-self.world_size // self.trainer_tasks_per_node)

    @property
    def rollout_nodes(self) -> int:
        return -(-self.replicas // self.replicas_per_node)

    def replicas_on_node(self, replica: int) -> int:
        """How many replicas the job puts on replica `replica`'s node: replicas_per_node, or fewer on the last."""
        first = replica // self.replicas_per_node * self.replicas_per_node
        return min(self.replicas_per_node, self.replicas - first)


@dataclass(frozen=True)
class Job:
    """What every role command needs: where to run megarl and with which config."""

    cfg: Config
    recipe: str  # as the nodes see it (relative to workdir when it lies in it)
    overrides: list[str]
    workdir: Path  # the megarl checkout on the nodes: the roles run there, so relative paths mean the same
    megarl: list[str]  # how the trainer's environment runs megarl on the nodes (prepare and the ranks)
    fleet_megarl: list[str]  # how the fleet's environment runs it (the replicas)

    @property
    def name(self) -> str:
        return Path(self.recipe).stem

    @property
    def run_config(self) -> str:
        return str(Path(self.cfg.run.dir) / "config.yaml")

    def prepare(self) -> list[str]:
        return [*self.megarl, "prepare", "--config", self.recipe, *self.overrides]

    def serve_log(self, replica: int) -> str:
        """Where replica `replica`'s step writes (as slurm/megarl_job.sh's does): RUN_DIR/logs/serve_replica<i>.log,
        absolute on the nodes. The trainer's register timeout reads its presence as "the step started"."""
        return str(self.workdir / self.cfg.run.dir / "logs" / f"serve_replica{replica}.log")

    def serve(self, replica: int) -> list[str]:
        return [*self.fleet_megarl, "serve", "--config", self.run_config, "--replica", str(replica)]

    def rank(self) -> list[str]:
        return [*self.megarl, "rank", "--config", self.run_config]


def _sh(argv: list[str]) -> str:
    return shlex.join(argv)


def _role(job: Job, argv: list[str]) -> run.Script:
    """A role as a command in the workdir: `env --chdir=WORKDIR megarl ...` (nemo-run's own srun --chdir points
    at its job directory)."""
    import nemo_run as run

    return run.Script(path=f"--chdir={shlex.quote(str(job.workdir))}", args=[shlex.quote(a) for a in argv],
                      entrypoint="env")


# Every step states its own resources. sbatch exports the job's options (per het group: SLURM_GPUS_PER_NODE_HET_GROUP_1,
# SLURM_MEM_PER_NODE_HET_GROUP_1, ...) and srun reads them as the step's defaults: a replica step with only
# `--gpus=tp` still held all of its node's GPUs (TresPerNode=gres:gpu:8), and a step without --mem all of the job's
# memory on the node, so the node's next replica step waited forever ("Requested nodes are busy"). The shares are
# computed in the batch script from what SLURM allocated (the nodes' CPUs and memory are known only there).
RESOURCE_FUNCTIONS = r"""node_mem_mb() {  # node_mem_mb GROUP: the job's memory (MB) on each node of het group GROUP
    scontrol show job --details "$SLURM_JOB_ID" | awk -v group="$1" '
        $1 ~ /^JobId=/ { offset = ""; for (i = 2; i <= NF; i++) if ($i ~ /^HetJobOffset=/) offset = substr($i, 14) }
        offset == group && $1 ~ /^Nodes=/ { for (i = 2; i <= NF; i++) if ($i ~ /^Mem=/) {
            mem = substr($i, 5) + 0; if (least == "" || mem < least) least = mem } }
        END { print least + 0 }'
}
node_cpus() {  # node_cpus GROUP: the job's CPUs on each node of het group GROUP, the least ("32(x4),16" -> 16)
    local cpus="SLURM_JOB_CPUS_PER_NODE_HET_GROUP_$1"
    tr ',' '\n' <<< "${!cpus:-1}" | sed 's/(.*//' | sort -n | head -n 1
}
share() {  # share TOTAL PARTS: TOTAL / PARTS, at least 1
    local part=$(( $1 / $2 ))
    echo $(( part > 0 ? part : 1 ))
}"""


def resource_lines(topo: Topology) -> list[str]:
    """Bash lines that set the steps' CPU and memory shares from the job's allocation: the trainer's ranks share
    each trainer node's CPUs, its step takes the node's memory; each rollout node's CPUs and memory are split
    between its replicas. A memory of 0 (memory is not a scheduled resource) becomes `--mem=0M`: no limit."""
    return [
        "# megarl: every step states its own resources (nodes, tasks, CPUs, GPUs, memory); a step that names none",
        "# takes all of its node's GPUs and memory and the next step on that node waits forever",
        RESOURCE_FUNCTIONS,
        "trainer_mem_mb=$(node_mem_mb 0)",
        f"cpus_per_rank=$(share \"$(node_cpus 0)\" {topo.trainer_tasks_per_node})",
        f"mem_per_replica_mb=$(( $(node_mem_mb 1) / {topo.replicas_per_node} ))",
        f"cpus_per_replica=$(share \"$(node_cpus 1)\" {topo.replicas_per_node})",
    ]


def gpu_option(topo: Topology, gpus: int) -> str:
    """Exactly `gpus` GPUs (maybe 0) on each of the step's nodes; `--gres=none` on CPU nodes. A step that names
    no GPU option gets all of the job's GPUs on its nodes. (In a GPU job `--gres=none` is refused: srun 22.05
    adds the job's SLURM_GPUS_PER_NODE_HET_GROUP_<n> to it, "Invalid Trackable RESource (TRES) specification".)"""
    return f"--gpus-per-node={gpus}" if topo.gpus_per_node else "--gres=none"


def step_options(nodes: int, tasks: int, tasks_per_node: int, cpus: str, gpus: str, mem_mb: str) -> list[str]:
    """srun's resource options for one step, all stated (none inherited from the job's); `cpus` and `mem_mb` may be
    shell expansions of resource_lines' shares."""
    return [f"--nodes={nodes}", f"--ntasks={tasks}", f"--ntasks-per-node={tasks_per_node}", f"--cpus-per-task={cpus}",
            gpus, f"--mem={mem_mb}M", "--exact"]


def trainer_step_options(topo: Topology) -> list[str]:
    """The rank step: all ranks, each trainer node's ranks with exactly their GPUs (one each), CPUs and memory."""
    per_node = topo.trainer_tasks_per_node
    return step_options(topo.trainer_nodes, topo.world_size, per_node, "${cpus_per_rank}",
                        gpu_option(topo, per_node), "${trainer_mem_mb}")


def replica_step_options(job: Job, topo: Topology, replica: int) -> list[str]:
    """Replica `replica`'s step: rollout.tp GPUs of its node (disjoint from the node's other replicas', as SLURM
    gives each step its own), the replica's share of the node's CPUs and memory; how many replicas share its node
    (MEGARL_NODE_REPLICAS, as slurm/megarl_job.sh exports it: on CPU nodes, unless SLURM confined the step to cores of
    its own, each replica's TP workers take their own block of the cores, `megarl.rollout.cpu_binding`); its output
    in RUN_DIR/logs (this later --output overrides nemo-run's own)."""
    node, sharing = replica // topo.replicas_per_node, topo.replicas_on_node(replica)
    return [*step_options(1, 1, 1, "${cpus_per_replica}", gpu_option(topo, topo.rollout_tp), "${mem_per_replica_mb}"),
            f"--nodelist=${{rollout_nodes[{node}]}}", f"--export=ALL,{NODE_REPLICAS_ENV}={sharing}",
            shlex.quote(f"--output={job.serve_log(replica)}")]


def prepare_step_options(topo: Topology) -> list[str]:
    """`megarl prepare`: one task, no GPU; the first trainer node's memory (nothing else runs there yet)."""
    return step_options(1, 1, 1, "1", gpu_option(topo, 0), "${trainer_mem_mb}")


def add_slurm_job(exp: run.Experiment, job: Job, topo: Topology, args: argparse.Namespace) -> None:
    """One heterogeneous Slurm job: group 0 the trainer nodes, group 1 the rollout nodes."""
    import nemo_run as run

    gpus = topo.gpus_per_node or None
    user, _, host = args.ssh.rpartition("@")

    def tunnel() -> run.SSHTunnel | run.LocalTunnel:  # one each: nemo-run's executors change their tunnel
        if host:
            return run.SSHTunnel(host=host, user=user or os.environ.get("USER", ""), job_dir=args.job_dir)
        return run.LocalTunnel(job_dir="")  # nemo-run's own experiment directory, $NEMORUN_HOME/experiments

    mounts = [m for m in args.container_mounts.split(",") if m]
    trainer_image = args.trainer_container_image or args.container_image
    fleet_image = args.fleet_container_image or args.container_image

    def executor(nodes: int, tasks_per_node: int, srun_args: list[str], image: str) -> run.SlurmExecutor:
        # nemo-run writes srun_args unquoted after its own `--wait=60 --kill-on-bad-exit=1`: the shares expand there
        return run.SlurmExecutor(
            account=args.account or None, partition=args.partition or None, time=args.time,
            job_name_prefix="megarl-", nodes=nodes, ntasks_per_node=tasks_per_node, gpus_per_node=gpus,
            exclusive=True, container_image=image or None, container_mounts=mounts,
            heterogeneous=True, srun_args=srun_args, tunnel=tunnel(), packager=run.Packager(),
            wait_time_for_group_job=0, monitor_group_job_wait_time=args.poll_s)

    trainer = executor(topo.trainer_nodes, topo.trainer_tasks_per_node, trainer_step_options(topo), trainer_image)
    replicas = [executor(topo.rollout_nodes, topo.replicas_per_node, replica_step_options(job, topo, i), fleet_image)
                for i in range(topo.replicas)]
    trainer.het_group_indices = [0] + [1] * topo.replicas
    container = []  # prepare's: the trainer's image (it runs on the first trainer node)
    if trainer_image:
        container = [f"--container-image={trainer_image}"]
        container += [f"--container-mounts={','.join(mounts)}"] if mounts else []
    prepare = " ".join(["srun", "--het-group=0", *prepare_step_options(topo), "--job-name=megarl-prepare"])
    prepare += " " + _sh([*container, "env", f"--chdir={job.workdir}", *job.prepare()])
    trainer.setup_lines = "\n".join([
        *resource_lines(topo),
        "# megarl: the rollout nodes (replica i runs on rollout_nodes[i / replicas_per_node]), then `megarl prepare`",
        "# once, before any other role",
        'mapfile -t rollout_nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_1")',
        f'{prepare} || {{ echo "megarl prepare failed: nothing was started" >&2; exit 2; }}',
    ])
    tasks = [_role(job, job.rank())] + [_role(job, job.serve(i)) for i in range(topo.replicas)]
    exp.add(tasks, executor=[trainer, *replicas], name=job.name)


def local_script(job: Job, topo: Topology, torchrun: list[str]) -> str:
    """The whole job on this machine, as one bash script."""
    run_dir = shlex.quote(str(job.cfg.run.dir))
    gpu = 0

    def devices(n: int) -> str:
        nonlocal gpu
        if not topo.gpus_per_node:
            return ""
        gpu += n
        return "CUDA_VISIBLE_DEVICES=" + ",".join(str(d) for d in range(gpu - n, gpu)) + " "

    trainer_env = devices(topo.world_size)
    lines = [
        "set -uo pipefail",
        f"cd {shlex.quote(str(job.workdir))} || exit 2",
        f'{_sh(job.prepare())} || {{ echo "megarl prepare failed: nothing was started" >&2; exit 2; }}',
        "export MEGARL_BIND_ADDR=127.0.0.1",
        f"export {NODE_REPLICAS_ENV}={topo.replicas}  # the replicas share this machine's cores, a block each (CPU)",
        "serve_pids=()",
        "trap 'kill -TERM \"${serve_pids[@]}\" 2>/dev/null' EXIT",
    ]
    for i in range(topo.replicas):
        lines += [f"{devices(topo.rollout_tp)}{_sh(job.serve(i))} > {run_dir}/logs/serve_replica{i}.log 2>&1 &",
                  'serve_pids+=("$!")']
    ranks = [*torchrun, "--standalone", f"--nproc-per-node={topo.world_size}", "--no-python", *job.rank()]
    lines += [
        trainer_env + _sh(ranks),
        "status=$?",
        'kill -TERM "${serve_pids[@]}" 2>/dev/null',
        "wait",
        'echo "megarl: trainer ranks exited with code $status; outputs in "' + run_dir,
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def check_local_fits(topo: Topology) -> None:
    """The local job runs every role on one machine: the ranks' and the replicas' GPUs must fit its GPUs."""
    if topo.gpus_per_node and topo.world_size + topo.replicas * topo.rollout_tp > topo.gpus_per_node:
        raise ConfigError(f"trainer.world_size={topo.world_size} + rollout.replicas={topo.replicas} x rollout.tp="
                          f"{topo.rollout_tp} GPUs exceed --gpus-per-node={topo.gpus_per_node}")


def add_local_job(exp: run.Experiment, job: Job, topo: Topology, torchrun: list[str]) -> None:
    """The whole job as one script on this machine (LocalExecutor)."""
    import nemo_run as run

    check_local_fits(topo)
    exp.add(run.Script(inline=local_script(job, topo, torchrun)), executor=run.LocalExecutor(), name=job.name)


def dryrun_text(exp: run.Experiment) -> str:
    """What the experiment would submit: the sbatch script (slurm) or the job's script (local)."""
    from nemo_run.core.execution.slurm import SlurmBatchRequest

    exp.dryrun(log=False, delete_exp_dir=False)
    texts = [info.request.materialize() for job in exp.jobs for info in getattr(job, "_dryrun_infos", [])
             if isinstance(info.request, SlurmBatchRequest)]  # a task group's dry run, as nemo-run keeps it
    texts += [p.read_text() for p in sorted(Path(exp._exp_dir).rglob("scripts/*.sh"))]  # LocalExecutor's script
    shutil.rmtree(exp._exp_dir, ignore_errors=True)
    return "\n".join(texts)


def _parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, type=Path, help="the recipe, e.g. configs/qwen3_30b_a3b_guru.yaml")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides, as for `megarl train`")
    p.add_argument("--executor", choices=("slurm", "local"), default="slurm")
    p.add_argument("--dryrun", action="store_true", help="print what would be submitted; submit nothing")
    p.add_argument("--workdir", type=Path, default=Path(env("MEGARL_HOME", REPO)),
                   help="the megarl checkout on the nodes, where every role runs ($MEGARL_HOME; default: this one)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node ($GPUS_PER_NODE; default 8 for slurm, 0 = CPU for local)")
    p.add_argument("--trainer-tasks-per-node", type=int, default=int(env("TRAINER_TASKS_PER_NODE", 0)) or None,
                   help="trainer ranks per node ($TRAINER_TASKS_PER_NODE; default: one per GPU)")
    p.add_argument("--replicas-per-node", type=int, default=int(env("ROLLOUT_REPLICAS_PER_NODE", 0)) or None,
                   help="rollout replicas per node ($ROLLOUT_REPLICAS_PER_NODE; default: GPUs / rollout.tp)")
    p.add_argument("--venv", type=Path, default=None,
                   help="environment with megarl's training stack (its bin/megarl, bin/torchrun); default: "
                   "$MEGARL (else `megarl`) on the nodes for slurm, WORKDIR/.venv for local")
    p.add_argument("--trainer-venv", type=Path, default=env("MEGARL_TRAINER_ENV") or None,
                   help="the trainer's own environment (a venv: prepare and the ranks run its bin/megarl, local its "
                   "bin/torchrun; $MEGARL_TRAINER_ENV; default: --venv)")
    p.add_argument("--fleet-venv", type=Path, default=env("MEGARL_FLEET_ENV") or None,
                   help="the fleet's own environment (a venv: the replicas run its bin/megarl; $MEGARL_FLEET_ENV; "
                   "default: --venv)")
    s = p.add_argument_group("slurm")
    s.add_argument("--account", default=env("SBATCH_ACCOUNT", ""), help="($SBATCH_ACCOUNT)")
    s.add_argument("--partition", default=env("SBATCH_PARTITION", ""), help="($SBATCH_PARTITION)")
    s.add_argument("--time", default=env("SBATCH_TIMELIMIT", "48:00:00"), help="($SBATCH_TIMELIMIT; 48:00:00)")
    s.add_argument("--container-image", default=env("CONTAINER_IMAGE", ""),
                   help="pyxis/enroot image for every step ($CONTAINER_IMAGE; default: run on the host)")
    s.add_argument("--trainer-container-image", default=env("TRAINER_CONTAINER_IMAGE", ""),
                   help="the trainer's steps' image, prepare's included ($TRAINER_CONTAINER_IMAGE; default: "
                   "--container-image)")
    s.add_argument("--fleet-container-image", default=env("FLEET_CONTAINER_IMAGE", ""),
                   help="the replicas' image ($FLEET_CONTAINER_IMAGE; default: --container-image)")
    s.add_argument("--container-mounts", default=env("CONTAINER_MOUNTS", ""),
                   help="comma-separated pyxis mounts; workdir and run.dir must be visible ($CONTAINER_MOUNTS)")
    s.add_argument("--ssh", default="", help="USER@HOST of a login node to submit through (default: sbatch here, "
                   "with nemo-run's job files in $NEMORUN_HOME, ~/.nemo_run, which the nodes must see)")
    s.add_argument("--job-dir", default=None,
                   help="with --ssh: nemo-run's job directory on the cluster (default: WORKDIR/runs/nemo-experiments)"
                   "; no path may contain /nemo_run, which nemo-run rewrites")
    s.add_argument("--poll-s", type=int, default=60,
                   help="how often the job checks its steps; when one ends the others get this long, then are killed")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    workdir = args.workdir if args.ssh else args.workdir.resolve()  # with --ssh: a path on the cluster
    recipe = args.config.resolve()
    if args.ssh:  # the recipe as given, relative to the remote workdir
        recipe_arg = str(args.config)
    else:
        recipe_arg = str(recipe.relative_to(workdir)) if recipe.is_relative_to(workdir) else str(recipe)
    local = args.executor == "local"
    gpus = args.gpus_per_node
    if gpus is None:
        gpus = int(os.environ.get("GPUS_PER_NODE", 0 if local else 8))
    try:
        cfg = load_recipe(recipe, args.overrides)
        topo = Topology.of(cfg, gpus, args.trainer_tasks_per_node, args.replicas_per_node)
        if local:  # before nemo-run is imported (seconds): a refused job builds nothing
            check_local_fits(topo)
    except ConfigError as err:
        print(f"megarl_nemo: {err}", file=sys.stderr)
        return 2
    venv = args.venv or (workdir / ".venv" if local else None)
    trainer_venv, fleet_venv = args.trainer_venv or venv, args.fleet_venv or venv

    def megarl(role_venv: Path | None) -> list[str]:
        return [str(role_venv / "bin" / "megarl")] if role_venv else shlex.split(os.environ.get("MEGARL", "megarl"))

    job = Job(cfg, recipe_arg, args.overrides, workdir, megarl(trainer_venv), megarl(fleet_venv))
    print(f"megarl_nemo: trainer {topo.world_size} rank(s) on {topo.trainer_nodes} node(s); fleet {topo.replicas} "
          f"replica(s) x tp {topo.rollout_tp} on {topo.rollout_nodes} node(s) ({args.executor})", file=sys.stderr)
    if not local and cfg.rollout.restarts:
        print(f"megarl_nemo: rollout.restarts={cfg.rollout.restarts} does not apply here: nemo-run cannot restart one "
              f"step of a het job, and when a replica's step ends it kills the others {args.poll_s}s later (--poll-s),"
              " the trainer included; use slurm/megarl_job.sh for restarts (launchers/README.md)", file=sys.stderr)
    # nemo-run's console writes to stdout: there it goes to stderr, so that stdout is the dry run's script
    import nemo_run as run

    stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr), run.Experiment(f"megarl-{job.name}") as exp:
        try:
            if local:
                torchrun = [str(trainer_venv / "bin" / "torchrun")] if trainer_venv else ["torchrun"]
                add_local_job(exp, job, topo, torchrun)
            else:
                args.job_dir = args.job_dir or str(workdir / "runs" / "nemo-experiments")
                add_slurm_job(exp, job, topo, args)
        except ConfigError as err:
            print(f"megarl_nemo: {err}", file=sys.stderr)
            return 2
        if args.dryrun:
            print(dryrun_text(exp), file=stdout)
        else:
            exp.run(detach=not local, tail_logs=local)
    return 0


if __name__ == "__main__":
    sys.exit(main())
