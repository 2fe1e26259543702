"""vLLM general-plugin entry point (`vllm.general_plugins` in pyproject.toml).

vLLM imports this module in every process it starts and calls `register()`, which makes megarl's
partitioned weight-transfer backend (`megarl.sync.vllm_receiver`) known to vLLM's engine factory
under the name `megarl_partitioned`. Importing this module imports nothing heavy.
"""

from __future__ import annotations

BACKEND_NAME = "megarl_partitioned"


def register() -> None:
    """Register the backend with vLLM's weight-transfer engine factory (idempotent)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without the weight-transfer API: nothing to register
        return
    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND_NAME, "megarl.sync.vllm_receiver", "PartitionedWeightTransferEngine"
        )
