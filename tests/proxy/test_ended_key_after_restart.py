"""A restarted proxy replays the rollouts stream from its start (follow_rollouts,
start_seq=1). A call of an already-ended rollout that arrives during the replay is looked
up from the log (ended: 401); then the replay applies the rollout's old RolloutStarted,
which replaces its entry with a fresh, not-ended one: the ended rollout's key is accepted
again until the replay reaches its RolloutTimedOut."""

from __future__ import annotations

import pytest

from libs.common.events import Context, RolloutStarted, RolloutTimedOut
from services.proxy.api.common import ApiError
from services.proxy.history import key_digest

from .conftest import RUN


async def test_an_ended_rollouts_key_stays_refused_while_the_log_is_replayed(proxy) -> None:
    await proxy.bus.publish(RolloutStarted(run_id=RUN, rollout_id="old-1", task_id="t", group_id="g", harness="h",
                                           weight_version=0, api_key_digest=key_digest("k-old")))
    await proxy.bus.publish(RolloutTimedOut(run_id=RUN, rollout_id="old-1", wall_time_s=1.0))
    book = proxy.service.book
    book.rollouts.clear()  # as the proxy just restarted: nothing followed yet

    with pytest.raises(ApiError):  # a late call of the timed-out agent: looked up in the log, refused
        await proxy.service.authorize("old-1", "k-old")

    # the follower (follow_rollouts) now delivers the stream from its first message, one by one
    follow = proxy.bus.follow(Context.ROLLOUTS, filter_subject=f"gyre.{RUN}.rollouts.>", idle_s=0.2)
    accepted_during_replay = []
    try:
        async for raw in follow:
            if raw is None:
                break
            book.apply_rollout_event(raw.data)
            try:
                await proxy.service.authorize("old-1", "k-old")
                accepted_during_replay.append(raw.subject)
            except ApiError:
                pass
    finally:
        await follow.aclose()
    assert not accepted_during_replay, f"ended rollout's key accepted after applying {accepted_during_replay}"


async def test_a_start_the_replay_met_before_its_end_is_checked_against_the_log(proxy) -> None:
    """No call came before: the replay has applied the start, not yet the end; until the
    follower has read the stream to its end, a start alone is not taken at its word."""
    await proxy.bus.publish(RolloutStarted(run_id=RUN, rollout_id="old-2", task_id="t", group_id="g", harness="h",
                                           weight_version=0, api_key_digest=key_digest("k-old2")))
    await proxy.bus.publish(RolloutTimedOut(run_id=RUN, rollout_id="old-2", wall_time_s=1.0))
    book = proxy.service.book
    book.rollouts.clear()
    book.caught_up = False  # as the proxy just restarted
    [started] = [d async for d in proxy.bus.read(Context.ROLLOUTS)
                 if isinstance(d.event, RolloutStarted) and d.event.rollout_id == "old-2"]
    book.apply_rollout_event(started.event.to_json())
    with pytest.raises(ApiError):
        await proxy.service.authorize("old-2", "k-old2")
    assert book.rollouts["old-2"].ended
