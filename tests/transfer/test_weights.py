"""Weight pull: the core publishes a snapshot of named tensors, a satellite process pulls it."""

from __future__ import annotations

from tests.transfer.conftest import scenario


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
