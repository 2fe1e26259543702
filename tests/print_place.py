"""Prints this process's `process_place()` as one JSON line (run by tests/test_launcher_env.py under real launchers).

The line goes out in one `os.write`: ranks share the launcher's stdout pipe, and a write of at most PIPE_BUF bytes
is atomic there, whereas `print` may hand the text and its newline to the pipe separately and let two ranks' lines
interleave (CI met `{rank 1}{rank 0}` on one line)."""

import dataclasses
import json
import os

from megarl.parallel.launcher_env import process_place

if __name__ == "__main__":
    line = (json.dumps(dataclasses.asdict(process_place())) + "\n").encode()
    assert len(line) <= 512, "keep the line within PIPE_BUF so the write stays atomic"
    os.write(1, line)
