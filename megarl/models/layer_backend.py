"""Which megatron-core layer spec a trainer rank builds: Transformer Engine's on GPUs, megatron's local spec on CPUs.

`trainer.layer_spec` (megarl/config/schema.py) is `auto`, `te` or `local`; `resolve_layer_spec` turns it into the
spec to build from what the rank has: a CUDA device and an installed `transformer_engine`. The rule:

| setting | CUDA, TE installed | CUDA, no TE | no CUDA |
|---|---|---|---|
| `auto` (default) | `te` | refused: run in the trainer container | `local` |
| `te` | `te` | refused | refused |
| `local` | `local` (debugging: unfused attention, one GEMM per expert) | `local` | `local` |

Refusing instead of falling back matters on a GPU: megatron's local spec runs unfused attention that keeps every
`[b, heads, s, s]` score matrix, one GEMM per expert and torch's AdamW, so at the recipes' 16k-token microbatches a
step runs out of memory or runs several times slower, and `megarl plan` (which plans for flash attention under TE)
would be wrong. `trainer.layer_spec=local` says so explicitly, and the memory plan then counts the scores.

Nothing here imports torch or Transformer Engine: `megarl check --gpu` and the preflight judge a GPU layout from a
login node, and the test of the refusal runs on a CPU machine with the inputs a TE-less GPU rank would see.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

LayerSpecSetting = Literal["auto", "te", "local"]
LayerSpec = Literal["te", "local"]

TRAINER_CONTAINER = "containers/trainer.Dockerfile"


class TransformerEngineMissing(RuntimeError):
    """A trainer rank on a GPU without Transformer Engine (and without an explicit `trainer.layer_spec=local`)."""


def te_installed() -> bool:
    """Whether `transformer_engine` can be imported here (found on the path; not imported)."""
    return importlib.util.find_spec("transformer_engine") is not None


def missing_te_message(setting: LayerSpecSetting) -> str:
    """The one line a TE-less GPU rank is refused with: what is wrong and both fixes."""
    return (f"trainer.layer_spec={setting}: this trainer rank has a GPU but Transformer Engine is not installed: run "
            f"the trainer in its container ({TRAINER_CONTAINER}, docs/gpu.md), or set trainer.layer_spec=local to "
            "debug on megatron's local spec (unfused attention, one GEMM per expert: slower, and more memory, which "
            "`megarl plan` then counts)")


def resolve_layer_spec(setting: LayerSpecSetting, cuda: bool, te: bool) -> LayerSpec:
    """The spec a rank with (`cuda`, `te`) builds for `setting` (module table); raises `TransformerEngineMissing`
    (one line) where the table says refused."""
    if setting == "local":
        return "local"
    if setting not in ("auto", "te"):
        raise ValueError(f"trainer.layer_spec={setting!r}: use 'auto', 'te' or 'local'")
    if not cuda:
        if setting == "te":
            raise TransformerEngineMissing("trainer.layer_spec=te needs a GPU (Transformer Engine runs on CUDA): "
                                           "use trainer.layer_spec=auto on CPU machines")
        return "local"
    if not te:
        raise TransformerEngineMissing(missing_te_message(setting))
    return "te"


def precision_problem(spec: LayerSpec, precision: str) -> str | None:
    """The one line a job with Transformer Engine's layer spec (`spec`, as resolved or planned) in
    `trainer.precision=fp32` is refused with; None where the pair runs. TE 2.9 attends in fp32 only with its unfused
    kernel (FlashAttention and cuDNN's fused attention take fp16/bf16/fp8:
    transformer_engine/pytorch/attention/dot_product_attention/utils.py:428-461 at v2.9), which takes no packed
    THD sequences (utils.py:659-662: then no backend is left and the first forward raises) and keeps every
    `[b, heads, s, s]` score matrix otherwise, which `megarl plan` does not count under TE."""
    if spec != "te" or precision != "fp32":
        return None
    return ("trainer.precision=fp32 with Transformer Engine's layer spec: TE attends in fp32 only with its unfused "
            "kernel, which refuses packed sequences and keeps every attention score matrix: set "
            "trainer.precision=bf16 (and rollout.dtype=bfloat16), or trainer.layer_spec=local to debug in fp32")


def planned_layer_spec(setting: LayerSpecSetting) -> LayerSpec:
    """The spec a GPU job with `setting` runs (what `megarl plan` and `megarl check --gpu` plan for, from any
    machine): TE unless `local` is asked for."""
    return "local" if setting == "local" else "te"


def gpu_layer_spec_note(setting: LayerSpecSetting) -> str:
    """What `megarl check --gpu` says of the layer spec (from any machine: a login node has no TE)."""
    if planned_layer_spec(setting) == "te":
        return (f"trainer.layer_spec={setting}: the trainer ranks build Transformer Engine's layer spec and need "
                f"transformer_engine ({TRAINER_CONTAINER}); a GPU rank without it refuses to start")
    return ("trainer.layer_spec=local: megatron's local layer spec on GPUs (debugging: unfused attention, one GEMM "
            "per expert; the memory plan counts the attention scores)")


def bench_layer_spec(cuda: bool, precision: str = "fp32") -> LayerSpecSetting:
    """The setting benchmarks, GPU tests and `megarl smoke` build a `precision` policy with here: `auto`, except on a
    GPU without Transformer Engine, or in fp32 (which TE's spec refuses: `precision_problem`), where they ask for
    `local` explicitly (and say so) instead of being refused."""
    return "local" if cuda and (not te_installed() or precision == "fp32") else "auto"
