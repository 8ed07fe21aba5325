"""``gyre up``/``gyre eval`` progress where the output is not a terminal (plain lines), and
the status line of an eval (its scored rollouts, not the steps it has none of)."""

from __future__ import annotations

from gyre.run import Progress
from gyre.up import PlainProgress


def test_plain_progress_prints_a_line_per_phase_and_step() -> None:
    p, plain = Progress(steps=2), PlainProgress()
    assert plain.lines(p) == ["starting"]
    p.status = "eval before: 4 held-out tasks"
    assert plain.lines(p) == ["eval before: 4 held-out tasks"]
    p.evals["before"] = {"tasks": 4, "scored": 4, "success": 0.25, "mean_score": 0.5}
    p.step, p.status = 0, "rollouts"
    assert plain.lines(p) == ["held-out eval before: 4/4 scored, success 0.25, mean score 0.5", "step 1/2 started"]
    p.status = "scoring"
    assert plain.lines(p) == []  # within a step: no line
    p.rewards.append(0.5)
    p.weight_version = 1
    assert plain.lines(p) == ["step 1/2 applied: reward 0.500, weights v1"]
    assert plain.lines(p) == []


def test_an_eval_status_line_counts_its_rollouts() -> None:
    p = Progress(steps=1)
    p.evals["eval"] = {"tasks": 8, "scored": 8, "success": 0.5, "mean_score": 0.6}
    p.status = "done"
    row = p.row()
    assert row.startswith("eval: 8/8 scored") and "step" not in row and row.endswith("done")
    assert PlainProgress().lines(p)[0] == "eval: 8/8 scored, success 0.5, mean score 0.6"


def test_the_warm_start_loop_stops_when_told() -> None:
    import pytest
    import torch

    from gyre.warmstart import WarmStartInterrupted, train_sft

    with pytest.raises(WarmStartInterrupted, match="step 0/5"):
        train_sft(torch.nn.Linear(2, 2), [([1, 2], 1)], steps=5, lr=1e-3, seed=0, batch_size=1,
                  log=lambda _: None, should_stop=lambda: True)
