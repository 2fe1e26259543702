"""Whether this machine has a CUDA device, asked without importing torch where none can be there.

`megarl prepare`, `check`, `plan` and `serve` decide CPU or GPU before anything else runs; importing torch for that
costs seconds of CPU per command (2.7 s on the 2-core CPU machines). A machine without an NVIDIA device node
(`/dev/nvidia0`, ...) has no CUDA device, so there the answer is False at once; where a node exists, torch decides
(`torch.cuda.is_available()`: the driver, `CUDA_VISIBLE_DEVICES`).
"""

from __future__ import annotations

from pathlib import Path


def cuda_present(dev: Path = Path("/dev")) -> bool:
    """`torch.cuda.is_available()`, without importing torch on a machine with no NVIDIA device node under `dev`."""
    if not any(dev.glob("nvidia[0-9]*")):
        return False
    import torch

    return torch.cuda.is_available()
