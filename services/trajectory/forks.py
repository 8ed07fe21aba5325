"""Fork detection and classification, and the role of every call.

A harness leaves a tree, not a line: it compacts its context (a *summary* call, then a
*continuation* that starts over from the summary), spawns sub-agents (new conversations),
retries (same input, new continuation) and sometimes edits its history. Each call is
compared with the previous call of the same *agent line* (a lineage: the main agent, one
sub-agent, one side conversation), which the harness rules tell apart:

- ``claude_code``: the ``x-claude-code-agent-id`` header (hint ``agent_id``) names a
  sub-agent; calls without it are the main agent's; a call under the main agent whose
  system prompt *and* tools both differ from the main line's is a side request (title
  generation). The main line's system prompt and tools are not simply the first unnamed
  call's (interactive Claude Code sends a tool-less title request first): of the unnamed
  calls' digest pairs it is one with tools, then the one most unnamed calls keep, then
  the first seen. Compaction requests can be recognised by token markers (the tokenised
  compaction instruction) when the adapter supplies them, else in hindsight.
- ``openai_tools``: a generic tool-calling agent: lines are told apart by agent id, else by
  system-prompt digest; the first line seen is the main agent.

In hindsight means: a rewrite of the line's history (not an extension, not a retry) that
is followed by a call which starts over sharing little with it was a compaction summary,
and that next call is its continuation. An explicit ``x-gyre-role`` (hint ``role``) always
wins, and so does the proxy's own classification (hint ``kind``) when it sends one.

The proxy's drift class (``CallRecord.drift``) is read as the proxy defines it
(``services/proxy/core/tito.py``). ``append``, ``template_drift``, ``think_stripped`` and
``retoken_drift`` all
say: the call starts right after its parent call's reply, the first call to do so, and its
input is the parent's whole sequence (the generated ids, whatever the template would
re-render: the drift is the proxy's business, never the agent's) plus new messages. So
such a call continues its parent. The token comparison finds that by itself whenever the
parent is one of its line's recent open ends; when it is not (more conversations
interleave under one line key than the line keeps ends), the comparison would see a
rewrite and report an ``edit`` or a compaction that did not happen. Then, if the parent is
a call of the same line that no earlier call of the line extends (what "the first to
continue it" means in the tree), the call is labelled a continuation of its parent
(``CallLabel.by_drift``). Records that contradict the drift class (the parent already
extended, another line's parent, a shorter prefix) leave the comparison's answer. ``fork``
(a retry, an edit, a compaction, a new conversation, or a second continuation of one
reply, e.g. the main agent after a fork sub-agent's first call) and ``fresh`` add nothing
the token paths do not say: the tree decides which fork, if any, the call makes.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from .records import ROLES, BranchRole, CallRecord, ForkType, line_role, summary_role
from .tree import TrajectoryTree

Relation = Literal["first", "extend", "retry", "rewrite"]

# Drift classes of a call that continues right after its parent's reply, the first to do so
# (libs/common/events/calls.py DriftClass; the proxy reuses the generated ids in all four).
CONTINUES_PARENT: frozenset[str] = frozenset({"append", "template_drift", "think_stripped", "retoken_drift"})


@dataclass(frozen=True)
class HarnessRules:
    """How to read one harness's calls. Presets: :data:`HARNESS_RULES`."""

    name: str
    lineage_hints: tuple[str, ...] = ("agent_id",)  # hint fields naming an agent line
    main_line: Literal["unnamed", "first_seen"] = "unnamed"
    side_when_system_and_tools_change: bool = False
    summary_markers: tuple[tuple[int, ...], ...] = ()
    continuation_markers: tuple[tuple[int, ...], ...] = ()
    infer_summaries: bool = True
    continuation_max_shared: float = 0.5  # a continuation shares < this of the summary's input

    def with_markers(
        self, summary: Sequence[Sequence[int]] = (), continuation: Sequence[Sequence[int]] = ()
    ) -> HarnessRules:
        return replace(
            self,
            summary_markers=tuple(tuple(m) for m in summary if m),
            continuation_markers=tuple(tuple(m) for m in continuation if m),
        )


