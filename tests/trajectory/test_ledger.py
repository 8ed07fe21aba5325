"""The pure ledger: lifecycle, group completion, micro-step batching, the tree summary."""

from __future__ import annotations

import json

from libs.common.events import GroupQueued, MicroStepQueued, RolloutScored, RolloutStarted, SamplesSelected, TreeSealed
from services.trajectory.ledger import LedgerConfig, RolloutPhase, TrajectoryLedger, tree_summary

from ._calls import SYSTEM, TASK, Agent, Recorder

RUN = "run1"


def _calls(rollout: str, turns: int):
    rec = Recorder(rollout)
    main = Agent(rec, SYSTEM + TASK)
    for k in range(turns):
        main.say([20 + k, 21, 2], [3, 90 + k, 91])
    main.compact([40, 41, 2])
    main.say([30, 2])
    return rec.calls


def _ledger(config: LedgerConfig, rollouts: dict[str, int], group: str = "g"):
    ledger = TrajectoryLedger(config)
    for r, turns in rollouts.items():
        ledger.rollout_started(RolloutStarted(run_id=RUN, rollout_id=r, task_id="t", group_id=group,
                                              harness="claude_code", weight_version=0,
                                              api_key_digest="a" * 64, step=7))
        for c in _calls(r, turns):
            assert not ledger.call_recorded(c).rejected
    return ledger


def _score(ledger, rollout, score):
    ev = RolloutScored(run_id=RUN, rollout_id=rollout, score=score)
    ledger.rollout_ended(rollout)
    ledger.rollout_judged(ev)
    return ledger.seal(rollout, ev)


def test_the_group_is_queued_once_every_rollout_is_sealed():
    ledger = _ledger(LedgerConfig(RUN), {"r1": 3, "r2": 5, "r3": 2})
    first = _score(ledger, "r1", 1.0)
    assert ledger.rollouts["r1"].phase is RolloutPhase.SEALED
    assert [e.TYPE for e in first.events] == ["ForkDetected", "ForkDetected", "TreeSealed",
                                              "SamplesSelected"]
    assert not any(isinstance(e, MicroStepQueued) for e in first.events)
    _score(ledger, "r2", 0.0)
    last = _score(ledger, "r3", 0.5)
    steps = [e for e in last.events if isinstance(e, MicroStepQueued)]
    assert len(steps) == 1 and steps[0].step == 7
    assert len(steps[0].advantages) == len(steps[0].sample_digests) == 3
    assert _score(ledger, "r3", 0.5).events == []  # sealing twice does nothing


def _packed_by_digest(ledger):
    from services.trajectory.codec import encode_packed, sha256_hex

    return {sha256_hex(encode_packed(p)): p for s in ledger.rollouts.values() for p in s.tree.seal().packed}


def test_micro_steps_respect_their_token_budget():
    from services.trajectory.packing import merge_forest

    ledger = _ledger(LedgerConfig(RUN, micro_step_tokens=60), {"r1": 6, "r2": 6})
    packed = _packed_by_digest(ledger)
    _score(ledger, "r1", 1.0)
    effects = _score(ledger, "r2", 0.0)
    steps = [e for e in effects.events if isinstance(e, MicroStepQueued)]
    assert len(steps) > 1
    for step in steps:  # n_tokens: the samples laid out as the trainer does
        assert step.n_tokens == merge_forest([packed[d] for d in step.sample_digests]).n_tokens
        assert step.n_tokens <= 60 or len(step.sample_digests) == 1
    assert len({s.micro_step for s in steps}) == len(steps)
    queued = [d for step in steps for d in step.sample_digests]
    assert queued == [r.digest for r in ledger.rollouts["r1"].samples + ledger.rollouts["r2"].samples]


def test_a_micro_step_counts_the_group_prompt_once():
    from services.trajectory.packing import merge_forest

    ledger = _ledger(LedgerConfig(RUN), {"r1": 3, "r2": 4})
    packed = _packed_by_digest(ledger)
    _score(ledger, "r1", 1.0)
    (step,) = [e for e in _score(ledger, "r2", 0.0).events if isinstance(e, MicroStepQueued)]
    trees = [packed[d] for d in step.sample_digests]
    # both rollouts start with the same system prompt and task: the trainer lays it out once
    assert step.n_tokens == merge_forest(trees).n_tokens
    assert step.n_tokens <= sum(p.n_tokens for p in trees) - len(SYSTEM + TASK)
    assert all(not s.packed for s in ledger.rollouts.values())  # freed once queued


