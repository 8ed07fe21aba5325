"""What kind of request a harness sent, when its wire shape tells (Claude Code's, as
recorded in shared/notes/claude-code-forks.md). The trajectory service uses this as a
hint; it classifies forks in hindsight too, so ``None`` (can't tell) is always safe.

    >>> from .messages import Msg
    >>> request_kind([Msg("user", "hi")], agent_id="a1b2", has_tools=True)
    'subagent'
    >>> request_kind([Msg("user", "x"), Msg("user", "Your task is to create a detailed summary of the conversation so far")],
    ...              agent_id=None, has_tools=True)
    'compaction_summary'
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


def request_kind(msgs: list[Msg], *, agent_id: str | None, has_tools: bool) -> str | None:
    system = " ".join(m.content for m in msgs if m.role == "system")
    if not has_tools and TITLE_MARKER in system:
        return "side"
    last_user = next((m for m in reversed(msgs) if m.role != "system"), None)
    if last_user is not None and last_user.role == "user" and any(k in last_user.content for k in SUMMARY_MARKERS):
        return "compaction_summary"
    first_user = next((m for m in msgs if m.role == "user"), None)
    if first_user is not None and CONTINUATION_MARKER in first_user.content:
        return "post_compaction"
    if agent_id:
        return "subagent"
    return "main" if has_tools else None
