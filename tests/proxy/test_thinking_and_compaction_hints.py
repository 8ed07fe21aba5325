"""Two labels the proxy puts on a call.

Drift after a thinking reply: Qwen3's chat template leaves the ``<think>...</think>`` block
out of earlier assistant turns (and the reasoning never comes back in the messages), so
the next call's reply check sees other text than the model wrote. When that block is the
only difference, the class is ``think_stripped``, not a template drift; any other
difference is still ``template_drift``.

``post_compaction``: only the request that replaces the history with the summary, not
every later request of the compacted conversation (they all start with the summary), so
a later edit of that history is not taken for a second compaction.
"""

from __future__ import annotations

import json

import httpx
import pytest

from libs.common.blobs import MemoryBlobStore
from libs.common.bus.memory import InMemoryBus
from libs.common.events import CallRecorded, Context, RolloutStarted, SessionOpened
from libs.common.events.calls import DriftClass
from services.proxy.app import create_app
from services.proxy.core.hints import CONTINUATION_MARKER, request_kind
from services.proxy.core.messages import Msg, ToolCall, ToolSpec, tools_key
from services.proxy.core.routing import Router
from services.proxy.core.tito import Tito, without_thinking
from services.proxy.core.toolparse import parse_output
from services.proxy.history import key_digest
from services.proxy.service import ProxyConfig, ProxyService

from .test_review_fixes import FakeCell
from .test_tito_templates import TEMPLATES, with_template

TOOLS = [ToolSpec("bash", "run a command", {"type": "object", "properties": {"cmd": {"type": "string"}}})]
KEY = tools_key(TOOLS)
THINK = "<think>\nI should list the files first.\n</think>\n\n"


def call_json(args: str = '{"cmd": "ls"}') -> str:
    return '<tool_call>\n{"name": "bash", "arguments": ' + args + "}\n</tool_call>"


@pytest.fixture(params=["tiny-qwen", "think-when-last"])
def r(request, renderer):
    """The tiny Qwen's own template, and one that gives a last assistant turn an empty
    think block as Qwen3's does."""
    return renderer if request.param == "tiny-qwen" else with_template(renderer, TEMPLATES["both"]).inner


def second_call_drift(r, reply_text: str) -> object:
    """Record a first call whose model output is ``reply_text``; the class of the call that
    sends it back (as the API showed it) with the next message."""
    tito = Tito(r, stop_texts=r.stop_texts)
    msgs = [Msg("system", "You are an agent."), Msg("user", "What is here?")]
    plan = tito.plan(msgs, TOOLS, KEY)
    out = r.tokenizer.encode(reply_text, add_special_tokens=False) + [r.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    reply = parse_output(r.decode(out), r.stop_texts).as_msg()
    tito.record("c0", plan, out, reply, TOOLS, KEY, True)
    calls = tuple(ToolCall(f"t{k}", c.name, c.arguments) for k, c in enumerate(reply.tool_calls))
    nxt = msgs + [Msg("assistant", reply.content, calls, reasoning=reply.reasoning)]
    nxt += [Msg("tool", "a.txt b.txt", tool_call_id=c.id, name=c.name) for c in calls] or [Msg("user", "Thanks.")]
    plan2 = tito.plan(nxt, TOOLS, KEY)
    assert plan2.parent_call_id == "c0" and plan2.prefix_len == plan.input_len + len(out)  # the model's own ids
    return plan2.drift


CLEAN = ["Two files.", "Listing.\n" + call_json()]  # replies both templates re-render as written


@pytest.mark.parametrize("reply", CLEAN)
def test_a_reply_whose_only_change_is_the_dropped_thinking_is_think_stripped(r, reply) -> None:
    assert second_call_drift(r, reply) is DriftClass.APPEND  # without thinking: clean
    assert second_call_drift(r, THINK + reply) is DriftClass.THINK_STRIPPED
    assert second_call_drift(r, "<think>\nx\n</think>" + reply) is DriftClass.THINK_STRIPPED


def test_a_reply_with_thinking_and_another_change_is_template_drift(r) -> None:
    # the template writes the arguments' JSON with spaces: a real drift, thinking or not
    drifted = "Listing.\n" + call_json('{"cmd":"ls"}')
    assert second_call_drift(r, drifted) is DriftClass.TEMPLATE_DRIFT
    assert second_call_drift(r, THINK + drifted) is DriftClass.TEMPLATE_DRIFT
    # thinking the model never closed (cut off): no block the template strips, other text
    assert second_call_drift(r, "<think>\nstill thinking ") is DriftClass.TEMPLATE_DRIFT


def test_without_thinking_cuts_the_block_wherever_it_opens() -> None:
    gp = "<|im_start|>assistant\n"
    assert without_thinking(gp + "<think>\nplan\n</think>\n\nSure.<|im_end|>", "\n") == (
        gp + "Sure.<|im_end|>\n",)
    # a generation prompt that opens the block itself (QwQ, Qwen3 thinking models)
    assert without_thinking(gp + "<think>\n" + "plan\n</think>\n\nSure.<|im_end|>", "\n") == (gp + "Sure.<|im_end|>\n",)
    # only the newlines after the block go with it (Qwen3's lstrip('\\n'), the parser's): other
    # whitespace stays, so a template that trims it is a template drift, thinking or not
    assert without_thinking(gp + "<think>\nplan\n</think>\n\n Sure.<|im_end|>", "\n") == (gp + " Sure.<|im_end|>\n",)
    assert without_thinking(gp + "no thinking here", "\n") == ()
    assert without_thinking(gp + "<think>\nunfinished", "\n") == ()


# -- through the proxy ------------------------------------------------------------------------------------


async def make(renderer, replies: list[str]):
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    router = Router()
    router.add_cell("a", 4)
    svc = ProxyService(ProxyConfig(run_id="hints"), bus=bus, blobs=blobs, renderer=renderer, router=router,
                       clients={"a": FakeCell(renderer.tokenizer, replies)})
    await bus.publish(RolloutStarted(run_id="hints", rollout_id="r1", task_id="t", group_id="g", harness="x",
                                     weight_version=0, api_key_digest=key_digest("k")))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(svc, admin_token=None)),
                               base_url="http://t/r/r1", headers={"authorization": "Bearer k"})
    return svc, bus, client