def test_sealing_emits_summary_and_samples_with_deterministic_ids():
    def run():
        ledger = _ledger(LedgerConfig(RUN, group_size=2), {"r1": 4})
        return _score(ledger, "r1", 0.75)

    a, b = run(), run()
    assert [e.event_id for e in a.events] == [e.event_id for e in b.events]
    assert a.blobs == b.blobs
    sealed = next(e for e in a.events if isinstance(e, TreeSealed))
    selected = next(e for e in a.events if isinstance(e, SamplesSelected))
    assert not any(isinstance(e, MicroStepQueued) for e in a.events)  # the group needs 2
    summary = json.loads(a.blobs[0])
    assert summary["score"] == 0.75 and summary["rollout_id"] == "r1"
    assert {b["role"] for b in summary["branches"]} == {"main", "main_summary"}
    assert len(selected.samples) == len(summary["samples"]) == 1
    assert sealed.n_calls == len(summary["calls"]) == 6


def test_calls_after_the_seal_are_rejected_and_redeliveries_ignored():
    ledger = _ledger(LedgerConfig(RUN), {"r1": 2})
    _score(ledger, "r1", 1.0)
    assert ledger.rollouts["r1"].tree is None  # dropped at the seal; its call ids are kept
    again = _calls("r1", 2)[0]
    assert ledger.call_recorded(again).rejected == []
    late = _calls("r1", 3)[-1]
    late = late.__class__(**{**late.__dict__, "call_id": "late"})
    (rejected,) = ledger.call_recorded(late).rejected
    assert "sealed" in rejected.reason


def test_tree_summary_is_json():
    ledger = _ledger(LedgerConfig(RUN), {"r1": 1})
    state = ledger.rollouts["r1"]
    doc = json.loads(tree_summary(state, state.tree.seal()))
    assert doc["stored_tokens"] <= doc["flattened_tokens"]


def test_a_start_read_after_the_score_seals_the_rollout_and_completes_the_group():
    """The score alone does not seal (the harness, hence the rules, is not known yet);
    the start then seals it and queues its group."""
    ledger = TrajectoryLedger(LedgerConfig(RUN, group_size=1))
    for c in _calls("r1", 2):
        ledger.call_recorded(c)
    assert _score(ledger, "r1", 1.0).events == []
    assert not ledger.ready_to_seal("r1") and ledger.rollouts["r1"].phase is RolloutPhase.ENDED
    start = RolloutStarted(run_id=RUN, rollout_id="r1", task_id="t", group_id="g", harness="claude_code",
                           weight_version=0, api_key_digest="a" * 64, step=2)
    late = ledger.rollout_started(start)
    assert ledger.rollouts["r1"].phase is RolloutPhase.SEALED
    assert [e.TYPE for e in late.events] == ["ForkDetected", "ForkDetected", "TreeSealed", "SamplesSelected",
                                             "MicroStepQueued", "GroupQueued"]
    step, group = late.events[-2:]
    assert isinstance(step, MicroStepQueued) and step.step == 2 and step.group_micro_steps == 1
    assert isinstance(group, GroupQueued) and (group.step, group.micro_steps, group.rollout_ids) == (2, 1, ["r1"])
    assert ledger.rollout_started(start).events == []  # a redelivered start: queued once


def _claude_code_compaction_timeout():
    """A Claude Code rollout cut off while compacting: its last delivered call is the
    compaction request, told from an ordinary turn only by the harness's summary marker."""
    from services.trajectory.forks import CLAUDE_CODE_SUMMARY_TEXTS
    from services.trajectory.records import CallHints, CallRecord

    def enc(text):
        return [1000 + (ord(ch) % 200) for ch in text]

    hints = CallHints(system_digest="5" * 64, tools_digest="7" * 64)
    instruction = enc(CLAUDE_CODE_SUMMARY_TEXTS[0])

    def call(cid, new, out, parent=None, prefix=0):
        return CallRecord(cid, "r1", new, out, [-0.5] * len(out), parent, prefix, hints=hints)

    calls = [call("a", [1, 10, 2, 1, 11, 2], [20, 21, 2]), call("b", [3, 90, 91], [22, 23, 2], "a", 9),
             call("s", [3, 92] + instruction, [40, 41, 42, 2], "b", 15)]
    return enc, calls


