"""`megarl.parallel.device.cuda_present`: the CPU-or-GPU question asked without importing torch where no NVIDIA device
node exists (each `megarl prepare` / `check` / `plan` / `serve` paid 2.7 s of CPU for that import on the 2-core
machines), and torch's own answer where one does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_no_device_node_means_no_cuda_and_no_torch_import(tmp_path: Path) -> None:
    empty, with_node = tmp_path / "empty", tmp_path / "gpu"
    empty.mkdir()
    with_node.mkdir()
    (with_node / "nvidiactl").touch()  # a control node alone is not a device
    code = ("import sys; from pathlib import Path; from megarl.parallel.device import cuda_present; "
            f"print(cuda_present(Path({str(empty)!r})), cuda_present(Path({str(with_node)!r})), "
            "'torch' in sys.modules)")
    assert _python(code) == "False False False"
    (with_node / "nvidia0").touch()  # a device node: torch decides, as it would alone
    code = ("import torch; from pathlib import Path; from megarl.parallel.device import cuda_present; "
            f"print(cuda_present(Path({str(with_node)!r})) == torch.cuda.is_available())")
    assert _python(code) == "True"


def test_prepare_imports_torch_only_on_a_machine_with_a_device_node(tmp_path: Path, tiny_moe_dir: Path) -> None:
    """`megarl prepare` on the demo config with the session's tiny MoE (its checkpoint is there: nothing to make)."""
    overrides = [f"run.dir={tmp_path / 'run'}", f"model.hf_dir={tiny_moe_dir}"]
    code = ("import sys; from pathlib import Path; from megarl.launch import prepare; "
            f"prepare('configs/demo_moe.yaml', {overrides!r}); "
            "print('torch' in sys.modules, any(Path('/dev').glob('nvidia[0-9]*')))")
    imported, node = _python(code).split()
    assert imported == node, f"torch imported: {imported}, NVIDIA device node present: {node}"
