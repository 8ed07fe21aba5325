"""Names that are not UTF-8 (legal on Linux; the runner's PAX snapshot keeps them) must not
make a rollout unscorable: the outcome that names them is published (escaped), and the
judge's prompt that lists them is sent."""

from __future__ import annotations

import os
from pathlib import Path

from libs.common.events import RolloutScored, decode
from services.evaluator.core.spec import CombinePolicy
from services.runner.adapters.snapshot import snapshot_workspace

from ._fakes import FakeJudge, Reply
from ._workspaces import CALC_OK, calc_spec


def _workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "calc.py").write_text(CALC_OK)
    return ws


async def test_a_link_with_a_non_utf8_target_is_named_escaped_in_a_publishable_outcome(make_harness, tmp_path):
    ws = _workspace(tmp_path)
    os.symlink(b"/opt/venv-\xff/bin/python3", os.path.join(os.fsencode(ws), b"python"))
    h = await make_harness()
    ev = await h.score(calc_spec(), snapshot_workspace(ws))
    assert isinstance(ev, RolloutScored) and ev.score == 1.0, ev
    wire = decode(ev.to_json())  # what the bus publishes, read back
    assert "python -> /opt/venv-\\xff/bin/python3" in wire.reason and wire.score == 1.0


async def test_a_non_utf8_file_name_reaches_the_judge_escaped(make_harness, tmp_path):
    ws = _workspace(tmp_path)
    with open(os.path.join(os.fsencode(ws), b"notes-\xff.txt"), "wb") as f:
        f.write(b"hi")
    with FakeJudge([Reply('{"score": 0.5}')]) as judge:
        h = await make_harness(judge_url=judge.base_url)
        spec = calc_spec("judged-utf8", rubric="ok?",
                         combine=CombinePolicy(mode="weighted", tests_weight=0.5, judge_weight=0.5))
        ev = await h.score(spec, snapshot_workspace(ws))
        assert isinstance(ev, RolloutScored), ev.reason
        assert ev.score == 0.75 and len(judge.requests) == 1
        assert "notes-\\xff.txt" in " ".join(m["content"] for m in judge.requests[0]["messages"])
