"""The run report's figures and plots from events (gyre/report.py), without a live run."""

from __future__ import annotations

import json

from gyre.report import RunFacts, figures, write_report
from libs.common.events import (CallRecorded, CellRegistered, ForkDetected, MicroStepQueued, SamplesSelected,
                                SwitchCompleted, TreeSealed)
from libs.common.events.trees import SampleRef

D = "ab" * 32  # a well-formed digest


def _call(rollout: str, call: str, prefix: int, new: int, out: int) -> CallRecorded:
    return CallRecorded(run_id="r", call_id=call, rollout_id=rollout, session_id="s", api="openai_chat",
                        prefix_len=prefix, new_input_digest=D, n_new_input_tokens=new, output_digest=D,
                        logprobs_digest=D, n_output_tokens=out)


def test_tree_statistics_count_flattened_tokens_and_fork_types_and_every_cell_from_its_registration(tmp_path):
    facts = RunFacts("r")
    for ev in [
        CellRegistered(run_id="r", cell="c0", role="inference", is_core=True, capacity=4),
        CellRegistered(run_id="r", cell="c1", role="inference", capacity=4),
        _call("a", "1", 0, 100, 20), _call("a", "2", 120, 30, 10),  # 120 + 160 flattened, a tree of 160
        _call("b", "3", 0, 50, 5),
        TreeSealed(run_id="r", rollout_id="a", tree_digest=D, n_calls=2, n_nodes=2, n_tokens=160),
        TreeSealed(run_id="r", rollout_id="b", tree_digest=D, n_calls=1, n_nodes=1, n_tokens=55),
        ForkDetected(run_id="r", rollout_id="a", call_id="2", fork_type="retry", position=120),
        SwitchCompleted(run_id="r", cell="c0", role="training", weight_version=1),
    ]:
        facts.add(ev)
    fig = figures(facts)
    assert (fig["flattened_tokens"], fig["stored_tokens"]) == (120 + 160 + 55, 160 + 55)
    assert fig["forks"] == {"retry": 1} and fig["role_switches"] == 1
    assert sorted({cell for _, cell, _ in facts.roles}) == ["c0", "c1"]  # c1 never switched, still plotted
    page = write_report(facts, tmp_path)
    assert (tmp_path / "trees.png").exists() and (tmp_path / "cells.png").exists()
    assert json.loads((tmp_path / "report.json").read_text())["flattened_tokens"] == 335
    assert "fork types" in page.read_text()


def test_micro_step_tokens_are_what_the_trainer_lays_out_beside_their_samples_own():
    facts = RunFacts("r")
    a, b = "a" * 64, "b" * 64
    for ev in [
        SamplesSelected(run_id="r", rollout_id="ra", samples=[SampleRef(digest=a, role="main", n_tokens=100,
                                                                        n_trained_tokens=20)]),
        SamplesSelected(run_id="r", rollout_id="rb", samples=[SampleRef(digest=b, role="main", n_tokens=90,
                                                                        n_trained_tokens=10)]),
        # both in one micro-step, their 60-token prompt laid out once
        MicroStepQueued(run_id="r", step=0, micro_step="g-m0", group_id="g", sample_digests=[a, b],
                        advantages=[1.0, -1.0], n_tokens=130),
    ]:
        facts.add(ev)
    fig = figures(facts)
    assert (fig["micro_step_tokens"], fig["micro_step_sample_tokens"]) == (130, 190)
