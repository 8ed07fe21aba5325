"""One contract, run against each real transfer library between two processes (loopback,
private network namespace): batch read/write, checksums, refusals, stalls, dead peers."""

from __future__ import annotations

from tests.transfer.conftest import scenario

SCENARIOS = [("contract", "mooncake"), ("contract", "ucx")]


def test_batch_read_moves_every_byte(backend):
    r = scenario("contract", backend)
    assert (r["backend"], r["peer_backend"]) == (backend, backend)
    assert r["read_blocks"] == 64 and r["read_bytes"] == 16 << 20
    assert r["read_verify"] is None  # every block matches the owner's checksum


def test_batch_write_lands_in_the_peer_region(backend):
    assert scenario("contract", backend)["write_ok"] is True


def test_bad_blocks_are_refused_whole(backend):
    r = scenario("contract", backend)
    assert "overruns remote region 'kv'" in r["overrun"]
    assert "no region 'nope'" in r["unknown_region"]
    assert "peer speaks" in r["wrong_backend"]


def test_changed_bytes_fail_the_receivers_checksum(backend):
    r = scenario("contract", backend)
    assert r["corruption_is_mismatch"] and "block 0" in r["corruption"]


def test_a_stalled_peer_is_a_timeout_not_a_hang(backend):
    r = scenario("contract", backend)
    assert r["stalled_is_timeout"], r["stalled"]
    assert r["stalled_s"] < 8


def test_a_dead_peer_is_reported(backend):
    r = scenario("contract", backend)
    assert r["dead_peer_is_failure"], r["dead_peer"]
    assert r["dead_peer_s"] < 10


def test_runs_on_loopback_only():
    from tests.transfer._netns import netns_available

    r = scenario("contract", "mooncake")
    assert r["netns"] == netns_available()
