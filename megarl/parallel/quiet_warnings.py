"""The warnings megatron-core and torch print on every machine without a GPU, silenced in one place.

megatron-core notes at import that Apex and Transformer Engine are absent (it falls back to torch's optimizers and
its own multi-tensor helpers: expected on CPU), and torch notes the deprecation of collectives megatron's MoE
dispatcher calls. Printed once per process they bury `megarl train`'s progress bar and say nothing a CPU user can
act on. On a GPU they are left on: there, a missing Transformer Engine is worth seeing.
"""

from __future__ import annotations

import warnings


def quiet_cpu_warnings() -> None:
    """Install the filters in this process; call it only where no GPU is present."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, message=r"`torch\.distributed\.")
