"""Prints this process's `process_place()` as one JSON line (run by tests/test_launcher_env.py under real launchers)."""

import dataclasses
import json

from megarl.parallel.launcher_env import process_place

if __name__ == "__main__":
    print(json.dumps(dataclasses.asdict(process_place())), flush=True)
