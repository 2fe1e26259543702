"""`megarl bench gpu-step`: the GPU checks of the training step, in one command (one lent GPU's single call).

Runs, each in its own process with its own time limit, and writes every log and figure under `--out`:

1. `megarl bench trainer` on the GPU, one row per change of the training step on and off (`VARIANTS` of
   `megarl/bench/trainer.py`: bf16 as the base; the compiled log-prob kernel; gradient buffers and reduction in
   bf16; the unfused log-prob for comparison; Transformer Engine's layer spec and fusions, a row saying "not run"
   where TE is missing; fp32): step time, tokens per second, MFU, held and peak memory against the plan;
2. `megarl bench logprob --hidden` at 4k / 16k / 32k tokens, bf16, the tiled fused kernel (eager and compiled)
   against the unfused path: peak memory and time;
3. the `gpu`-marked tests (`pytest -m gpu tests/test_gpu.py tests/test_preflight.py`).

A summary (`gpu_step.json`: each part's command, exit code and seconds, and the device) says what ran. On a machine
without CUDA it refuses at once. Set `--quick` for a smaller model (a first look, or a short lease).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TRAINER_VARIANTS = ["bf16", "bf16+compiled-logprob", "bf16+bf16-grads", "bf16+unfused-logprob", "bf16+te", "fp32"]


def parts(out: Path, quick: bool) -> list[tuple[str, list[str], int]]:
    """(name, argv, time limit s) of each part, in order."""
    me = [sys.executable, "-m", "megarl.cli", "bench"]
    size = (["--hidden", "1024", "--layers", "4", "--vocab", "32000", "--seq", "1024", "--rows", "8", "--micro", "4"]
            if quick else
            ["--hidden", "2048", "--layers", "8", "--vocab", "32000", "--seq", "1024", "--rows", "16", "--micro", "4"])
    return [
        ("trainer", [*me, "trainer", "--world", "1", "--steps", "5", *size, "--variants", *TRAINER_VARIANTS,
                     "--out", str(out / "bench_trainer_gpu.json")], 200),
        ("logprob", [*me, "logprob", "--hidden", "2048", "--tp", "1", "--dtype", "bfloat16", "--token-counts", "4096",
                     "16384", "32768", "--methods", "unfused", "fused", "--chunk-tokens", "1024", "--vocab-block",
                     "16384", "--kernel", "compiled", "--repeats", "3", "--max-gb", "70",
                     "--out", str(out / "bench_logprob_gpu.json")], 150),
        ("gpu_tests", [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py",
                       "tests/test_preflight.py"], 180),
    ]


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("megarl bench gpu-step: no CUDA device here: run it on a GPU machine (docs/gpu.md)", file=sys.stderr)
        return 2
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cuda": torch.version.cuda, "python": sys.version.split()[0], "parts": []}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    worst = 0
    for name, argv, limit in parts(out, args.quick):
        if args.only and name not in args.only:
            continue
        print(f"== {name}: {' '.join(argv)}", flush=True)
        start = time.monotonic()
        with open(out / f"{name}.log", "w") as log:
            try:
                code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=limit).returncode
            except subprocess.TimeoutExpired:
                code = 124
        seconds = time.monotonic() - start
        tail = (out / f"{name}.log").read_text(errors="replace").splitlines()[-25:]
        print("\n".join(tail), flush=True)
        print(f"== {name}: exit {code} after {seconds:.0f} s (limit {limit} s)", flush=True)
        summary["parts"].append({"name": name, "argv": argv, "exit": code, "seconds": round(seconds, 1)})
        worst = worst or code
    (out / "gpu_step.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if worst else 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("gpu-step", help="the training step's GPU checks in one command: bench trainer with "
                              "each change on and off, bench logprob --hidden at 32k tokens, the gpu tests",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("gpu_out"), help="directory for the logs, figures and summary")
    p.add_argument("--quick", action="store_true", help="a smaller trainer model (hidden 1024 x 4 layers)")
    p.add_argument("--only", nargs="+", choices=["trainer", "logprob", "gpu_tests"], default=None,
                   help="run only these parts")
    return p
