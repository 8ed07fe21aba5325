"""``gyre agent``'s endpoint: a base URL with or without ``/v1`` from any source, and an
error that says what is missing (the URL or the key)."""

from __future__ import annotations

import pytest

from services.runner.agent.main import _endpoint, _parser, main

ENV = ("GYRE_BASE_URL", "GYRE_API_KEY", "OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("given", ["http://h:1/r/abc/v1", "http://h:1/r/abc/v1/", "http://h:1/r/abc"])
def test_a_trailing_v1_is_dropped_from_every_source(monkeypatch, given) -> None:
    monkeypatch.setenv("GYRE_API_KEY", "k")
    assert _endpoint(_parser().parse_args(["--prompt", "x", "--base-url", given]))[0] == "http://h:1/r/abc"
    monkeypatch.setenv("GYRE_BASE_URL", given)
    assert _endpoint(_parser().parse_args(["--prompt", "x"]))[0] == "http://h:1/r/abc"
    monkeypatch.delenv("GYRE_BASE_URL")
    monkeypatch.setenv("OPENAI_BASE_URL", given)
    assert _endpoint(_parser().parse_args(["--prompt", "x"]))[0] == "http://h:1/r/abc"


def test_a_missing_key_or_url_is_named(capsys, tmp_path) -> None:
    assert main(["--prompt", "x", "--workspace", str(tmp_path), "--base-url", "http://h:1/v1"]) == 2
    err = capsys.readouterr().err
    assert "no API key" in err and "GYRE_API_KEY" in err and "base URL" not in err
    assert main(["--prompt", "x", "--workspace", str(tmp_path)]) == 2
    assert "no base URL" in capsys.readouterr().err
