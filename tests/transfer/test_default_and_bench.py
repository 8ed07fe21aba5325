"""The embedded default's choice, and the benchmarks' JSON (small sizes: shape, not speed)."""

from __future__ import annotations

import pytest

from tests.transfer.conftest import library_missing, scenario

SCENARIOS = [("choice", "ucx")]


def test_default_picks_a_working_library_and_says_which():
    r = scenario("choice", "ucx")
    assert r["default"] == ("ucx" if library_missing("mooncake") else "mooncake")
    assert r["pinned"] == "ucx"
    assert "no transfer backend works" in r["unknown"] and "carrier-pigeon" in r["unknown"]
    assert r["probe"] == {"backend": r["default"], "skipped": {}}
    assert any(line.startswith("transfer: using mooncake at 127.0.0.1:") for line in r["log"])


def test_the_advertised_host_is_gyre_transfer_host():
    r = scenario("choice", "ucx")
    assert "GYRE_TRANSFER_HOST" in r["bad_host"] and "no port" in r["bad_host"]  # needs no second address
    if r["advertised"] is None:  # `unshare -n` refused here (no user namespaces, no root)
        pytest.skip("no private network namespace here to give a second address to")
    assert r["advertised"] and set(r["advertised"].values()) == {"10.9.9.9"}
    if "mooncake" in r["advertised"]:
        assert r["read_through_it"]


def test_transfer_bench_reports_each_adapter_and_the_ceiling():
    from libs.common.transfer.bench import run_bench

    for backend in ("mooncake", "ucx"):
        if library_missing(backend):
            pytest.skip(f"{backend} cannot run here: {library_missing(backend)}")
    r = run_bench("transfer", total_mib=8, block_kib=256, repeats=1)
    assert r["blocks"] == 32 and r["memcpy_gb_s"] > 0
    for backend in ("mooncake", "ucx"):
        assert r[f"{backend}_gb_s"] > 0 and r[f"{backend}_verified"] is True, r


def test_migrate_bench_compares_reprefill_and_migration():
    from libs.common.transfer.bench import run_bench

    if library_missing("mooncake"):
        pytest.skip(f"mooncake cannot run here: {library_missing('mooncake')}")
    r = run_bench("migrate", cells="services.engine.kv_bench:bench_cells", sizes=[1024], backend="mooncake")
    assert r["path"] == "mooncake" and r["logprobs_identical"] is True
    # the turn is the history plus 64 new tokens; the history's last (sampled) token has no KV yet
    assert r["cached_tokens"] == r["migrated_tokens"] == r["tokens"] - 64 - 1
    assert r["reprefill_s"] > 0 and r["migrate_s"] > 0 and r["speedup"] > 0


def test_migrate_bench_needs_the_engine_named():
    from libs.common.transfer.bench import run_bench

    with pytest.raises(ValueError, match="kv_bench:bench_cells"):
        run_bench("migrate", isolate=False)
