"""A synthetic workload with the seeds' shape: long agent rollouts that compact, spawn
sub-agents and retry, recorded the way the proxy records them (TITO references).

The default preset (:data:`PRESETS` ``"default"``) is fixed; the tree benchmark and the
trainer's benchmark both use it (the trainer's at the ``small`` scale: the same preset
with every token size divided by 40, see :meth:`WorkloadPreset.scaled`), so changing it
changes both. Per rollout: 240 main turns plus sub-agent work (about 350 calls), the
main context growing to 240k tokens before it compacts (once per rollout, around turn
200; fork sub-agents that inherit a long history sometimes compact too), summaries of a
few thousand tokens, a sub-agent every 30 turns with its own 12-turn conversation (half
of them "fork" sub-agents that start from the main agent's whole history), and 4 % of
calls retried with the same input after a broken stream (the broken attempt is not
delivered): the shape of a Claude Code agent on a repository-building task. Four
rollouts form a group and share its system prompt, task and sub-agent system prompt.
``services/trajectory/README.md`` gives the numbers it produces.

Token ids: 1/2 open/close a message, 3 = tool-result header, 7 starts the compaction
instruction, 8 starts the post-compaction header, 10-15 are fixed prompt texts; content
tokens are random ids in [16, 65535].
"""

from __future__ import annotations

import hashlib
import random
from array import array
from dataclasses import dataclass, replace

from .records import CallHints, CallRecord, WeightSpan

COMPACTION_INSTRUCTION = (7, 101, 102, 103, 104, 105, 106, 107, 108)
CONTINUATION_HEADER = (8, 201, 202, 203, 204, 205, 206)


@dataclass(frozen=True)
class WorkloadPreset:
    rollouts: int = 4  # one group
    main_turns: int = 240
    system_tokens: int = 6000
    task_tokens: int = 2000
    output_tokens: int = 350  # mean model output per turn (exponential)
    tool_tokens: int = 800  # mean tool output per turn (exponential)
    compact_at: int = 240_000  # context length that triggers compaction
    summary_tokens: int = 2500
    subagent_every: int = 30  # main turns between sub-agent launches
    subagent_turns: int = 12
    subagent_system_tokens: int = 2500
    fork_subagent_share: float = 0.5  # fraction of sub-agents that fork the main history
    retry_prob: float = 0.04  # a call whose stream broke and was sent again
    versions_every: int = 60  # calls between weight version bumps
    fork_directive_tokens: int = 40  # the fork boilerplate + directive after the main history
    subagent_prompt_tokens: int = 200  # the Agent tool's prompt that opens a fresh sub-agent
    subagent_result_tokens: int = 60  # header of the tool result that returns a sub-agent's answer
    seed: int = 0

    def scaled(self, k: float, **overrides) -> "WorkloadPreset":
        """The same shape with every token size divided by ``k`` (turns, probabilities and
        the call structure unchanged): contexts, compaction and fork points keep their
        proportions, so the tree's sharing does too."""
        sizes = {f: max(1, round(getattr(self, f) / k)) for f in _TOKEN_SIZES}
        return replace(self, **{**sizes, **overrides})


_TOKEN_SIZES = ("system_tokens", "task_tokens", "output_tokens", "tool_tokens", "compact_at",
                "summary_tokens", "subagent_system_tokens", "fork_directive_tokens",
                "subagent_prompt_tokens", "subagent_result_tokens")

PRESETS: dict[str, WorkloadPreset] = {
    "default": WorkloadPreset(),
    # The default's shape at 1/40 of its token sizes (same calls per rollout, same
    # compaction and fork points): a 2-core machine trains it in about a minute with a
    # small model, so the trainer's benchmark measures the default's sharing.
    "small": WorkloadPreset().scaled(40, rollouts=2),
    "tiny": WorkloadPreset(rollouts=2, main_turns=8, system_tokens=12, task_tokens=6,
                           output_tokens=5, tool_tokens=6, compact_at=80, summary_tokens=6,
                           subagent_every=4, subagent_turns=2, subagent_system_tokens=8),
}


def preset(name: str = "default", **overrides) -> WorkloadPreset:
    return replace(PRESETS[name], **overrides)


@dataclass
class _Line:
    """One agent line as the harness sees it: its history and the calls it extends.

    ``prefixes`` are the delivered calls whose input + output is a prefix of the current
    history (what the proxy can reference), latest last.
    """

    hints: CallHints
    history: array
    prefixes: list[tuple[str, int]]


