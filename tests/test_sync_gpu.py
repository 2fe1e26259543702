"""The sync over NCCL (marker `gpu`, deselected by default; `pytest -m gpu` on a machine with 3 or 4 GPUs).

NOT RUN in this repository's CI or on the single-GPU machines lent to its sessions: NCCL refuses two ranks on one
device, and these layouts need 2 trainer ranks and 1 or 2 receivers, one GPU each. The same byte-moving code as
on CPU (`megarl.sync.stream`; `TorchGroupTransport`'s group is NCCL when CUDA is present), staged in GPU buffers
(`megarl.sync.wire.device`): every receiver gets exactly its vLLM rank's slices, checked value by value by the
benchmark's untimed first run, and nothing more; the broadcast baseline sends each receiver the whole model.
"""

from __future__ import annotations

import pytest
import torch

from megarl.bench.sync import run_bench
from megarl.sync.plan import vllm_rank_slices
from tests.test_sync_stream import HF, ITEMSIZE, _bytes, _spec

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("vllm_tp", "replicas"), [(1, 1), (2, 1)], ids=["tp1", "tp2"])
def test_partitioned_sync_over_nccl_moves_exactly_each_ranks_slices(vllm_tp, replicas):
    if torch.cuda.device_count() < 2 + vllm_tp * replicas:
        pytest.fail(f"this layout needs {2 + vllm_tp * replicas} GPUs (2 trainers + {vllm_tp * replicas} receivers, "
                    "one GPU each: NCCL refuses two ranks on one device)")
    result = run_bench(_spec(vllm_tp, replicas))  # its untimed first run checks every received value
    needs = [_bytes(vllm_rank_slices(HF, vllm_tp, r)) for _ in range(replicas) for r in range(vllm_tp)]
    assert result["methods"]["partitioned"]["bytes_per_receiver"] == needs
    model = sum(s.numel for s in vllm_rank_slices(HF, 1, 0)) * ITEMSIZE
    assert result["methods"]["broadcast"]["bytes_per_receiver"] == [model] * (vllm_tp * replicas)
