"""What kind of request a harness sent, when its wire shape tells (Claude Code's, as
recorded in shared/notes/claude-code-forks.md). The trajectory service uses this as a
hint; it classifies forks in hindsight too, so ``None`` (can't tell) is always safe.

    >>> from .messages import Msg
    >>> request_kind([Msg("user", "hi")], agent_id="a1b2", has_tools=True)
    'subagent'
    >>> request_kind([Msg("user", "x"), Msg("user", "Your task is to create a detailed summary of the conversation so far")],
    ...              agent_id=None, has_tools=True)
    'compaction_summary'

``post_compaction`` names the request that *replaces* the history with the summary: the
first one whose opening user message carries the continuation text. Every later request
of that conversation starts with the same message (Claude Code keeps it), so a request
whose leading messages up to that one were already sent by an earlier call (``reused``,
from the proxy's history) continues or edits the compacted conversation: it is classed as
any other request (``main``, ``subagent``), and an edit of it is not taken for a second
compaction.

    >>> post = [Msg("user", "This session is being continued from a previous conversation ..."), Msg("user", "go")]
    >>> request_kind(post, agent_id=None, has_tools=True), request_kind(post, agent_id=None, has_tools=True, reused=1)
    ('post_compaction', 'main')
"""

from __future__ import annotations

from .messages import Msg

SUMMARY_MARKERS = (
    "Your task is to create a detailed summary of the conversation so far",
    "summary of the RECENT portion",
    "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.",
)
CONTINUATION_MARKER = "This session is being continued from a previous conversation"
TITLE_MARKER = "Generate a concise, sentence-case title"


def continuation_index(msgs: list[Msg]) -> int | None:
    """Where the compacted history's opening message (the summary) is, if it has one."""
    first_user = next((i for i, m in enumerate(msgs) if m.role == "user"), None)
    if first_user is not None and CONTINUATION_MARKER in msgs[first_user].content:
        return first_user
    return None


def request_kind(msgs: list[Msg], *, agent_id: str | None, has_tools: bool, reused: int = 0) -> str | None:
    """``reused``: how many leading messages of the request an earlier call of the rollout
    already sent (0: none known)."""
    system = " ".join(m.content for m in msgs if m.role == "system")
    if not has_tools and TITLE_MARKER in system:
        return "side"
    last_user = next((m for m in reversed(msgs) if m.role != "system"), None)
    if last_user is not None and last_user.role == "user" and any(k in last_user.content for k in SUMMARY_MARKERS):
        return "compaction_summary"
    at = continuation_index(msgs)
    if at is not None and at >= reused:  # the summary is new here: the history was just replaced
        return "post_compaction"
    if agent_id:
        return "subagent"
    return "main" if has_tools else None