class _Rollout:
    def __init__(self, p: WorkloadPreset, index: int) -> None:
        self.p = p
        self.rng = random.Random(f"{p.seed}:{index}")
        self.rollout_id = f"r{index}"
        self.calls: list[CallRecord] = []
        self.continued: set[str] = set()  # calls whose reply some call has continued
        # The rollouts of a group run the same task under the same harness: their system
        # prompts, task and sub-agent system prompt are the group's. Each rollout still
        # draws its own copies first, so its random stream (and so its shape: turns,
        # lengths, forks, retries) is the one it had when the prompts were its own.
        for n in (p.system_tokens, p.task_tokens, p.subagent_system_tokens):
            self._content(n)
        group = random.Random(f"{p.seed}:group")
        self.system = _content(group, p.system_tokens, fixed=10)
        self.task = _content(group, p.task_tokens, fixed=11)
        self.sub_system = _content(group, p.subagent_system_tokens, fixed=12)
        self.tools = _digest("tools-main")

    def _content(self, n: int, fixed: int | None = None) -> array:
        return _content(self.rng, n, fixed)

    def _length(self, mean: int) -> int:
        return max(1, int(self.rng.expovariate(1.0 / mean))) if mean > 1 else 1

    def _version(self) -> int:
        return len(self.calls) // self.p.versions_every

    def _call(self, line: _Line, *, delivered: bool = True, out_tokens: int | None = None) -> array:
        """Record one call of ``line`` on its current history; returns the output."""
        n_out = out_tokens or self._length(self.p.output_tokens)
        output = self._content(n_out)
        version = self._version()
        spans = ()
        if n_out > 4 and self.rng.random() < 0.05:  # weights changed mid-answer
            spans = (WeightSpan(0, n_out // 2, version), WeightSpan(n_out // 2, n_out, version + 1))
        parent, prefix = line.prefixes[-1] if line.prefixes else (None, 0)
        call = CallRecord(
            call_id=f"{self.rollout_id}-c{len(self.calls)}", rollout_id=self.rollout_id,
            new_input_ids=line.history[prefix:], output_ids=output,
            output_logprobs=array("f", [-0.05 - (t % 97) / 40.0 for t in output]),
            parent_call_id=parent, prefix_len=prefix,
            weight_spans=spans, weight_version=version, delivered=delivered,
            drift=self._drift(parent),
            finish_reason="stop" if delivered else "abort", hints=line.hints,
        )
        self.calls.append(call)
        return output

    def _drift(self, parent: str | None) -> str:
        """The proxy's drift class: ``append`` for the first call after a reply (the prefixes
        are reply boundaries), ``fork`` for a second one (a retry, a summary that drops the
        last round, the main agent after a fork sub-agent's first call) and for a call that
        references nothing (``fresh`` when it is the rollout's first)."""
        if parent is None:
            return "fork" if self.calls else "fresh"
        drift = "fork" if parent in self.continued else "append"
        self.continued.add(parent)
        return drift

    def _turn(self, line: _Line) -> array:
        """One model turn, possibly after a broken attempt that is then sent again."""
        if self.rng.random() < self.p.retry_prob:
            self._call(line, delivered=False)
        output = self._call(line)
        line.history.extend(output)
        line.prefixes.append((self.calls[-1].call_id, len(line.history)))
        return output

    def _compact(self, line: _Line, last_output: array, last_tool: array) -> None:
        """Summary call on the history minus the last round, then start over from it."""
        cut = len(line.history) - len(last_output) - len(last_tool)
        summary_input = line.history[:cut]
        summary_input.extend(array("i", COMPACTION_INSTRUCTION))
        usable = [(c, n) for c, n in line.prefixes if n <= cut]
        summary = self._call(
            _Line(line.hints, summary_input, usable), out_tokens=self._length(self.p.summary_tokens)
        )
        main_system = line.hints.system_digest == _digest("system-main")
        fresh = array("i", self.system if main_system else self.sub_system)
        fresh.extend(array("i", CONTINUATION_HEADER))
        fresh.extend(summary)  # the summary comes back as text in a user message
        fresh.extend(last_output)
        fresh.extend(last_tool)
        line.history = fresh
        line.prefixes = []

    def _work(self, line: _Line, turns: int, tool_for=None) -> array:
        output = array("i")
        for turn in range(1, turns + 1):
            output = self._turn(line)
            tool = tool_for(line, turn) if tool_for else None
            if tool is None:
                tool = self._content(self._length(self.p.tool_tokens), fixed=3)
            line.history.extend(tool)
            if len(line.history) > self.p.compact_at:
                self._compact(line, output, tool)
        return output

    def run(self) -> list[CallRecord]:
        hints = CallHints(system_digest=_digest("system-main"), tools_digest=self.tools)
        history = array("i", self.system)
        history.extend(self.task)
        self._work(_Line(hints, history, []), self.p.main_turns, self._maybe_subagent)
        return self.calls

    def _maybe_subagent(self, main: _Line, turn: int) -> array | None:
        if not self.p.subagent_every or turn % self.p.subagent_every:
            return None
        agent_id = "a" + hashlib.sha256(f"{self.rollout_id}:{turn}".encode()).hexdigest()[:16]
        if self.rng.random() < self.p.fork_subagent_share:
            history = array("i", main.history)
            history.extend(self._content(self.p.fork_directive_tokens, fixed=13))  # the fork directive
            sub = _Line(replace(main.hints, agent_id=agent_id), history, list(main.prefixes[-1:]))
        else:
            hints = CallHints(agent_id=agent_id, system_digest=_digest("system-sub"),
                              tools_digest=_digest("tools-sub"))
            history = array("i", self.sub_system)
            history.extend(self._content(self.p.subagent_prompt_tokens, fixed=14))  # the Agent tool's prompt
            sub = _Line(hints, history, [])
        final = self._work(sub, self.p.subagent_turns)
        result = self._content(self.p.subagent_result_tokens, fixed=15)
        result.extend(final)  # the sub-agent's final text comes back as the tool result
        return result


def _content(rng: random.Random, n: int, fixed: int | None = None) -> array:
    n = max(1, int(n))
    body = array("i", array("H", rng.randbytes(2 * n)))
    for j, t in enumerate(body[:8]):
        if t < 16:
            body[j] = t + 16
    if fixed is not None:
        body[0] = fixed
    return body


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def generate(p: WorkloadPreset) -> list[list[CallRecord]]:
    """Calls per rollout, in the order the proxy would record them."""
    return [_Rollout(p, i).run() for i in range(p.rollouts)]
