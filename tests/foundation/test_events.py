"""The event catalogue: round trips, subjects, upcasters and clear decode errors."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from libs.common import events as ev
from libs.common.events.registry import _UPCASTERS

D = "ab" * 32


def samples() -> list[ev.Event]:
    r = "run-1"
    return [
        ev.RunStarted(run_id=r, config={"model": "tiny"}, config_digest=D),
        ev.RolloutStarted(run_id=r, rollout_id="ro-1", task_id="t", group_id="g", harness="gyre",
                          weight_version=3, api_key_digest=D),
        ev.RolloutTimedOut(run_id=r, rollout_id="ro-1", snapshot_digest=D, exit_status=None, wall_time_s=3600.0),
        ev.CallRecorded(run_id=r, call_id="c1", rollout_id="ro-1", session_id="s1", api="anthropic_messages",
                        new_input_digest=D, n_new_input_tokens=10, output_digest=D, logprobs_digest=D,
                        n_output_tokens=5, weight_spans=[{"start": 0, "end": 5, "version": 3}],
                        drift=ev.DriftClass.APPEND),
        ev.RolloutScored(run_id=r, rollout_id="ro-1", score=0.5, tests=[{"name": "a", "outcome": "passed"}],
                         partial=True),
        ev.SwitchRequested(run_id=r, cell="cell-1", from_role="inference", to_role="training",
                           water_level=0.2, reason="low water"),
        ev.MicroStepQueued(run_id=r, step=1, micro_step="1.0", group_id="g", sample_digests=[D],
                           advantages=[0.7], n_tokens=100),
        ev.StepApplied(run_id=r, step=1, weight_version=4, micro_steps_used=["1.0"], loss={"mean": 0.1}),
    ]


@pytest.mark.parametrize("event", samples(), ids=lambda e: e.TYPE)
def test_round_trip(event: ev.Event) -> None:
    raw = event.to_json()
    data = json.loads(raw)
    assert data["type"] == event.TYPE and data["schema_version"] == event.SCHEMA_VERSION
    assert ev.decode(raw) == event
    # a re-serialised copy (other key order) takes the slow path and gives the same event
    assert ev.decode(json.dumps(dict(reversed(list(data.items()))))) == event


def test_every_contract_event_is_registered() -> None:
    names = set(ev.event_types())
    for required in ("RolloutStarted", "RolloutFinished", "RolloutTimedOut", "CallRecorded", "SessionRerouted",
                     "RolloutScored", "RolloutScoringFailed", "ForkDetected", "TreeSealed", "SamplesSelected",
                     "MicroStepQueued", "SwitchRequested", "SwitchCompleted", "SwitchFailed", "WaterLevelSampled",
                     "MicroStepClaimed", "MicroStepDone", "StepApplied", "WeightsPublished"):
        assert required in names
    for cls in ev.event_types().values():
        assert cls.TYPE.endswith(("ed", "Done", "TimedOut", "Entered")), cls.TYPE  # past-tense names


def test_subject_carries_run_context_type_and_key() -> None:
    e = samples()[1]
    assert e.subject == "gyre.run-1.rollouts.RolloutStarted.ro-1"
    odd = ev.RolloutStarted(run_id="r", rollout_id="a.b *>", task_id="t", group_id="g", harness="h",
                            weight_version=0, api_key_digest=D)
    token = odd.subject.split(".")[-1]
    assert token.startswith("a_b___-x") and not any(c in token for c in ".*> ")


def test_distinct_ids_never_share_a_subject_token() -> None:
    # "a.b" and "a_b" both became "a_b": the evaluator's "already scored?" check and its
    # expect-empty publish took one rollout's score for the other's, and one went unscored
    ids = ["a.b", "a_b", "a b", "a*b", "a>b", "a.b.", "a_b_", "", "_", "\udcff", "\udcfe", "é", "e"]
    tokens = [ev.subject_token(i) for i in ids]
    assert len(set(tokens)) == len(ids)
    assert all(t and not any(c in t for c in ".*> \t") for t in tokens)
    assert ev.subject_token("s3-task_1-0-ab12:x") == "s3-task_1-0-ab12:x"  # a safe id stands as itself


def test_events_are_frozen_and_strict() -> None:
    e = samples()[0]
    with pytest.raises(ValidationError):
        e.run_id = "other"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        ev.RunStarted(run_id="has.dot")
    with pytest.raises(ValidationError):
        ev.RunStarted(run_id="r", unknown_field=1)


def test_caused_links_causation_and_correlation() -> None:
    first = samples()[1]
    second = ev.RolloutFinished(**first.caused(rollout_id="ro-1", wall_time_s=1.0))
    assert second.causation_id == first.event_id
    assert second.correlation_id == first.event_id
    third = ev.RolloutScored(**second.caused(rollout_id="ro-1", score=1.0))
    assert third.correlation_id == first.event_id


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"not json", "not JSON"),
        (b"[1]", "must be an object"),
        (b'{"type": "NoSuchThing", "schema_version": 1}', "unknown event type"),
        (b'{"type": "RunStarted", "schema_version": 99, "run_id": "r"}', "newer than this Gyre knows"),
        (b'{"type": "RunStarted", "schema_version": 1}', "run_id"),
        (b'{"type": "RolloutScored", "schema_version": 1, "run_id": "r", "rollout_id": "x", "score": 7}', "score"),
    ],
)
def test_decode_errors_are_clear(raw: bytes, message: str) -> None:
    with pytest.raises(ev.EventDecodeError, match=message):
        ev.decode(raw)


def test_upcaster_lifts_old_payloads() -> None:
    from pydantic import Field

    from libs.common.events.envelope import Context, Event
    from libs.common.events.registry import _PREFIXES, _TYPES, register

    class ThingNoted(Event):
        CONTEXT = Context.RUNS
        SCHEMA_VERSION = 2
        label: str = Field(min_length=1)  # v1 called it "name"

    register(ThingNoted)
    try:

        @ev.upcaster("ThingNoted", 1)
        def _v1_to_v2(payload: dict) -> dict:
            payload = dict(payload)
            payload["label"] = payload.pop("name")
            return payload

        old = b'{"type":"ThingNoted","schema_version":1,"run_id":"r","name":"x"}'
        assert ev.decode(old).label == "x"
        assert ev.decode(ThingNoted(run_id="r", label="y").to_json()).label == "y"
    finally:
        _TYPES.pop("ThingNoted", None)
        _UPCASTERS.pop(("ThingNoted", 1), None)
        for k in [k for k, v in _PREFIXES.items() if v is ThingNoted]:
            _PREFIXES.pop(k)


def test_call_recorded_v1_is_read_and_think_stripped_needs_v2() -> None:
    """``think_stripped`` came with CallRecorded version 2: a version-1 call (written before
    it) still decodes, and the current version round-trips the new class."""
    fields = {"run_id": "r", "call_id": "c", "rollout_id": "ro", "session_id": "s", "api": "openai_chat",
              "new_input_digest": "0" * 64, "n_new_input_tokens": 3,
              "output_digest": "1" * 64, "logprobs_digest": "2" * 64,
              "n_output_tokens": 2, "drift": "append"}
    old = ev.decode(json.dumps({"type": "CallRecorded", "schema_version": 1, **fields}).encode())
    assert isinstance(old, ev.CallRecorded) and old.drift is ev.DriftClass.APPEND
    new = ev.CallRecorded(**{**fields, "drift": "think_stripped"})
    assert json.loads(new.to_json())["schema_version"] == ev.CallRecorded.SCHEMA_VERSION == 2
    assert ev.decode(new.to_json()) == new


def test_text_utf8_cannot_carry_is_published_escaped_not_refused() -> None:
    """A lone surrogate (a non-UTF-8 file name decoded with surrogateescape, a "\\udcff" escape
    in a client's JSON) must not make an event unpublishable: it would be lost."""
    from libs.common.events.envelope import encodable_text

    assert encodable_text("plain é") == "plain é"
    assert encodable_text("venv-\udcff") == "venv-\\xff"  # an escaped byte: shown as the byte
    assert encodable_text("a\ud800b\udcff") == "a\\ud800b\\udcff"  # not all escaped bytes: code points
    event = ev.RolloutScored(run_id="r", rollout_id="x", score=0.5, reason="link -> /opt/v-\udcff",
                             tests=[ev.TestOutcome(name="t\udcff", outcome="failed", message="m\ud83d")])
    back = ev.decode(event.to_json())
    assert back.event_id == event.event_id and back.score == 0.5
    assert back.reason == "link -> /opt/v-\\xff"
    assert (back.tests[0].name, back.tests[0].message) == ("t\\xff", "m\\ud83d")
    plain = ev.RolloutScored(run_id="r", rollout_id="x", score=0.5)
    assert plain.to_json() == ev.decode(plain.to_json()).to_json()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_float_is_refused_when_the_event_is_made(bad) -> None:
    # JSON has no NaN or infinity: the wire form wrote null, which no consumer could decode,
    # so the event was lost after its publish succeeded. The publisher is told instead.
    with pytest.raises(ValidationError, match="loss"):
        ev.MicroStepDone(run_id="r", step=0, micro_step="m", cell="c", weight_version=0, n_tokens=1, loss=bad)
    with pytest.raises(ValidationError, match="advantages"):
        ev.MicroStepQueued(run_id="r", step=0, micro_step="m", group_id="g", sample_digests=[D],
                           advantages=[bad], n_tokens=1)
    ok = ev.MicroStepDone(run_id="r", step=0, micro_step="m", cell="c", weight_version=0, n_tokens=1, loss=1e308)
    assert ev.decode(ok.to_json()) == ok
