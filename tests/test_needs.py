"""`megarl.sync.needs`: the vLLM ranks' needs as the trainer takes them from the fleet's reply (no processes)."""

import pytest

from megarl.models.tiny import make_tiny_checkpoint
from megarl.sync.loader_reads import read_model, reads_to_json
from megarl.sync.needs import NeedsError, RolloutNeeds, recorded_by_fleet, table_needs
from megarl.sync.plan import vllm_rank_slices


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return read_model(make_tiny_checkpoint(tmp_path_factory.mktemp("needs") / "moe", kind="moe"))[0]


def test_table_needs_are_the_table_per_rank(hf):
    needs = table_needs(hf, 2)
    assert needs.source == "table" and needs.key is None
    assert needs.reads == {r: vllm_rank_slices(hf, 2, r) for r in range(2)}


def test_a_record_survives_the_json_round_trip_of_the_http_calls(hf):
    needs = RolloutNeeds("recorded", table_needs(hf, 2).reads, "k" * 32, 1.5)
    assert RolloutNeeds.from_json(needs.to_json()) == needs


def test_the_fleet_reply_is_taken_from_tp_rank_0_and_checked(hf):
    record = {"key": "k" * 32, "seconds": 2.0, "reads": reads_to_json(table_needs(hf, 2).reads)}
    needs = recorded_by_fleet([record, None], 2, "http://x")
    assert needs.source == "recorded" and needs.key == "k" * 32 and needs.seconds == 2.0
    assert needs.reads[1] == vllm_rank_slices(hf, 2, 1)
    with pytest.raises(NeedsError, match=r"recorded TP ranks \[0, 1\], but rollout.tp is 4"):
        recorded_by_fleet([record, None], 4, "http://x")
    with pytest.raises(NeedsError, match=r"could not record .*: FileNotFoundError: x.*sync.needs=table"):
        recorded_by_fleet([{"error": "FileNotFoundError: x"}, None], 2, "http://x")
    with pytest.raises(NeedsError, match="no worker returned a record"):
        recorded_by_fleet([None, None], 2, "http://x")