HARNESS_RULES: dict[str, HarnessRules] = {
    "claude_code": HarnessRules("claude_code", ("agent_id",), "unnamed", True),
    "openai_tools": HarnessRules("openai_tools", ("agent_id", "system_digest"), "first_seen", False),
}
HARNESS_RULES["generic"] = HARNESS_RULES["openai_tools"]
# Gyre's reference harness (`gyre agent`) shapes its sub-agents and compactions as Claude Code does.
HARNESS_RULES["gyre_agent"] = HarnessRules("gyre_agent", ("agent_id",), "unnamed", True)


def _with_plugins() -> None:
    """Fork rules installed as ``gyre.fork_rules`` plugins (built-ins keep their names)."""
    from libs.common.plugins import merged

    for name, rules in merged(dict(HARNESS_RULES), "gyre.fork_rules").items():
        if name not in HARNESS_RULES and isinstance(rules, HarnessRules):
            HARNESS_RULES[name] = rules


_with_plugins()

# Texts a Claude Code compaction carries (claude-code-forks.md); the adapter tokenises them.
CLAUDE_CODE_SUMMARY_TEXTS = (
    "Your task is to create a detailed summary of the conversation so far",
    "Respond with TEXT ONLY. Do NOT call any tools.",
)
CLAUDE_CODE_CONTINUATION_TEXTS = (
    "This session is being continued from a previous conversation that ran out of context.",
)


