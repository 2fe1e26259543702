"""The byte counts megarl's sync is compared with (`megarl.sync.baselines`): vLLM's `nccl_m2n` placement of
every HF tensor is asked of vLLM's own resolver inside the running TP-2 server (the CPU build here, the GPU
build on a GPU machine), and the `nccl` backend's bytes (the whole model to every rank) are read
from the checkpoint file."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from megarl.rollout.client import RolloutClient
from megarl.sync.baselines import bytes_per_vllm_rank, hf_tensors, m2n_placement


def test_m2n_placement_matches_vllms_resolver(moe_fleet, tiny_moe_dir):
    """vLLM's own resolver, asked on each TP worker of the running server, places every HF tensor as
    `m2n_placement` says for this platform (on the CPU build: everything falls back)."""
    hf = json.loads((tiny_moe_dir / "config.json").read_text())
    cpu = not torch.cuda.is_available()
    expected = {name: m2n_placement(name, hf, cpu=cpu) for name in hf_tensors(hf)}
    replies = RolloutClient(moe_fleet.base_url, timeout_s=120).collective_rpc("megarl_m2n_placements")
    assert len(replies) == 2  # one per TP worker
    for reply in replies:
        assert reply == expected


def test_bytes_per_rank_of_vllms_backends(tiny_moe_dir):
    hf = json.loads((tiny_moe_dir / "config.json").read_text())
    file_bytes, o_proj, whole_on_each = 0, 0, 0
    with safe_open(str(tiny_moe_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            nbytes = f.get_tensor(name).numel() * 4
            file_bytes += nbytes
            o_proj += nbytes if name.endswith("o_proj.weight") else 0
            whole_on_each += nbytes if "norm" in name or name.endswith("mlp.gate.weight") else 0
    per_rank = bytes_per_vllm_rank(hf, tp=2, itemsize=4)
    assert per_rank["nccl"] == [file_bytes, file_bytes]
    assert per_rank["nccl_m2n"] == [file_bytes - o_proj // 2] * 2
    assert bytes_per_vllm_rank(hf, tp=2, itemsize=4, cpu=True)["nccl_m2n"] == [file_bytes] * 2
    # megarl: every element to the one rank that loads it; norms and the router are loaded whole by both
    assert sum(per_rank["megarl"]) == file_bytes + whole_on_each
