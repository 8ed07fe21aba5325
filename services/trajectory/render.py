"""A trajectory tree as text for a human (tests, ``gyre tree show``).

Each line is one segment (a run of positions without a fork): its depth range, token
count, how many of them the model generated, the calls that end inside it with their
fork type (and the depth where it parts) and role; ``=>branch`` marks a call whose end is
a branch end, ``*`` a selected branch.
With ``show_tokens`` the ids are printed, generated ones marked with a trailing ``'``::

    r1: 3 calls, 8 stored / 12 flattened tokens, 2 branches (2 selected)
    └── [0:3) 3 tok: 1 2 5
        ├── [3:7) 4 tok, 3 gen: 20' 21' 6 22'  | a main; b main =>branch *
        └── [3:4) 1 tok, 1 gen: 30'  | c edit@3 main =>branch *

Set the environment variable ``GYRE_SHOW_TREES=1`` to have the tests print their trees.
"""

from __future__ import annotations

from .forks import CallLabel
from .sampling import Branch, list_branches
from .tree import TrajectoryTree


def render_tree(
    tree: TrajectoryTree,
    labels: list[CallLabel],
    selected: list[Branch] | None = None,
    *,
    title: str = "",
    show_tokens: bool = False,
    max_tokens: int = 16,
    score: float | None = None,
) -> str:
    chains = list(tree.chains())
    branch_ends = {b.call_index for b in list_branches(tree, labels)}
    chosen = {b.call_index for b in selected or []}
    head = (f"{title or 'tree'}: {len(tree.calls)} calls, {tree.n_stored_tokens} stored / "
            f"{tree.n_flattened_tokens()} flattened tokens, {len(branch_ends)} branches"
            f" ({len(chosen)} selected)")
    if score is not None:
        head += f" | score {score:.3f}"
    lines = [head]
    kids: dict[int, list[int]] = {}
    for i, (_, parent) in enumerate(chains):
        kids.setdefault(parent, []).append(i)

    def emit(i: int, prefix: str, last: bool) -> None:
        nodes, _ = chains[i]
        lines.append(prefix + ("└── " if last else "├── ") + _describe(
            tree, labels, nodes, branch_ends, chosen, show_tokens, max_tokens))
        below = kids.get(i, [])
        for j, ch in enumerate(below):
            emit(ch, prefix + ("    " if last else "│   "), j == len(below) - 1)

    roots = kids.get(-1, [])
    for j, i in enumerate(roots):
        emit(i, "", j == len(roots) - 1)
    return "\n".join(lines)


def _describe(tree, labels, nodes, branch_ends, chosen, show_tokens, max_tokens) -> str:
    _, _, depth, _ = tree.node(nodes[0])
    runs = [(tree.node(n)[0], tree.node(n)[1]) for n in nodes]
    length = sum(ln for _, ln in runs)
    n_gen = sum(sum(tree.generated[s : s + ln]) for s, ln in runs)
    text = f"[{depth}:{depth + length}) {length} tok" + (f", {n_gen} gen" if n_gen else "")
    if show_tokens:
        ids = []
        for s, ln in runs:
            for q in range(s, s + ln):
                ids.append(f"{tree.tokens[q]}{chr(39) if tree.generated[q] else ''}")
        more = len(ids) - max_tokens
        text += ": " + " ".join(ids[:max_tokens]) + (f" ...(+{more})" if more > 0 else "")
    ends = []
    for s, ln in runs:
        for q in range(s, s + ln):
            for c in tree.calls_ending_at(q):
                lab = labels[c]
                fork = f" {lab.fork}@{lab.position}" if lab.fork else ""
                mark = " =>branch" if c in branch_ends else ""
                mark += " *" if c in chosen else ""
                ends.append(f"{lab.call_id}{fork} {lab.role}{mark}"
                            + ("" if tree.calls[c].delivered else " (undelivered)"))
    if ends:
        text += "  | " + "; ".join(ends)
    return text
