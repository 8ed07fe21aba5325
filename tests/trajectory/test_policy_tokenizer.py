"""The live service's policy tokenizer: loaded as the proxy loads it, turned into Claude
Code's compaction markers, so that a compaction is a compaction when it arrives."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from libs.common.blobs import MemoryBlobStore
from libs.common.bus.memory import InMemoryBus
from libs.common.events import ForkDetected, RolloutScored, RolloutStarted
from libs.common.service import Health, ServiceContext
from services.trajectory.forks import (CLAUDE_CODE_CONTINUATION_TEXTS, CLAUDE_CODE_SUMMARY_TEXTS, HARNESS_RULES,
                                       classify_calls)
from services.trajectory.ledger import TrajectoryLedger
from services.trajectory.main import (ledger_config, load_policy_tokenizer, policy_model, run_config_options,
                                      trajectory_main)

from ._calls import build, show
from ._proxy_calls import CONTINUATION, SUMMARY_REQUEST, Msg, ProxyRecorder, bash, tool_result


@pytest.fixture(scope="module")
def tokenizer():
    tok = load_policy_tokenizer("tiny-qwen")  # the proxy's default model (built offline, cached)
    assert tok.encode is not None, tok.error
    return tok


@pytest.fixture(scope="module")
def renderer(tokenizer):
    from services.proxy.adapters.template import HFRenderer

    return HFRenderer(tokenizer.folder)


def _session(renderer, *, compact: bool = True, resume: bool = True):
    """A Claude Code main agent: three Bash rounds, then (context full) the compaction
    request, then the first request after it, as the proxy records them."""
    rec = ProxyRecorder(renderer)
    msgs = [Msg("system", "You are an interactive agent that helps users with software engineering tasks."),
            Msg("user", "The tests in tests/test_io.py fail. Fix the bug.")]
    for k, command in enumerate(["ls", "pytest -x", "cat src/io.py"]):
        _, reply = rec.send(msgs, f"Step {k}.\n" + bash(command))
        msgs = msgs + [reply, tool_result(reply, f"output of {command}\n" * 3)]
    out = {"rec": rec}
    if compact:
        # messages minus the retained tail (the last round), the instruction after the tool result
        request = msgs[:-2] + [Msg("user", SUMMARY_REQUEST)]
        out["summary"], _ = rec.send(request, "<analysis>read the code</analysis>\n<summary>The bug is in "
                                              "src/io.py: read() drops the last line.</summary>")
    if compact and resume:
        text = CONTINUATION.format(summary="The bug is in src/io.py: read() drops the last line.")
        fresh = [msgs[0], Msg("user", text)] + msgs[-2:]  # then the retained tail verbatim
        out["post"], reply = rec.send(fresh, "Fixing it.\n" + bash("sed -i s/a/b/ src/io.py"))
        out["after"], _ = rec.send(fresh + [reply, tool_result(reply, "")], "Done.")
    return out


def test_the_policy_tokenizer_is_the_proxys_and_gives_claude_codes_markers(tokenizer, renderer):
    text = "Your task is to create a detailed summary of the conversation so far"
    assert tokenizer.encode(text) == renderer.encode(text)  # what the proxy sent is what we search
    rules = ledger_config("r", {}, tokenizer.encode).rules
    for name in ("claude_code", "gyre_agent"):
        assert len(rules[name].summary_markers) == len(CLAUDE_CODE_SUMMARY_TEXTS)
        assert len(rules[name].continuation_markers) == len(CLAUDE_CODE_CONTINUATION_TEXTS)
    assert not rules["openai_tools"].summary_markers
    # a marker is found inside the instruction as the chat template renders it in the request
    request = renderer.encode(renderer.render([Msg("user", "x"), Msg("user", SUMMARY_REQUEST)], [],
                                              add_generation_prompt=True))
    found = [m for m in rules["claude_code"].summary_markers
             if any(tuple(request[i:i + len(m)]) == m for i in range(len(request)))]
    assert len(found) == len(CLAUDE_CODE_SUMMARY_TEXTS)
    assert tokenizer.health() == {"tokenizer": tokenizer.folder, "compaction_markers": True}
    assert load_policy_tokenizer("tiny-qwen") is tokenizer  # loaded once per process


def test_the_model_is_found_as_the_proxy_finds_it():
    assert policy_model({}, {}) == "tiny-qwen"
    assert policy_model({}, {"GYRE_MODEL": "/models/q"}) == "/models/q"
    assert policy_model({"model": "/models/p"}, {"GYRE_MODEL": "/models/q"}) == "/models/p"
    # gyre up passes the run config's model.name (GYRE_TRAJECTORY_MODEL), a replay reads it from RunStarted
    assert run_config_options({"model": {"name": "tiny-qwen", "policy_name": "policy"}}) == {"model": "tiny-qwen"}


def test_a_replay_with_the_run_configs_model_builds_the_same_markers(tokenizer):
    live = ledger_config("r", {}, tokenizer.encode).rules["claude_code"]
    replayed = ledger_config("r", {"model": "tiny-qwen"}).rules["claude_code"]
    assert replayed.summary_markers == live.summary_markers and live.summary_markers


def test_a_claude_code_compaction_is_a_compaction_when_it_arrives(tokenizer, renderer):
    s = _session(renderer, resume=False)  # the rollout timed out while compacting
    summary = s["summary"]
    assert summary.drift == "fork"  # the proxy: the request parts inside an earlier input
    tree = build(s["rec"].calls)
    rules = ledger_config("r", {}, tokenizer.encode).rules["claude_code"]
    marked = {lab.call_id: lab for lab in classify_calls(tree, rules)}
    show(tree, list(marked.values()), title="claude code compaction, real tokenizer")
    assert marked[summary.call_id].fork == "compaction" and marked[summary.call_id].role == "main_summary"
    assert marked[summary.call_id].forked_from == 2  # parts from the call whose round it drops
    hindsight = {lab.call_id: lab for lab in classify_calls(tree, HARNESS_RULES["claude_code"])}
    assert hindsight[summary.call_id].fork == "edit" and hindsight[summary.call_id].role == "main"


def test_the_live_wiring_reports_the_compaction_at_seal(tokenizer, renderer):
    calls = _session(renderer, resume=False)["rec"].calls
    for encode, expected in ((tokenizer.encode, "compaction"), (None, "edit")):
        ledger = TrajectoryLedger(ledger_config("run1", {}, encode))
        ledger.rollout_started(RolloutStarted(run_id="run1", rollout_id="r1", task_id="t", group_id="g",
                                              harness="claude_code", weight_version=0, api_key_digest="a" * 64))
        for c in calls:
            assert not ledger.call_recorded(c).rejected
        ev = RolloutScored(run_id="run1", rollout_id="r1", score=0.5, partial=True)
        ledger.rollout_ended("r1")
        ledger.rollout_judged(ev)
        forks = [e for e in ledger.seal("r1", ev).events if isinstance(e, ForkDetected)]
        assert [(e.call_id, e.fork_type) for e in forks] == [(calls[-1].call_id, expected)]


def test_the_continuation_is_recognised_by_its_own_marker(tokenizer, renderer):
    s = _session(renderer)
    rules = ledger_config("r", {}, tokenizer.encode).rules["claude_code"]
    tree = build(s["rec"].calls)
    lab = {x.call_id: x for x in classify_calls(tree, rules)}
    assert lab[s["summary"].call_id].fork == "compaction"
    assert lab[s["post"].call_id].fork == "compaction" and lab[s["post"].call_id].role == "main"
    assert lab[s["after"].call_id].relation == "extend" and lab[s["after"].call_id].fork is None
    # without the summary call (its record lost), the continuation still is one, by its marker
    no_summary = build([c for c in s["rec"].calls if c is not s["summary"]])
    assert {x.call_id: x for x in classify_calls(no_summary, rules)}[s["post"].call_id].fork == "compaction"
    hindsight = {x.call_id: x for x in classify_calls(no_summary, HARNESS_RULES["claude_code"])}
    assert hindsight[s["post"].call_id].fork == "edit"


async def test_without_a_tokenizer_the_service_runs_and_says_so(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("GYRE_MODEL", str(tmp_path / "no-such-model"))
    monkeypatch.delenv("GYRE_TRAJECTORY_MODEL", raising=False)
    runtime = SimpleNamespace(settings=SimpleNamespace(run_id="run1"), bus=InMemoryBus(), blobs=MemoryBlobStore())
    health, stop = Health("trajectory"), asyncio.Event()
    ctx = ServiceContext(runtime, health, stop, CollectorRegistry(), {}, None)
    with caplog.at_level(logging.WARNING, logger="services.trajectory.main"):
        task = asyncio.create_task(trajectory_main(ctx))
        for _ in range(250):
            if health.status == "ok" or task.done():
                break
            await asyncio.sleep(0.02)
        stop.set()
        await asyncio.wait_for(task, 5)
    assert health.status == "ok"  # gyre up starts the run only when every service is "ok"
    assert health.detail["compaction_markers"] is False
    assert "no-such-model" in health.detail["tokenizer_error"]
    assert any("no policy tokenizer" in r.getMessage() for r in caplog.records)
    assert ledger_config("run1", {"model": str(tmp_path / "no-such-model")}).rules["claude_code"].summary_markers == ()
