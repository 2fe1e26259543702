"""Can this step use the GPUs SLURM gave it? Without an NVIDIA driver the answer is "unknown" (`usable` None):
nothing is imported. With one, torch counts the visible devices, names them, and a small tensor is made on each
device the step will compute on, so a broken device or a count that differs from the visible list shows here
rather than an hour into the job."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

DRIVER_FILE = Path("/proc/driver/nvidia/version")


def check_gpus(node: str, visible: int | None, use: list[int] | None = None) -> dict[str, Any]:
    """`visible`: how many devices the step's CUDA_VISIBLE_DEVICES lists (None: unset, all); `use`: the device
    indices (0-based, among the visible ones, modulo their count: a rank's local rank) to allocate on, None for
    all. A trainer rank passes only its own:
    eight ranks each making a context on all eight GPUs of a node would cost memory and time for nothing."""
    if not DRIVER_FILE.exists():
        return {"driver": False, "usable": None, "reason": f"no NVIDIA driver on {node}", "devices": [],
                "problems": []}
    if visible == 0:
        return {"driver": True, "usable": None, "reason": "this step holds no GPU", "devices": [], "problems": []}
    import torch  # only here: a driver is present, so this is a GPU node and the import is worth it

    result: dict[str, Any] = {"driver": True, "usable": True, "reason": None, "devices": [], "problems": []}
    try:
        count = torch.cuda.device_count()
    except Exception as err:  # a driver/runtime mismatch surfaces as a RuntimeError here
        result |= {"usable": False, "problems": [f"torch cannot count the GPUs: {err}"]}
        return result
    if visible is not None and count != visible:
        result["problems"].append(f"torch sees {count} GPU(s) but CUDA_VISIBLE_DEVICES="
                                  f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r} lists {visible}")
    for index in range(count):
        device: dict[str, Any] = {"index": index, "name": None, "memory_bytes": None, "allocated": None}
        try:
            props = torch.cuda.get_device_properties(index)
            device |= {"name": props.name, "memory_bytes": props.total_memory}
            if use is None or index in {u % count for u in use}:
                torch.ones(1024, device=f"cuda:{index}").sum().item()
                device["allocated"] = True
        except Exception as err:
            device["allocated"] = False
            result["usable"] = False
            result["problems"].append(f"GPU {index} (of the visible ones) is not usable: "
                                      f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}")
        result["devices"].append(device)
    if count == 0:
        result["usable"] = False
        if visible is None:
            result["problems"].append("torch sees no GPU although the driver is loaded (CUDA_VISIBLE_DEVICES unset)")
    return result
