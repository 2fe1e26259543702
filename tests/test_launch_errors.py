"""A failure inside a trainer rank reaches the caller as one line naming the rank and the cause, with the
rank's traceback in a file of the run directory (real trainer processes; the fleet is a port nobody serves)."""

import pytest

from megarl.launch import TrainerError, free_port, prepare, train


def test_a_dead_fleet_is_one_line_naming_rank_url_and_traceback_file(tiny_moe_dir, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = prepare(None, [f"model.hf_dir={tiny_moe_dir}", f"run.dir={tmp_path / 'run'}", "run.steps=2",
                         "trainer.world_size=2", "trainer.ep=2", "rollout.tp=2"])
    with pytest.raises(TrainerError) as caught:
        train(cfg, fleet_urls=[url])
    message = str(caught.value)
    assert "\n" not in message
    # the first call to the fleet (asking it for the vLLM ranks' needs, before any push) names the dead URL; every
    # rank asks, so the rank that fails first is either one
    rank = message.removeprefix("trainer rank ")[:1]
    assert rank in ("0", "1"), message
    assert message.startswith(f"trainer rank {rank} failed: WeightSyncError: cannot plan the weight sync: "
                              f"RolloutServerLost: rollout server {url}/"), message
    assert "unreachable" in message
    log = tmp_path / "run" / f"trainer_rank{rank}_error.log"
    assert f"(traceback: {log})" in message
    assert "Traceback (most recent call last)" in log.read_text()
