"""The `megarl preflight rank|serve|report` sub-commands (registered by `megarl.cli`, imported only when run)."""

from __future__ import annotations

import argparse
import sys

from megarl.config.load import ConfigError, load_config
from megarl.stacks import STACKS

WAIT_S = 60.0


def register(subparsers: argparse._SubParsersAction) -> None:
    helps = {"rank": "one trainer rank's check (under srun or torchrun, placed as the real ranks)",
             "serve": "one rollout replica's check (in the replica's step)",
             "report": "after the checks: one table of the placement, every problem; exit 1 if any"}
    for name, help_text in helps.items():
        c = subparsers.add_parser(name, help=help_text, description=help_text)
        c.add_argument("--config", required=True, help="<run.dir>/preflight/config.yaml, from megarl prepare "
                       "--preflight (its CONFIG= line)")
        c.add_argument("overrides", nargs="*", help="section.field=value overrides")
        if name == "serve":
            c.add_argument("--replica", type=int, required=True, help="which replica, 0..rollout.replicas-1")
            c.add_argument("--host", help="address to listen on (default: $MEGARL_BIND_ADDR, else this node's "
                           "address)")
        if name == "report":
            c.add_argument("--allocation", help="a file holding `scontrol show job -d $SLURM_JOB_ID` (the job script "
                           "writes it where scontrol may be missing, e.g. inside a container); default: ask "
                           "scontrol when SLURM_JOB_ID is set")
        if name != "report":
            c.add_argument("--wait-s", type=float, default=WAIT_S,
                           help=f"how long to wait for the other steps' hellos, then for their reports (default "
                           f"{WAIT_S:g})")
    v = subparsers.add_parser("versions", help="this environment's torch, megatron-core, vLLM and Transformer Engine "
                              "against a stack's lock (locks/; exit 1 on a mismatch)",
                              description="this environment's torch, megatron-core, vLLM and Transformer Engine "
                              "against a stack's lock (locks/<stack>.txt, docs/gpu.md); exit 1 on a mismatch")
    v.add_argument("--stack", choices=list(STACKS), required=True,
                   help="cpu (both roles on a CPU machine), gpu-trainer (inside its container), gpu-fleet, or "
                   "gpu-single (both roles in one venv on one GPU machine)")
    v.add_argument("--role", choices=("rank", "serve"), default=None,
                   help="the role this environment runs: rank (a trainer's own environment: its vLLM, the fleet's, is "
                   "not judged, e.g. `make trainer-env` against --stack cpu); default: every package the stack pins")


def run_versions(stack: str, role: str | None = None) -> int:
    """One line per checked package, then every problem; exit 0 or 1."""
    from megarl.preflight.versions import check_versions

    result = check_versions(stack, role=role)
    for name, found in result["packages"].items():
        pinned = f"{found['pinned']} ({found['source']})" if found["pinned"] else "not pinned"
        print(f"{name}: {found['installed'] or 'not installed'}, {stack} stack: {pinned}")
    for problem in result["problems"]:
        print(f"PROBLEM: {problem}")
    print(f"versions {'FAILED' if result['problems'] else 'OK'}: {stack} stack, {result['lock']}")
    return 1 if result["problems"] else 0


def run(args: argparse.Namespace) -> int:
    if args.command == "versions":
        return run_versions(args.stack, args.role)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "report":
            from megarl.preflight.report import run_report

            return run_report(cfg, allocation_file=args.allocation)
        from megarl.preflight.step import rank_step, serve_step

        if args.command == "rank":
            return rank_step(cfg, args.wait_s)
        return serve_step(cfg, args.replica, args.wait_s, args.host)
    except ConfigError as err:
        print(f"megarl preflight {args.command}: {err}", file=sys.stderr)
        return 2
