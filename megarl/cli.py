"""`megarl` command line.

    megarl train --config configs/demo_moe.yaml [section.field=value ...]   fleet + trainer on this machine
    megarl prepare --config FILE [overrides]  a cluster job's first step: run dir, config, secret (docs/cluster.md)
    megarl serve --config RUN_DIR/config.yaml --replica I   one rollout replica of a cluster job
    megarl rank --config RUN_DIR/config.yaml  one trainer rank of a cluster job, under srun or torchrun
    megarl prepare --preflight [--gpu] --config FILE  the same checks, touching no run: <run.dir>/preflight/
    megarl preflight rank|serve|report --config CFG   a job whose steps check their placement instead of working
    megarl check --config FILE [--gpu] [overrides]  validate a config against its model, start nothing
    megarl smoke --gpu [--only CHECK ...]     on one GPU node before a large job: one line per check (docs/gpu.md)
    megarl algorithms                         list registered algorithms
    megarl make-tiny DIR --kind moe|dense|qwen2|dense-tied  write a tiny random HF checkpoint with its tokenizer
    megarl plan --config FILE [--dtype bf16]  parameters and bytes per trainer / rollout rank and per sync
    megarl export CHECKPOINT_DIR --out DIR    write a run checkpoint as a Hugging Face checkpoint
    megarl bench logprob [--tp 1 2 4 ...]     peak memory and time of the vocab-parallel log-prob + entropy
    megarl bench logprob --hidden 2048 ...    the same from the hidden states: fused vs unfused output layer
    megarl bench padding [--budgets ...]      tokens computed vs real per step: count vs token-budget microbatches
    megarl bench pipeline [--offsets 0 1 2]   wall time per step and overlap with the pipeline off and on
    megarl bench inflight [--steps 64]        in-flight weight updates + partial rollouts, projected (simulation)
    megarl bench inflight-fleet [--rounds 2]  the same measured on the real fleet against today's queue
    megarl bench engine-step [--sizes 1 2 4]  a vLLM CPU replica's decode step against the sequences it runs
    megarl bench sync [--size-mb 400]         one weight sync's bytes, seconds, memory: partitioned vs baselines
    megarl bench savings [--intervals 1 2 4]  the same job per sync.interval: bytes, seconds in sync, fleet pause
    megarl bench delta [--fractions ...]      compute cost of delta pushes per GB on this device (CUDA or CPU)
    megarl bench longtail [--chunk 1]         long-tailed responses: static split vs the shared queue, projected
    megarl bench trainer [--variants ...]     one training step per variant (precision, a change on): time, memory
    megarl bench gpu-step [--out DIR]         on a GPU: bench trainer's variants, bench logprob at 32k, gpu tests
    megarl compare RUN_DIR ... [--out F.md]   sync pushes, bytes, time and rewards of finished runs side by side
    megarl repro rec-f1|rec-red|oapl-lag|offpolicy-grpo|inflight|list [--seeds 3] [--smoke]   a claim, re-run

`megarl COMMAND --help` describes each command's options.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from megarl.config.load import ConfigError
from megarl.rollout.fleet_auth import FleetSecretError

# Commands whose modules are heavy to import: loaded only when the command runs. Each module has
# `register(subparsers)` (adds its sub-command) and `run(args) -> int`.
_DELEGATED = {
    "plan": ("megarl.plan_report", "parameters and bytes per trainer / rollout rank and per weight sync"),
    "export": ("megarl.models.hf_export", "write a run checkpoint as a Hugging Face checkpoint"),
    "bench": ("megarl.bench",
              "benchmarks: `megarl bench logprob|padding|pipeline|inflight|inflight-fleet|engine-step|sync|longtail|"
              "savings|delta|trainer|gpu-step`"),
    "compare": ("megarl.metrics.compare", "compare finished runs' sync traffic, time and rewards"),
    "preflight": ("megarl.preflight.cli", "check a cluster job's placement, network, model files and GPUs: "
                                          "`megarl preflight rank|serve|report` (docs/cluster.md); an environment's "
                                          "versions against its stack's lock: `megarl preflight versions`"),
    "smoke": ("megarl.smoke.cli", "the checks to run on one GPU node before a large job: `megarl smoke --gpu`"),
    "repro": ("megarl.repro", "re-run a source paper's central claim: `megarl repro rec-f1|rec-red|oapl-lag|"
                              "offpolicy-grpo|list`; in-flight updates still learn: `megarl repro inflight`"),
}


def _run_delegated(argv: list[str]) -> int:
    command, rest = argv[0], argv[1:]
    module = importlib.import_module(_DELEGATED[command][0])
    if command == "repro":  # a study name, then overrides that may follow the options
        return module.run(module.parser().parse_intermixed_args(rest))
    if command in ("bench", "preflight"):  # `megarl bench logprob ...`: sub-commands of `bench` / `preflight`
        parser = argparse.ArgumentParser(prog=f"megarl {command}")
    else:
        parser, rest = argparse.ArgumentParser(prog="megarl"), argv
    module.register(parser.add_subparsers(dest="command", required=True))
    return module.run(_parse(parser, rest))


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`parser.parse_args`, except that `section.field=value` overrides may also come after options
    (`--config X a=1 --dtype fp32 b=2`): argparse alone takes only the first run of positionals."""
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megarl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_text in (("train", "run RL training (fleet + trainer)"),
                            ("check", "validate a config against its model without starting anything")):
        c = sub.add_parser(name, help=help_text)
        c.add_argument("--config", required=True, help="YAML recipe, e.g. configs/demo_moe.yaml")
        c.add_argument("overrides", nargs="*", help="section.field=value overrides, e.g. sync.interval=4")
        if name == "check":
            c.add_argument("--gpu", action="store_true",
                           help="check the layout for a GPU job (default: for this machine; on a CPU machine "
                           "MoE with trainer.tp>1 is refused, since it needs Transformer Engine)")
    for name, help_text in (
            ("prepare", "a cluster job's first step: validate, make the run directory, config and fleet secret; "
                        "prints the job's topology as KEY=VALUE lines"),
            ("serve", "run one rollout replica of a cluster job until SIGTERM"),
            ("rank", "run one trainer rank of a cluster job (started by srun or torchrun)")):
        c = sub.add_parser(name, help=help_text)
        c.add_argument("--config", required=True,
                       help="the recipe (prepare) or the run directory's resolved config.yaml (serve, rank)")
        c.add_argument("overrides", nargs="*", help="section.field=value overrides")
        if name == "prepare":
            c.add_argument("--preflight", action="store_true",
                           help="validate as prepare does but touch no run: a fresh <run.dir>/preflight/ with the "
                           "resolved config.yaml, for `megarl preflight` steps (CONFIG= names it)")
            c.add_argument("--gpu", action="store_true", help="check the layout for a GPU job (as `megarl check "
                           "--gpu`), whatever this machine has")
        if name == "serve":
            c.add_argument("--replica", type=int, required=True, help="which replica, 0..rollout.replicas-1")
            c.add_argument("--host", help="address to listen on (default: $MEGARL_BIND_ADDR, else this node's "
                           "address)")
            c.add_argument("--restart", action="store_true", help="the launcher starts this replica again in the same "
                           "job: append to its vLLM log (logs/vllm_replica<i>.log) instead of starting it afresh")
    sub.add_parser("algorithms", help="list registered algorithms")
    for name, (_, help_text) in _DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    t = sub.add_parser("make-tiny", help="write a tiny random Qwen3-MoE / Qwen3 / Qwen2 / tied Qwen3 checkpoint")
    t.add_argument("out_dir")
    t.add_argument("--kind", choices=("moe", "dense", "qwen2", "dense-tied"), default="moe")
    t.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM once a fleet is up (megarl.rollout.fleet): servers stopped
        print("megarl: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    if argv and argv[0] in _DELEGATED:
        return _run_delegated(argv)
    args = _parse(_parser(), argv)
    try:
        if args.command in ("train", "check"):
            from megarl.launch import prepare, train

            for_gpu = True if getattr(args, "gpu", False) else None
            cfg = prepare(args.config, args.overrides, create_run_dir=args.command == "train", for_gpu=for_gpu)
            if args.command == "check":
                from megarl.launch import check_data

                print("\n".join(check_data(cfg)))
                if for_gpu:
                    from megarl.models.layer_backend import gpu_layer_spec_note

                    print(gpu_layer_spec_note(cfg.trainer.layer_spec))
                print(f"config OK{' for a GPU job' if for_gpu else ''}: {args.config}")
                return 0
            from megarl.metrics.timeline import describe

            summary = train(cfg)
            print(f"done: reward {summary['reward/first_steps_mean']:.3f} -> {summary['reward/last_steps_mean']:.3f}; "
                  f"outputs in {cfg.run.dir}")
            print(f"pipeline: {describe(summary)} (timeline.png)")
        elif args.command == "prepare":
            from megarl.launch import prepare
            from megarl.roles import prepare_job, prepare_preflight

            cfg = prepare(args.config, args.overrides, create_run_dir=not args.preflight,
                          for_gpu=True if args.gpu else None)
            topology = prepare_preflight(cfg) if args.preflight else prepare_job(cfg)
            print("\n".join(f"{key}={value}" for key, value in topology.items()))
        elif args.command in ("serve", "rank"):
            from megarl import roles
            from megarl.config.load import load_config

            cfg = load_config(args.config, args.overrides)
            if args.command == "serve":
                return roles.serve(cfg, args.replica, args.host, args.restart)
            return roles.rank(cfg)
        elif args.command == "algorithms":
            from megarl.algorithms.registry import ALGORITHMS

            for name, algo in sorted(ALGORITHMS.items()):
                print(f"{name:16s} {algo.description}")
        elif args.command == "make-tiny":
            from megarl.models.tiny import make_tiny_checkpoint

            print(make_tiny_checkpoint(args.out_dir, kind=args.kind, seed=args.seed))
    except (ConfigError, FleetSecretError) as err:
        print(f"megarl: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a failed trainer rank: one line naming the rank, the cause and its traceback file
        from megarl.launch import TrainerError

        if not isinstance(err, TrainerError):
            raise
        print(f"megarl: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
