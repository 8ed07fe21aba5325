"""KV migration between two embedded engines (tiny-qwen) over the real transfer libraries."""

from __future__ import annotations

from tests.transfer.conftest import scenario

SCENARIOS = [("migration", "mooncake"), ("failures", "ucx")]


def test_next_call_on_target_computes_only_new_tokens():
    r = scenario("migration", "mooncake")
    assert r["result"]["kv"] == "migrated" and r["result"]["path"] == "mooncake"
    assert r["result"]["errors"] == []
    # everything but the last sampled token has KV (it was never fed back)
    assert r["result"]["migrated_tokens"] == r["history_tokens"] - 1
    assert r["cached_on_target"] == r["result"]["migrated_tokens"] == r["cached_on_source"]


def test_same_logprobs_as_on_the_source():
    r = scenario("migration", "mooncake")
    assert r["logprobs_identical"] and r["outputs_identical"]


def test_session_rerouted_is_recorded():
    r = scenario("migration", "mooncake")
    assert r["events"] == [{"session_id": "s-1", "from_cell": "A", "to_cell": "B", "reason": "drain",
                            "kv": "migrated", "migrated_tokens": r["result"]["migrated_tokens"]}]


def test_no_registration_outlives_the_move():
    r = scenario("migration", "mooncake")
    assert r["source_offers_left"] == [] and r["target_regions_left"] == []


def test_corrupted_blocks_are_refused_and_nothing_is_imported():
    r = scenario("failures", "ucx")
    assert "ChecksumMismatch" in r["corrupt_fetch"] and "nothing imported" in r["corrupt_fetch"]
    assert r["corrupt_imported_tokens"] == 0
    assert r["offers_left"] == []


def test_port_refused_falls_back_to_http():
    r = scenario("failures", "ucx")
    assert r["http"]["kv"] == "migrated" and r["http"]["path"] == "http"
    assert "offer is on ucx" in r["http"]["errors"][0]
    assert r["http_cached"] == r["http"]["migrated_tokens"] > 0


def test_stale_kv_means_reprefill_and_the_call_still_works():
    r = scenario("failures", "ucx")
    assert r["stale"]["kv"] == "reprefilled" and r["stale"]["path"] is None
    assert all("weight version" in e for e in r["stale"]["errors"])
    assert r["stale_next_call_cached"] == 0 and r["stale_next_call_tokens"] == 4


def test_proxy_evacuation_hook_moves_kv_through_the_port():
    r = scenario("migration", "mooncake")
    # by now the source has computed the whole history (the turn included it), so all of it moves
    assert r["mover_path"] == "mooncake" and r["mover_tokens"] == r["history_tokens"]
    assert r["mover_cached"] == r["mover_tokens"] and r["mover_logprobs_identical"]


def test_an_offer_never_released_expires_on_time_and_a_later_fetch_is_refused():
    r = scenario("failures", "ucx")
    assert r["expiring_registered"] and r["expired_left"] == []
    assert "expired" in r["expired_fetch"] and "nothing imported" in r["expired_fetch"]
    assert r["expired_imported_tokens"] == 0
