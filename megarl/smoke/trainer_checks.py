"""The smoke checks that build a trainer: world 1 on this node's device, in the smoke process itself.

- `checkpoint_round_trip`: the tiny MoE in bf16 with megatron's distributed optimizer (TE's `FusedAdam` where
  Transformer Engine is installed: megatron builds it then), two steps, a `dist_checkpointing` save through
  `megarl.checkpoint`, a third step; a fresh policy loads the checkpoint, must hold the Adam moments read off the
  optimizer before the save, and its third step must give the first policy's parameters bit for bit.
- `te_packed_step` (a GPU with TE): TE's layer spec on packed (THD) sequences in bf16, one training step: the
  log-probs the loss sees against `transformers` in bf16 (the tolerance of `tests/test_trainer_bf16.py`: a few bf16
  roundings), a finite loss and gradient norm.
"""

from __future__ import annotations

import socket
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from megarl.config.schema import OptimizerConfig
from megarl.smoke.registry import CheckFailed

OPTIM = OptimizerConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0)
ROWS, WIDTH = 4, 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _world_of_one() -> Iterator[None]:
    from megarl.parallel.groups import TrainerLayout, destroy_trainer_groups, init_trainer_groups
    from megarl.parallel.quiet_warnings import quiet_cpu_warnings

    if not torch.cuda.is_available():
        quiet_cpu_warnings()
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.checkpoint")
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"megatron\.")

    init_trainer_groups(TrainerLayout(), 0, 1, "127.0.0.1", _free_port())
    try:
        yield
    finally:
        destroy_trainer_groups()


def _batch(vocab: int, step: int) -> dict[str, torch.Tensor]:
    """`ROWS` sequences of lengths WIDTH, WIDTH-1, ... with a loss on all but their first two tokens."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(3, vocab, (ROWS, WIDTH), generator=g)
    lengths = torch.tensor([WIDTH - i for i in range(ROWS)])
    mask = (torch.arange(WIDTH)[None] < lengths[:, None]).float()
    mask[:, :2] = 0
    return {"tokens": tokens, "targets": torch.roll(tokens, -1, dims=1), "mask": mask, "lengths": lengths,
            "weights": torch.randn(ROWS, WIDTH, generator=g)}


def _step(policy: Any, step: int, packed: bool = False, seen: list[torch.Tensor] | None = None) -> dict[str, float]:
    from megarl.trainer.batching import pack_microbatch

    batch = _batch(policy.hf["vocab_size"], step)
    mbs = [{k: v[i:i + 2] for k, v in batch.items()} for i in range(0, ROWS, 2)]
    if packed:
        length = max(int(mb["lengths"].sum()) for mb in mbs)
        mbs = [pack_microbatch(mb, length, pad_id=0) for mb in mbs]
    total = batch["mask"].sum()

    def loss_fn(lp: torch.Tensor, ent: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        if seen is not None:
            seen.append(lp.detach().float().cpu())
        return ((lp * mb["weights"].to(lp.device) + 0.1 * ent) * mb["mask"].to(lp.device)).sum() / total, {}

    return policy.train_step(mbs, loss_fn)


def _moments(policy: Any) -> list[torch.Tensor]:
    from megarl.trainer.optimizer import adam_states

    return [state[key].detach().cpu().clone() for _, _, state in adam_states(policy.optimizer)
            for key in ("exp_avg", "exp_avg_sq")]


def checkpoint_round_trip(work: Path) -> str:
    from megarl.checkpoint import open_checkpoint, save_checkpoint
    from megarl.models.layer_backend import bench_layer_spec
    from megarl.models.qwen_provider import read_hf_config
    from megarl.models.tiny import make_tiny_checkpoint
    from megarl.trainer.policy import MegatronPolicy

    hf_dir = make_tiny_checkpoint(work / "tiny_moe", kind="moe")
    hf = read_hf_config(hf_dir)
    spec = bench_layer_spec(torch.cuda.is_available(), "bf16")

    def policy() -> Any:
        return MegatronPolicy(hf_dir, hf, OPTIM, distributed_optimizer=True, precision="bf16", layer_spec=spec)

    with _world_of_one():
        first = policy()
        for step in range(2):
            _step(first, step)
        moments = _moments(first)
        if not moments:
            raise CheckFailed("the optimizer holds no Adam moments after two steps", "report it with `pip list`")
        path = save_checkpoint(work / "checkpoints", 2, 0, 1, {"version": first.version}, {}, {"world_size": 1},
                               keep_last=1, sharded_state=first.sharded_state_dict())
        _step(first, 2)
        resumed = policy()
        ckpt = open_checkpoint(path, {})
        resumed.load_sharded_state_dict(ckpt.load_sharded(resumed.sharded_state_dict(is_loading=True)), 2)
        loaded = _moments(resumed)
        if len(loaded) != len(moments) or not all(torch.equal(a, b) for a, b in zip(loaded, moments, strict=True)):
            raise CheckFailed("the resumed optimizer's Adam moments differ from the saved ones",
                              f"keep {path} and report it with `pip list`")
        _step(resumed, 2)
        same = all(torch.equal(a, b) for a, b in zip(first.model.parameters(), resumed.model.parameters(),
                                                     strict=True))
        adam = type(first.optimizer.chained_optimizers[0].optimizer).__module__.split(".")[0]
        built = first.layer_spec
    if not same:
        raise CheckFailed("the resumed run's next step differs from the uninterrupted run's",
                          f"keep {path} and report it with `pip list`")
    device = "CUDA" if torch.cuda.is_available() else "CPU"
    return (f"saved and resumed on {device} ({built} spec, bf16, {adam}'s Adam): moments equal, the next step bit "
            "for bit")


def te_packed_step(work: Path) -> str:
    from megarl.models.qwen_provider import read_hf_config
    from megarl.models.tiny import make_tiny_checkpoint
    from megarl.trainer.policy import MegatronPolicy

    hf_dir = make_tiny_checkpoint(work / "tiny_moe", kind="moe")
    hf = read_hf_config(hf_dir)
    seen: list[torch.Tensor] = []
    with _world_of_one():
        policy = MegatronPolicy(hf_dir, hf, OPTIM, distributed_optimizer=True, precision="bf16", layer_spec="te")
        metrics = _step(policy, 0, packed=True, seen=seen)
    if not all(torch.isfinite(torch.tensor(v)) for v in metrics.values() if isinstance(v, float)):
        raise CheckFailed(f"a non-finite training metric on packed sequences: {metrics}", "report it with `pip list`")
    reference = _transformers_logprobs(hf_dir, _batch(hf["vocab_size"], 0))
    got = torch.cat(seen)
    mask = _batch(hf["vocab_size"], 0)["mask"].bool()
    worst = float((got[mask] - reference[mask]).abs().max())
    if worst > 1e-2:
        raise CheckFailed(f"packed bf16 log-probs differ from transformers' by up to {worst:.2e} (> 1e-2)",
                          "check the THD path (trainer.pack_sequences=false avoids it) and report it")
    return f"one packed bf16 step on TE's spec: log-probs within {worst:.1e} of transformers', finite loss"


def _transformers_logprobs(hf_dir: Path, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each sequence alone through `transformers` in bf16 on the CPU: the independent reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
    out = torch.zeros(batch["tokens"].shape)
    with torch.no_grad():
        for i, n in enumerate(batch["lengths"].tolist()):
            logits = model(batch["tokens"][i:i + 1, :n]).logits.float()
            lp = torch.log_softmax(logits, -1)[0].gather(-1, batch["targets"][i, :n, None])[:, 0]
            out[i, :n] = lp
    return out
