"""The reference harness as a real process, run by the runner, through the real proxy
(in-process, real tokenizer and chat template) in front of a scripted cell: one rollout
deterministically writes a file, sends an unparseable tool call (retried), spawns a
sub-agent, passes its token budget (compaction) and finishes. The tree the trajectory
core builds from the recorded events has every fork type; the snapshot has the work."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from libs.common.blobs import decode_logprobs, decode_tokens
from libs.common.events import CallRecorded, Context, RolloutFinished, RolloutStarted
from services.runner.harness import gyre_agent
from services.runner.runner import RolloutRunner, RunnerConfig
from services.runner.tasks import Task
from services.trajectory.forks import HARNESS_RULES
from services.trajectory.ledger import call_from_event
from services.trajectory.rollout_tree import RolloutTree, TreeConfig

BUDGET = 1200  # tokens: under the first call, over the call after README.md was read


def tool(name: str, **args) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


SCRIPT = [
    tool("read_file", path="README.md"),                                             # main 1
    '<tool_call>\n{"name": "write_file", "arguments": {"path": oops\n</tool_call>',  # main 2: unparseable
    tool("Agent", description="write the module", prompt="Write mathx.py with add(a, b)."),  # main 2, retried
    tool("write_file", path="mathx.py", content="def add(a, b):\n    return a + b\n"),  # sub-agent 1
    "Wrote mathx.py.",                                                                # sub-agent 2 (report)
    "<analysis>ok</analysis><summary>Read README.md; a sub-agent wrote mathx.py.</summary>",  # compaction
    tool("run", command="python -c 'import mathx; print(mathx.add(2, 3))'"),          # main 3 (continued)
    "Done: mathx.add works.",                                                         # main 4: final
]


async def recorded_tree(stack, rollout_id: str, rules: str):
    tree = RolloutTree(rollout_id, TreeConfig(rules=HARNESS_RULES[rules]))
    async for d in stack.bus.read(Context.CALLS):
        ev = d.event
        if isinstance(ev, CallRecorded) and ev.rollout_id == rollout_id:
            blobs = [decode_tokens(await stack.blobs.get(ev.new_input_digest)),
                     decode_tokens(await stack.blobs.get(ev.output_digest)),
                     decode_logprobs(await stack.blobs.get(ev.logprobs_digest))]
            assert tree.add(call_from_event(ev, *blobs)).outcome == "applied"
    return tree.seal()


@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_reference_harness_leaves_a_tree_with_every_fork_type(stack, tmp_path, api) -> None:
    start = tmp_path / "start"
    start.mkdir()
    (start / "README.md").write_text("# mathx\n\n" + "The module adds numbers together. " * 120)
    stack.engine.replies = list(SCRIPT)
    harness = gyre_agent(api, "--context-budget", str(BUDGET), "--temperature", "0")
    runner = RolloutRunner(RunnerConfig(stack.run_id, stack.url, tmp_path / "work", harness=harness),
                           bus=stack.bus, blobs=stack.blobs)
    [out] = await runner.run_step(1, [Task("mathx", "Write mathx.py.\n", time_limit_s=60, files_dir=start)], 1)
    stats = json.loads(out.log_tail.strip().splitlines()[-1])
    assert out.status == "finished" and out.exit_status == 0, out.log_tail
    assert stats["final"] == "Done: mathx.add works." and stats["stop"] == "done"
    assert (stats["calls"], stats["retries"], stats["subagents"], stats["compactions"]) == (8, 1, 1, 1), stats
    assert not stack.engine.replies  # the whole script was used, in order
    lengths = [len(r) for r in stack.engine.received]
    assert lengths[0] < BUDGET < lengths[2], lengths  # the budget sits where the script expects it

    snapshot = await stack.blobs.get(out.snapshot_digest)
    with tarfile.open(fileobj=io.BytesIO(snapshot), mode="r:*") as tar:
        assert tar.extractfile("mathx.py").read() == b"def add(a, b):\n    return a + b\n"
    kinds = [type(d.event) async for d in stack.bus.read(Context.ROLLOUTS)]
    assert kinds == [RolloutStarted, RolloutFinished]

    for rules in ("claude_code", "openai_tools"):
        sealed = await recorded_tree(stack, out.rollout_id, rules)
        assert len(sealed.labels) == 8 and not sealed.rejected
        forks = [lab.fork for lab in sealed.labels if lab.fork]
        assert sorted(set(forks)) == ["compaction", "retry", "subagent"], (rules, forks)
        roles = [lab.role for lab in sealed.labels]
        assert roles == ["main", "main", "main", "subagent", "subagent", "main_summary", "main", "main"], roles
        assert [lab.fork for lab in sealed.labels][2:7] == ["retry", "subagent", None, "compaction", "compaction"]