def markers_from_texts(encode, texts: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Token markers from texts. The first and last token are dropped: at a text's edges
    BPE merges with its neighbours, inside it the tokens are stable."""
    out = []
    for text in texts:
        ids = list(encode(text))
        if len(ids) > 4:
            out.append(tuple(ids[1:-1]))
    return tuple(out)


@dataclass(frozen=True)
class CallLabel:
    """What one call is: its line, role, and the fork it makes (if any)."""

    call_index: int
    call_id: str
    lineage: str
    role: BranchRole
    relation: Relation
    fork: ForkType | None = None
    position: int = 0  # token depth where it parts from ``forked_from``
    forked_from: int | None = None  # call index
    previous: int | None = None  # the call of its line it was compared with
    by_drift: bool = False  # relation taken from the proxy's drift class (it continues its parent)


@dataclass
class _Line:
    key: str
    role: BranchRole
    calls: list[int]
    system_digest: str | None = None
    tools_digest: str | None = None
    ends: list[int] = field(default_factory=list)  # recent calls no later call extends
    extended: set[int] = field(default_factory=set)  # calls a later call of the line extends


def classify_calls(tree: TrajectoryTree, rules: HarnessRules) -> list[CallLabel]:
    """Label every call of the tree, in arrival order."""
    lines: dict[str, _Line] = {}
    line_of: list[_Line] = []
    prev_of: list[int | None] = []
    relation: list[tuple[Relation, int]] = []  # (relation to previous call of line, shared)
    by_drift: set[int] = set()
    main_seed = _main_seed(tree.calls, rules)
    for c, call in enumerate(tree.calls):
        line = _line_for(call, rules, lines, main_seed)
        prev, rel = _previous(tree, c, line)
        if rel[0] == "rewrite":
            parent = _continued_parent(tree, c, line, line_of)
            if parent is not None:  # an end of its line that c continues, gone from line.ends
                prev, rel = parent, ("extend", tree.call_length(parent))
                by_drift.add(c)
        if rel[0] == "extend" and prev is not None:
            line.extended.add(prev)
        relation.append(rel)
        line.calls.append(c)
        line_of.append(line)
        prev_of.append(prev)
    summaries = _find_summaries(tree, rules, lines, relation)
    return [
        _label(tree, rules, c, line_of[c], prev_of[c], relation[c], summaries, c in by_drift)
        for c in range(len(tree.calls))
    ]


def _line_key(call: CallRecord, rules: HarnessRules) -> str:
    hints = call.hints
    key = next((getattr(hints, f) for f in rules.lineage_hints if getattr(hints, f)), None)
    if hints.kind == "side":
        return f"side:{hints.system_digest or call.call_id}"
    return "main" if key is None else key


Digests = tuple[str, str | None]  # (system digest, tools digest)


def _main_seed(calls: Sequence[CallRecord], rules: HarnessRules) -> Digests | None:
    """The system and tools digests of the main line, when side requests are told apart by
    them (``side_when_system_and_tools_change``), chosen over all the unnamed calls rather
    than taken from the first one: interactive Claude Code sends a title request (its own
    system prompt, no tools) before the first main request. Of the digest pairs the
    unnamed calls carry, the main line's is the one with tools, then the one the most
    unnamed calls are not side requests of, then the first to arrive. Depends only on the
    calls and their order, so a replay gives the same pair. None: the first call decides."""
    if rules.main_line != "unnamed" or not rules.side_when_system_and_tools_change:
        return None
    unnamed = [c.hints for c in calls if _line_key(c, rules) == "main"]
    pairs: dict[Digests, int] = {}  # pair -> first arrival
    n_sys: dict[str, int] = {}
    n_tools: dict[str | None, int] = {}  # calls with a system digest, by tools digest
    n_pair: dict[Digests, int] = {}
    no_sys = 0
    for h in unnamed:
        if h.system_digest is None:
            no_sys += 1  # never a side request (_is_side)
            continue
        pair = (h.system_digest, h.tools_digest)
        pairs.setdefault(pair, len(pairs))
        n_sys[h.system_digest] = n_sys.get(h.system_digest, 0) + 1
        n_tools[h.tools_digest] = n_tools.get(h.tools_digest, 0) + 1
        n_pair[pair] = n_pair.get(pair, 0) + 1
    if not pairs:
        return None

    def rank(pair: Digests) -> tuple[bool, int, int]:
        # unnamed calls that are not side requests of `pair`: same system or same tools
        kept = no_sys + n_sys[pair[0]] + n_tools[pair[1]] - n_pair[pair]
        return pair[1] is not None, kept, -pairs[pair]

    return max(pairs, key=rank)


def _line_for(call: CallRecord, rules: HarnessRules, lines: dict[str, _Line],
              main_seed: Digests | None = None) -> _Line:
    hints = call.hints
    key = _line_key(call, rules)
    main_key = "main" if rules.main_line == "unnamed" else next(
        (k for k, ln in lines.items() if ln.role == "main"), key
    )
    line = lines.get(key)
    if rules.side_when_system_and_tools_change:
        ref = ((line.system_digest, line.tools_digest) if line is not None
               else main_seed if key == "main" else None)
        if ref is not None and _is_side(ref, call):
            key = f"side:{hints.system_digest}:{hints.tools_digest}"
            line = lines.get(key)
    if line is None:
        explicit = hints.role if hints.role in ROLES else None
        if explicit is not None:
            role = line_role(explicit)
        elif key == main_key and not key.startswith("side:"):
            role = "main"
        else:
            role = "subagent"
        system, tools = main_seed if key == "main" and main_seed is not None else (
            hints.system_digest, hints.tools_digest)
        line = _Line(key, role, [], system, tools)
        lines[key] = line
    return line


def _is_side(ref: tuple[str | None, str | None], call: CallRecord) -> bool:
    """Whether ``call`` is a side request of a line with the digests ``ref``: its system
    prompt and its tools both differ (tools absent counts as differing from tools)."""
    h = call.hints
    if ref[0] is None or h.system_digest is None:
        return False
    return h.system_digest != ref[0] and h.tools_digest != ref[1]


_RECENT_ENDS = 8  # how many open ends of a line a call may continue


def _previous(tree: TrajectoryTree, c: int, line: _Line) -> tuple[int | None, tuple[Relation, int]]:
    """The call c is compared with: the recent end of its line that it extends (calls
    of one line can interleave, e.g. a side conversation the harness does not name),
    else the line's latest call."""
    for end in reversed(line.ends):
        shared = tree.common_prefix_len(c, end)
        if shared >= tree.call_length(end):
            line.ends.remove(end)
            line.ends.append(c)
            return end, ("extend", shared)
    prev = line.calls[-1] if line.calls else None
    line.ends = (line.ends + [c])[-_RECENT_ENDS:]
    return prev, _relation(tree, c, prev)


def _continued_parent(tree: TrajectoryTree, c: int, line: _Line, line_of: list[_Line]) -> int | None:
    """The call c continues by the proxy's word: its parent, when its drift class says it
    starts right after the parent's reply and the records agree (the parent is a call of
    c's line that no earlier call of the line extends, and c's input holds its whole
    sequence). Else None: the tree's comparison stands."""
    call = tree.calls[c]
    if call.drift not in CONTINUES_PARENT or call.parent_call_id is None:
        return None
    parent = tree.index.get(call.parent_call_id)
    if parent is None or parent >= c or line_of[parent] is not line or parent in line.extended:
        return None
    return parent if call.prefix_len == tree.call_length(parent) else None


def _relation(tree: TrajectoryTree, c: int, prev: int | None) -> tuple[Relation, int]:
    if prev is None:
        return "first", tree.placements[c].graft_depth
    shared = tree.common_prefix_len(c, prev)
    if shared >= tree.call_length(prev):
        return "extend", shared
    n_in = tree.call_input_length(prev)
    if shared >= n_in and tree.call_input_length(c) == n_in:
        return "retry", shared
    return "rewrite", shared


def _find_summaries(tree, rules, lines, relation) -> set[int]:
    """Calls that are compaction summaries: by hint, by marker, or in hindsight."""
    found = set()
    for c, call in enumerate(tree.calls):
        role = call.hints.role
        if call.hints.kind == "compaction_summary" or (role in ROLES and role.endswith("summary")):
            found.add(c)
        elif rules.summary_markers and _has_marker(call.new_input_ids, rules.summary_markers):
            found.add(c)
    if rules.infer_summaries:
        for line in lines.values():
            found |= _summaries_in_hindsight(tree, rules, line.calls, relation)
    return found


def _summaries_in_hindsight(tree, rules, calls: list[int], relation) -> set[int]:
    """A rewrite (and its retries) followed by a call that starts over was a summary."""
    found = set()
    for i, c in enumerate(calls):
        if relation[c][0] != "rewrite":
            continue
        j = i + 1
        while j < len(calls) and relation[calls[j]][0] == "retry":
            j += 1
        if j == len(calls) or relation[calls[j]][0] != "rewrite":
            continue
        if relation[calls[j]][1] < rules.continuation_max_shared * tree.call_input_length(calls[j - 1]):
            found.update(calls[i:j])
    return found


def _label(tree, rules, c, line: _Line, prev: int | None, rel, summaries: set[int],
           by_drift: bool = False) -> CallLabel:
    call = tree.calls[c]
    kind, shared = rel
    role: BranchRole = summary_role(line.role) if c in summaries else line.role
    if call.hints.role in ROLES:
        role = call.hints.role  # x-gyre-role wins
    fork: ForkType | None = None
    forked_from = prev
    if kind == "first":
        # A new non-main line is a new conversation spawned from the main agent's work:
        # it parts from whatever it shares a prefix with (a fork sub-agent: the whole
        # history it was spawned from; a fresh one: the chat template's first tokens).
        forked_from = tree.placements[c].sibling_call
        if forked_from is None and call.parent_call_id is not None:
            forked_from = tree.index.get(call.parent_call_id)
        if line.role != "main":
            fork = "subagent"
    elif kind == "retry":
        fork = "retry"
    elif kind == "rewrite":
        continues = (
            call.hints.kind == "post_compaction"
            or (prev is not None and prev in summaries)
            # the markers only when the proxy did not classify the request: the proxy says
            # post_compaction only where the summary comes in, so a later edit of the
            # compacted history (whose new tokens hold the summary's text again) is an edit
            or (call.hints.kind is None and rules.continuation_markers
                and _has_marker(call.new_input_ids, rules.continuation_markers))
        )
        fork = "compaction" if c in summaries or continues else "edit"
    if fork is None:
        return CallLabel(c, call.call_id, line.key, role, kind, previous=prev, by_drift=by_drift)
    return CallLabel(c, call.call_id, line.key, role, kind, fork, shared, forked_from, prev, by_drift)


def _has_marker(tokens: Sequence[int], markers: Sequence[Sequence[int]]) -> bool:
    hay = array("i", tokens).tobytes()
    for marker in markers:
        needle = array("i", marker).tobytes()
        at = hay.find(needle)
        while at != -1 and at % 4:
            at = hay.find(needle, at + 1)
        if at != -1:
            return True
    return False
