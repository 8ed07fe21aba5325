"""TITO property: across random multi-turn agent runs with tool calls, compactions,
retries, edits and sub-agents, every recorded input is exactly what a cell received,
every reused span is the cell's own earlier ids, and each call gets the right drift
class. Some replies are emitted one token per character, so their text re-encodes to
other ids (retoken drift) and must still be reused as generated."""

from __future__ import annotations

import json
import os
import random

import httpx
import pytest

from .conftest import RUN
from .tito_check import check_exact, engine_view, recorded_calls

SEEDS = [int(s) for s in os.environ.get("GYRE_TITO_SEEDS", "1,2,3").split(",")]
WORDS = ["alpha", "beta", " gamma", "déjà", "vu", "42", "3.14", "naïve", "  spaced", "x\ny", "数据", "🙂", "a+b", "end."]


def scripted_reply(rng: random.Random):
    def reply(_: str):
        roll = rng.random()
        if roll < 0.45:
            args = {"cmd": rng.choice(["ls -la", "pytest -q", "cat a.py"]), "n": rng.randint(0, 99)}
            return f'<tool_call>\n{json.dumps({"name": "bash", "arguments": args})}\n</tool_call>'
        text = "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))
        return (text, rng.random() < 0.3)  # sometimes one token per character
    return reply


class Agent:
    def __init__(self, client: httpx.AsyncClient, base: str, system: str, task: str, agent_id: str | None = None):
        self.client, self.base, self.agent_id = client, base, agent_id
        self.messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        self.sent = 0  # messages the proxy has seen
        self.tools = [{"type": "function", "function": {"name": "bash", "description": "run a command",
                                                        "parameters": {"type": "object",
                                                                       "properties": {"cmd": {"type": "string"}}}}}]

    async def call(self, upto: int | None = None) -> dict:
        self.sent = len(self.messages) if upto is None else upto
        headers = {"Authorization": "Bearer k-secret"}
        if self.agent_id:
            headers["x-claude-code-agent-id"] = self.agent_id
        r = await self.client.post(self.base + "/v1/chat/completions", headers=headers,
                                   json={"model": "m", "messages": self.messages[: self.sent], "tools": self.tools,
                                         "max_tokens": 200})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]

    async def turn(self, rng: random.Random) -> None:
        msg = await self.call()
        self.messages.append({k: v for k, v in msg.items() if k in ("role", "content", "tool_calls")})
        for tc in msg.get("tool_calls") or []:
            self.messages.append({"role": "tool", "tool_call_id": tc["id"], "content": f"out {rng.randint(0, 9)}"})
        if not msg.get("tool_calls"):
            self.messages.append({"role": "user", "content": rng.choice(WORDS) + " continue"})


@pytest.mark.parametrize("seed", SEEDS)
async def test_random_agent_runs_are_recorded_token_exactly(proxy, seed: int) -> None:
    rng = random.Random(seed)
    for e in proxy.engines.values():
        e.default_reply = scripted_reply(rng)
    base = await proxy.rollout(f"ro-{seed}")
    expected_forks = 0
    async with httpx.AsyncClient(timeout=30) as client:
        main = Agent(client, base, "You are the main agent.", "Build the project.")
        for _ in range(14):
            action = rng.choices(["turn", "retry", "compact", "subagent", "edit"], [6, 1, 1, 1, 1])[0]
            if action == "turn":
                await main.turn(rng)
            elif action == "retry" and main.sent:
                await main.call(upto=main.sent)  # the last request again: a new branch at the same point
                expected_forks += 1
            elif action == "compact":
                summary = "Summary: " + " ".join(rng.choice(WORDS) for _ in range(6))
                main.messages = [main.messages[0], {"role": "user", "content": summary}]
                await main.turn(rng)
                expected_forks += 1
            elif action == "subagent":
                sub = Agent(client, base, "You are a sub-agent.", "Look at a.py", agent_id=f"a{rng.randrange(16**6):06x}")
                await sub.turn(rng)
                await sub.turn(rng)
                expected_forks += 1
            else:  # edit the latest user message, then continue from there
                idx = max(i for i, m in enumerate(main.messages) if m["role"] == "user")
                expected_forks += idx < main.sent  # rewriting what the proxy saw branches the tree
                main.messages = main.messages[: idx] + [{"role": "user", "content": "edited " + str(rng.random())}]
                await main.turn(rng)

    recorded = await recorded_calls(proxy.bus, proxy.blobs, RUN)
    check_exact(recorded, engine_view(proxy.engines.values()))
    drifts = [r.event.drift.value for r in recorded.values()]
    assert drifts[0] == "fresh"
    assert drifts.count("fork") >= expected_forks
    reused = [r for r in recorded.values() if r.event.parent_call_id]
    assert reused, "continuing calls must reuse earlier tokens"
    assert any(r.event.prefix_len > len(recorded[r.event.parent_call_id].input_ids) for r in reused), \
        "some call must reuse generated tokens"
    assert set(drifts) <= {"fresh", "append", "think_stripped", "template_drift", "retoken_drift", "fork"}
