"""``gyre tree show <rollout>``: a rollout's tree rebuilt from the event log, for a human.

Reads the rollout's ``RolloutStarted`` (harness), its ``CallRecorded`` events (token
arrays from the blob store) and its score, rebuilds and seals the tree exactly as the
service does, and renders it as text, as an SVG image, or as Graphviz DOT.
"""

from __future__ import annotations

from libs.common.bus.port import BlobStore, EventBus
from libs.common.events import (CallRecorded, Context, RolloutScored, RolloutScoringFailed,
                                RolloutStarted, subject_token)

from .codec import decode_ids, decode_logprobs
from .ledger import LedgerConfig, call_from_event
from .render import render_tree
from .rollout_tree import RolloutTree, SealedTree


async def rebuild_rollout(bus: EventBus, blobs: BlobStore, config: LedgerConfig,
                          rollout_id: str) -> tuple[RolloutTree, SealedTree, dict]:
    run, token = config.run_id, subject_token(rollout_id)
    facts: dict = {"rollout_id": rollout_id}
    async for d in bus.read(Context.ROLLOUTS, filter_subject=f"gyre.{run}.rollouts.*.{token}"):
        if isinstance(d.event, RolloutStarted):
            facts.update(harness=d.event.harness, group=d.event.group_id, step=d.event.step)
    async for d in bus.read(Context.SCORES, filter_subject=f"gyre.{run}.scores.*.{token}"):
        if isinstance(d.event, RolloutScored):
            facts.update(score=d.event.score, partial=d.event.partial)
        elif isinstance(d.event, RolloutScoringFailed):
            facts.update(scoring_failed=d.event.reason)
    rollout = RolloutTree(rollout_id, config.tree_config(facts.get("harness", "")))
    async for d in bus.read(Context.CALLS, filter_subject=f"gyre.{run}.calls.CallRecorded.{token}"):
        ev = d.event
        if isinstance(ev, CallRecorded) and ev.rollout_id == rollout_id:
            rollout.add(call_from_event(
                ev, decode_ids(await blobs.get(ev.new_input_digest)),
                decode_ids(await blobs.get(ev.output_digest)),
                decode_logprobs(await blobs.get(ev.logprobs_digest))))
    return rollout, rollout.seal(), facts


async def show_rollout(bus: EventBus, blobs: BlobStore, config: LedgerConfig, rollout_id: str,
                       *, fmt: str = "text", show_tokens: bool = False) -> str:
    rollout, sealed, facts = await rebuild_rollout(bus, blobs, config, rollout_id)
    if fmt == "dot":
        return render_dot(rollout, sealed)
    if fmt == "svg":
        return render_svg(rollout, sealed)
    title = f"{rollout_id} ({facts.get('harness', '?')}, group {facts.get('group', '?')})"
    text = render_tree(rollout.tree, sealed.labels, sealed.selected, title=title,
                       show_tokens=show_tokens, score=facts.get("score"))
    for r in sealed.rejected:
        text += f"\nrejected {r.call_id}: {r.reason}"
    for r in sealed.untrained:
        text += f"\nuntrained {r.call_id}: {r.reason}"
    return text


def render_dot(rollout: RolloutTree, sealed: SealedTree) -> str:
    """Segments as boxes; selected branch ends filled; forks named on the edges."""
    tree = rollout.tree
    chosen = {b.call_index for b in sealed.selected}
    ends = {b.call_index: b for b in sealed.branches}
    lines = ["digraph trajectory {", "  rankdir=LR; node [shape=box, fontsize=10];"]
    for i, (nodes, parent) in enumerate(tree.chains()):
        runs = [tree.node(n) for n in nodes]
        depth, length = runs[0][2], sum(r[1] for r in runs)
        calls = [c for s, ln, _, _ in runs for q in range(s, s + ln) for c in tree.calls_ending_at(q)]
        label = f"[{depth}:{depth + length})\\n{length} tok"
        for c in calls:
            lab = sealed.labels[c]
            if c in ends:
                label += f"\\n{lab.call_id}: {lab.role}"
        style = ', style=filled, fillcolor="#b8e0b8"' if any(c in chosen for c in calls) else ""
        lines.append(f'  s{i} [label="{label}"{style}];')
        forks = [sealed.labels[c].fork for c in calls if sealed.labels[c].fork]
        edge = f' [label="{forks[0]}"]' if forks and parent >= 0 else ""
        lines.append(f"  {'s' + str(parent) if parent >= 0 else 'root'} -> s{i}{edge};")
    lines.append("}")
    return "\n".join(lines)


def render_svg(rollout: RolloutTree, sealed: SealedTree) -> str:
    """The tree as an SVG image (no Graphviz needed): one row per segment in depth-first
    order, indented by tree depth; selected branch ends green, forks named."""
    tree = rollout.tree
    chosen = {b.call_index for b in sealed.selected}
    ends = {b.call_index for b in sealed.branches}
    chains = list(tree.chains())
    level: list[int] = []
    rows = []
    for nodes, parent in chains:
        level.append(level[parent] + 1 if parent >= 0 else 0)
        runs = [tree.node(n) for n in nodes]
        depth, length = runs[0][2], sum(r[1] for r in runs)
        calls = [c for s, ln, _, _ in runs for q in range(s, s + ln) for c in tree.calls_ending_at(q)]
        text = f"[{depth}:{depth + length}) {length} tok"
        fork = next((sealed.labels[c].fork for c in calls if sealed.labels[c].fork), None)
        text += f"  ({fork})" if fork else ""
        text += "".join(f"  {sealed.labels[c].call_id}:{sealed.labels[c].role}" for c in calls if c in ends)
        rows.append((level[-1], parent, text, any(c in chosen for c in calls)))
    h, indent = 22, 24
    width = max((lv * indent + 8 * len(t) + 40 for lv, _, t, _ in rows), default=200)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h * len(rows) + 10}" '
           'font-family="monospace" font-size="12">']
    for i, (lv, parent, text, picked) in enumerate(rows):
        x, y = 10 + lv * indent, 5 + i * h
        if parent >= 0:
            px = 10 + rows[parent][0] * indent + 6
            out.append(f'<path d="M{px},{5 + parent * h + h - 4} V{y + h / 2} H{x}" fill="none" stroke="#888"/>')
        fill = "#b8e0b8" if picked else "#f2f2f2"
        out.append(f'<rect x="{x}" y="{y}" width="{8 * len(text) + 12}" height="{h - 4}" rx="3" '
                   f'fill="{fill}" stroke="#666"/>')
        out.append(f'<text x="{x + 6}" y="{y + h - 10}">{_xml(text)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
