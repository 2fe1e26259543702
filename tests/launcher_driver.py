"""Runs launchers/megarl_nemo.py many times from ONE interpreter of the launch environment (tests/test_launchers.py).

    .venv-launch/bin/python tests/launcher_driver.py LAUNCHER

imports nemo-run and megarl's config modules once (nemo-run alone takes 5-10 s of CPU to import), then reads one
request per line on stdin, `{"argv": [...], "env": {...}, "cwd": "..."}`, and for each forks a child that runs
LAUNCHER as `python LAUNCHER ARGV...` would (`runpy.run_path` as `__main__`, `sys.argv`, `sys.path[0]` the script's
directory) in exactly that environment and working directory, with file descriptors 1 and 2 sent to files (so the
programs it starts, sbatch among them, write where a subprocess's would); nemo-run's home is set from the request's
`NEMORUN_HOME` (`nemo_run.config.set_nemorun_home`: nemo-run reads the variable once, at import). Each answer is
one line on stdout: `{"returncode": ..., "stdout": ..., "stderr": ...}`. A child still running after `TIMEOUT_S` is
killed (returncode -9). Ends at the end of stdin.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import tempfile
import time
from pathlib import Path

TIMEOUT_S = 600.0


def _child(launcher: Path, request: dict, out: int, err: int) -> None:
    """In the forked child: become `python LAUNCHER ARGV...` in the request's environment, then exit with its code."""
    code = 1
    try:
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        import nemo_run.config

        nemo_run.config.set_nemorun_home(os.environ.get("NEMORUN_HOME", os.path.expanduser("~/.nemo_run")))
        sys.argv = [str(launcher), *request["argv"]]
        sys.path[0] = str(launcher.parent)
        try:
            runpy.run_path(str(launcher), run_name="__main__")
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then exit 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run(launcher: Path, request: dict) -> dict:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(launcher, request, out.fileno(), err.fileno())
        deadline = time.monotonic() + TIMEOUT_S
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                done = os.waitpid(pid, 0)
                break
            time.sleep(0.05)
        status = done[1]
        code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return {"returncode": code, "stdout": out.read().decode(errors="replace"),
                "stderr": err.read().decode(errors="replace")}


def main() -> None:
    launcher = Path(sys.argv[1]).resolve()
    import nemo_run  # noqa: F401 - the slow one

    import megarl.config.load  # noqa: F401 - what the launcher imports first, once for every child
    import megarl.config.schema  # noqa: F401

    for line in sys.stdin:
        if line.strip():
            print(json.dumps(_run(launcher, json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
