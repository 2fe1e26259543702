"""Is the checkpoint in `model.hf_dir` whole, as seen from this node? config.json parses, and every safetensors file
(`model.safetensors`, or those `model.safetensors.index.json` names) exists, its header parses, and its size is
exactly 8 + header length + the end of its last tensor's data: a truncated download or copy is caught without
reading a byte of the weights."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on a header


def safetensors_data_bytes(path: Path) -> int:
    """The bytes of tensor data `path`'s header describes; raises ValueError naming what is wrong with the file
    (unreadable header, or a size that does not match it)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path.name} is {size} bytes, too short for a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise ValueError(f"{path.name}: its header length ({length} bytes) does not fit the file's {size} bytes "
                             "(truncated or not a safetensors file)")
        try:
            header = json.loads(f.read(length))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, KeyError, TypeError, IndexError) as err:
            raise ValueError(f"{path.name}: its header does not parse ({err})") from None
    data = max(ends, default=0)
    if size != 8 + length + data:
        raise ValueError(f"{path.name} is {size} bytes but its header describes {8 + length + data} "
                         f"({'truncated' if size < 8 + length + data else 'trailing bytes'})")
    return data


def weight_files(hf_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, else model.safetensors, else every
    *.safetensors file there. Raises ValueError if the index does not parse."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{index.name} does not parse ({err})") from None
        return [hf_dir / name for name in names]
    if (hf_dir / "model.safetensors").exists():
        return [hf_dir / "model.safetensors"]
    return sorted(hf_dir.glob("*.safetensors"))


def check_model(hf_dir: Path | str) -> dict[str, Any]:
    """{"dir", "files", "weight_bytes", "problems"}: each problem one line that says what to fix."""
    hf_dir = Path(hf_dir)
    result: dict[str, Any] = {"dir": str(hf_dir), "files": 0, "weight_bytes": 0, "problems": []}
    problems: list[str] = result["problems"]
    try:
        json.loads((hf_dir / "config.json").read_text())
    except OSError as err:
        problems.append(f"model.hf_dir={hf_dir}: cannot read config.json ({err.strerror or err}): point model.hf_dir "
                        "at the checkpoint, on a filesystem this node mounts")
        return result
    except ValueError as err:
        problems.append(f"model.hf_dir={hf_dir}: config.json does not parse ({err}): download it again")
    try:
        files = weight_files(hf_dir)
    except ValueError as err:
        problems.append(f"model.hf_dir={hf_dir}: {err}: download it again")
        return result
    if not files:
        problems.append(f"model.hf_dir={hf_dir} holds no weights: point model.hf_dir at the checkpoint")
    for path in files:
        try:
            result["weight_bytes"] += safetensors_data_bytes(path)
            result["files"] += 1
        except FileNotFoundError:
            problems.append(f"model.hf_dir={hf_dir}: {path.name} is missing: download it again")
        except OSError as err:
            problems.append(f"model.hf_dir={hf_dir}: cannot read {path.name} ({err.strerror or err})")
        except ValueError as err:
            problems.append(f"model.hf_dir={hf_dir}: {err}: download it again")
    return result