def test_a_score_read_before_the_start_seals_with_the_harness_rules_as_a_replay_does():
    """Live, the scores stream may be read ahead of the rollouts stream; a rebuild reads
    the start first. Both must seal with the harness's rules (here Claude Code's summary
    marker) and so select the same samples with the same roles and digests."""
    from services.trajectory.main import harness_rules

    enc, calls = _claude_code_compaction_timeout()
    start = RolloutStarted(run_id=RUN, rollout_id="r1", task_id="t", group_id="g", harness="claude_code",
                           weight_version=0, api_key_digest="a" * 64, step=0)
    score = RolloutScored(run_id=RUN, rollout_id="r1", score=0.3, partial=True)

    def run(start_first: bool):
        ledger = TrajectoryLedger(LedgerConfig(RUN, group_size=1, rules=harness_rules(enc)))
        effects = ledger.rollout_started(start) if start_first else None
        for c in calls:
            assert not ledger.call_recorded(c).rejected
        ledger.rollout_ended("r1")
        ledger.rollout_judged(score)
        sealed = ledger.seal("r1", score)
        if start_first:
            effects.extend(sealed)
        else:
            assert sealed.events == [] and not ledger.ready_to_seal("r1")
            effects = ledger.rollout_started(start)
        return [(s.role, s.digest) for e in effects.events if isinstance(e, SamplesSelected) for s in e.samples], \
            [e.TYPE for e in effects.events]

    replay, live = run(True), run(False)
    assert replay == live
    assert [role for role, _ in replay[0]] == ["main_summary"]
    assert replay[1][-2:] == ["MicroStepQueued", "GroupQueued"]


def test_a_group_with_nothing_to_train_is_still_queued_as_a_group():
    """Every score failed: no micro-step, but the trainer must count the group toward its
    step (or wait for it for ever)."""
    from libs.common.events import RolloutScoringFailed

    ledger = _ledger(LedgerConfig(RUN), {"r1": 2, "r2": 3})
    events = []
    for r in ("r1", "r2"):
        ev = RolloutScoringFailed(run_id=RUN, rollout_id=r, reason="judge down")
        ledger.rollout_ended(r)
        ledger.rollout_judged(ev)
        events += ledger.seal(r, ev).events
    assert not any(isinstance(e, MicroStepQueued) for e in events)
    (group,) = [e for e in events if isinstance(e, GroupQueued)]
    assert (group.group_id, group.step, group.micro_steps, group.samples) == ("g", 7, 0, 0)


def test_service_options_become_the_ledger_config():
    from services.trajectory.main import ledger_config

    config = ledger_config("run1", {"budget": "3", "micro_step_tokens": 1000, "advantage_scale": "none"},
                           encode=lambda text: [ord(ch) for ch in text])
    assert (config.budget, config.micro_step_tokens, config.advantage.scale) == (3, 1000, "none")
    assert config.tree_config("claude_code").max_piece_tokens == 1000
    rules = config.tree_config("claude_code").rules
    assert rules.summary_markers and rules.continuation_markers
    assert config.tree_config("unknown-harness").rules.name == "openai_tools"


def test_a_group_waits_for_the_size_its_starts_state():
    """The runner starts a group's rollouts as its slots free up, so the first can be
    scored before the second has started. With no group size configured, the size stated
    by ``RolloutStarted.group_size`` holds the group until all of it is sealed (before,
    the first rollout alone was queued with advantage 0 and the second's samples lost);
    ``gyre up`` passes the run's group_size to the service too."""
    from services.trajectory.main import run_config_options

    ledger = TrajectoryLedger(LedgerConfig(RUN))

    def start(r: str) -> None:
        ledger.rollout_started(RolloutStarted(run_id=RUN, rollout_id=r, task_id="t", group_id="g", harness="claude_code",
                                              weight_version=0, api_key_digest="a" * 64, step=7, group_size=2))
        for c in _calls(r, 2):
            assert not ledger.call_recorded(c).rejected

    start("r0")
    assert not [e for e in _score(ledger, "r0", 1.0).events if isinstance(e, (MicroStepQueued, GroupQueued))]
    start("r1")
    events = _score(ledger, "r1", 0.0).events
    (group,) = [e for e in events if isinstance(e, GroupQueued)]
    assert sorted(group.rollout_ids) == ["r0", "r1"]
    advantages = [a for e in events if isinstance(e, MicroStepQueued) for a in e.advantages]
    assert min(advantages) < 0 < max(advantages)
    assert run_config_options({"group_size": 4, "loss": {}, "trainer": {}})["group_size"] == 4
