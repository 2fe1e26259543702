"""megarl: RL post-training for megatron-core policies with a lagged, partitioned vLLM weight sync."""

__version__ = "0.1.0"