async def events(bus, kind) -> list:
    return [d.event async for d in bus.read(Context.CALLS, start_seq=1) if isinstance(d.event, kind)]


OAI_TOOLS = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.parameters}} for t in TOOLS]


async def test_a_thinking_reply_sent_back_is_recorded_as_think_stripped(renderer) -> None:
    svc, bus, c = await make(renderer, [THINK + "Two files.", "Good."])
    msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "What is here?"}]
    r1 = await c.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "tools": OAI_TOOLS})
    assert r1.status_code == 200, r1.text
    answer = r1.json()["choices"][0]["message"]
    assert answer["content"] == "Two files."
    msgs += [{"role": "assistant", "content": answer["content"]}, {"role": "user", "content": "Thanks."}]
    r2 = await c.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "tools": OAI_TOOLS})
    assert r2.status_code == 200, r2.text
    await svc.drain_background()
    first, second = await events(bus, CallRecorded)
    assert second.parent_call_id == first.call_id and second.prefix_len > 0
    assert (first.drift, second.drift) == (DriftClass.FRESH, DriftClass.THINK_STRIPPED)
    svc.close()


SUMMARY_ASK = "Your task is to create a detailed summary of the conversation so far, paying close attention ..."


def continued(summary: str) -> dict:
    return {"role": "user", "content": f"{CONTINUATION_MARKER} that ran out of context. The summary below covers the "
                                       f"earlier portion of the conversation.\n\nSummary:\n{summary}\n\n"
                                       "Continue the conversation from where it left off."}


async def test_post_compaction_marks_the_compaction_not_later_edits_of_the_compacted_history(renderer) -> None:
    replies = ["Looked around.", "The summary.", "Carrying on.", "Next step.", "Redone.", "Edited again.",
               "Second summary.", "Fresh start."]
    svc, bus, c = await make(renderer, replies)
    system = {"role": "system", "content": "You are an agent."}
    task = {"role": "user", "content": "Fix the bug."}

    async def send(messages: list[dict]) -> str:
        r = await c.post("/v1/chat/completions", json={"model": "m", "messages": messages, "tools": OAI_TOOLS})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    a = await send([system, task])
    await send([system, task, {"role": "assistant", "content": a}, {"role": "user", "content": SUMMARY_ASK}])
    # the compaction: the summary replaces the history; the last turn is kept verbatim after it
    compacted = [system, continued("They looked around."), {"role": "assistant", "content": a},
                 {"role": "user", "content": "Go on."}]
    b = await send(compacted)
    then = compacted + [{"role": "assistant", "content": b}, {"role": "user", "content": "And then?"}]
    await send(then)  # continues the compacted conversation
    # edits of the compacted history: the kept turn rewritten (no earlier call's boundary
    # covers the summary alone, so TITO matches nothing), then a later message
    await send(compacted[:3] + [{"role": "user", "content": "Go on, differently."}])
    await send(then[:-1] + [{"role": "user", "content": "And then, differently?"}])
    # a second, real compaction
    await send([system, continued("Two rounds of work."), {"role": "user", "content": "Go on."}])
    await send([system, task])  # a new conversation that is no compaction
    await svc.drain_background()
    kinds = [e.hints.kind for e in await events(bus, CallRecorded)]
    assert kinds == ["main", "compaction_summary", "post_compaction", "main", "main", "main", "post_compaction",
                     "main"]
    opened = [e.hints.kind for e in await events(bus, SessionOpened)]
    assert opened.count("post_compaction") == 2 and "compaction_summary" not in opened
    svc.close()


def test_request_kind_post_compaction_only_when_the_summary_is_new() -> None:
    msgs = [Msg("system", "s"), Msg("user", f"{CONTINUATION_MARKER} ..."), Msg("assistant", "a"), Msg("user", "b")]
    assert request_kind(msgs, agent_id=None, has_tools=True) == "post_compaction"
    assert request_kind(msgs, agent_id=None, has_tools=True, reused=1) == "post_compaction"  # the system only
    assert request_kind(msgs, agent_id=None, has_tools=True, reused=2) == "main"
    assert request_kind(msgs, agent_id="a1", has_tools=True, reused=4) == "subagent"
    assert json.dumps(request_kind([Msg("user", "x")], agent_id=None, has_tools=False)) == "null"
