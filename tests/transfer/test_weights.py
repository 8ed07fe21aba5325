"""Weight pull: the core publishes a snapshot of named tensors, a satellite process pulls it."""

from __future__ import annotations

from tests.transfer.conftest import scenario

SCENARIOS = [("weights", "mooncake"), ("weights", "ucx"), ("failures", "ucx")]


def test_satellite_gets_the_published_snapshot(backend):
    r = scenario("weights", backend)
    assert r["identical"], "tensors differ from what the core published (or it changed under the pull)"
    assert r["version"] == "v3"
    assert r["names"] == ["embed.weight", "layers.0.norm", "layers.0.q.weight", "odd", "step"]
    assert r["dtypes"]["layers.0.q.weight"] == "torch.bfloat16" and r["dtypes"]["step"] == "torch.int64"
    assert r["shapes"]["odd"] == [7, 5, 3] and r["shapes"]["step"] == []


def test_pull_leaves_nothing_registered_and_fails_after_unpublish(backend):
    r = scenario("weights", backend)
    assert r["left_registered"] == []
    assert r["after_unpublish"] and "Transfer" in r["after_unpublish"]


def test_inference_cell_takes_new_weights_through_the_port():
    r = scenario("failures", "ucx")
    assert r["pull_answer"]["success"] and r["pull_answer"]["weight_version"] == "v2"
    assert r["pull_version"] == "v2" and r["pull_identical"]


def test_a_mismatched_snapshot_is_refused_before_it_moves():
    r = scenario("failures", "ucx")
    assert "shape of" in r["pull_wrong_shape"] and r["version_after_wrong"] == "v2"


def test_trainer_transfer_shape_puts_and_gets_over_the_port(backend):
    r = scenario("weights", backend)
    assert r["trainer_port_kind"] == "port" and r["trainer_port_newest"] == [1.0, 1.0, 1.0, 1.0]
    assert r["trainer_port_oldest"] and "Transfer" in r["trainer_port_oldest"]
