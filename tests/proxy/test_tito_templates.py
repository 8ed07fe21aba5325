"""TITO with chat templates that are not prefix-stable message by message.

Two behaviours of real templates (Qwen2.5 / Qwen3), reproduced by small templates written
here: a last assistant message rendered with an empty think block only when it is last,
and a run of tool results rendered as one block whose end comes only after the run's
last result. With either, each call must still continue its parent's exact ids, and a
plan after many parallel-tool turns must stay cheap (renders are counted, not timed)."""

from __future__ import annotations

import copy
import json

import pytest

from services.proxy.adapters.template import HFRenderer
from services.proxy.core.messages import Msg, ToolCall, ToolSpec, tools_key
from services.proxy.core.tito import Tito
from services.proxy.core.toolparse import parse_output

_EMPTY_THINK_WHEN_LAST = "{% if loop.last %}<think>\n\n</think>\n\n{% endif %}"
_OWN_BLOCK = ("<|im_start|>user\n", "<|im_end|>\n")
_RUN_BLOCK = ("{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}\n",
              "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}")


def template(*, think_when_last: bool, run_block: bool) -> str:
    """ChatML with Hermes-style tool calls; optionally the two behaviours under test.
    (HF renders with ``trim_blocks``: a newline right after a block tag is dropped.)"""
    open_, close = _RUN_BLOCK if run_block else _OWN_BLOCK
    return (
        "{% for m in messages %}"
        "{% if m.role == 'tool' %}" + open_ + "<tool_response>\n{{ m.content }}\n</tool_response>" + close +
        "{% elif m.role == 'assistant' %}<|im_start|>assistant\n"
        + (_EMPTY_THINK_WHEN_LAST if think_when_last else "") +
        "{{ m.content }}{% for c in m.tool_calls | default([]) %}"
        "{% if m.content or not loop.first %}{{ '\\n' }}{% endif %}"
        "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}"
        "\n</tool_call>{% endfor %}<|im_end|>\n"
        "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


TEMPLATES = {
    "think-when-last": template(think_when_last=True, run_block=False),
    "tool-run-block": template(think_when_last=False, run_block=True),
    "both": template(think_when_last=True, run_block=True),
}
TOOLS = [ToolSpec("bash", "run a command", {"type": "object", "properties": {"cmd": {"type": "string"}}})]
KEY = tools_key(TOOLS)


class Counting:
    """A Renderer that counts its renders."""

    def __init__(self, inner: HFRenderer) -> None:
        self.inner = inner
        self.renders = 0
        self.stop_texts = inner.stop_texts

    def render(self, msgs, tools, *, add_generation_prompt: bool) -> str:
        self.renders += 1
        return self.inner.render(msgs, tools, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def decode(self, ids) -> str:
        return self.inner.decode(ids)


def with_template(renderer: HFRenderer, chat_template: str) -> Counting:
    """The session's renderer (tokenizer loaded once) with another chat template."""
    r = copy.copy(renderer)
    r.tokenizer = copy.copy(renderer.tokenizer)
    r.tokenizer.chat_template = chat_template
    return Counting(r)


@pytest.fixture(params=sorted(TEMPLATES))
def templated(request, renderer) -> Counting:
    return with_template(renderer, TEMPLATES[request.param])


def tool_call(n: int) -> str:
    return "<tool_call>\n" + json.dumps({"name": "bash", "arguments": {"cmd": f"cat f{n}"}}) + "\n</tool_call>"


class Run:
    """An agent loop driven straight through Tito: plan, generate (scripted), record."""

    def __init__(self, r: Counting) -> None:
        self.r = r
        self.tito = Tito(r, stop_texts=r.stop_texts)
        self.end = r.inner.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.msgs = [Msg("system", "You are an agent."), Msg("user", "Read the files.")]
        self.sent: dict[str, tuple[list[int], list[int]]] = {}  # call id -> (input ids, output ids)
        self.requests: dict[str, list[Msg]] = {}  # call id -> the messages it was sent
        self.plans = []

    def call(self, reply_text: str) -> None:
        plan = self.tito.plan(self.msgs, TOOLS, KEY)
        input_ids = self.tito.input_ids(plan)
        call_id = f"c{len(self.sent)}"
        out = self.r.inner.tokenizer.encode(reply_text, add_special_tokens=False) + [self.end]
        reply = parse_output(self.r.decode(out), self.r.stop_texts).as_msg()
        self.tito.record(call_id, plan, out, reply, TOOLS, KEY, True)
        self.sent[call_id] = (input_ids, out)
        self.requests[call_id] = self.msgs
        self.plans.append(plan)
        calls = tuple(ToolCall(f"{call_id}-{k}", c.name, c.arguments) for k, c in enumerate(reply.tool_calls))
        self.msgs = self.msgs + [Msg("assistant", reply.content, calls)]
        for c in calls:
            self.msgs.append(Msg("tool", f"contents of {c.arguments['cmd']}\n" * 3, tool_call_id=c.id, name=c.name))
        if not calls:
            self.msgs.append(Msg("user", f"and now {len(self.sent)}"))

    def check_continues_parent(self) -> None:
        """The newest call continues the one before it at its reply: the parent's input and
        output ids are the start of its input, exactly (token in, token out)."""
        plan = self.plans[-1]
        parent = f"c{len(self.sent) - 2}"
        assert plan.parent_call_id == parent
        assert plan.drift.value == "append"
        p_in, p_out = self.sent[parent]
        got, _ = self.sent[f"c{len(self.sent) - 1}"]
        assert plan.prefix_len == len(p_in) + len(p_out)
        assert got[: plan.prefix_len] == p_in + p_out
        # these templates re-render every reply as generated: the input equals a full render
        self.check_full_render(f"c{len(self.sent) - 1}")

    def check_full_render(self, call_id: str) -> None:
        full = self.r.render(self.requests[call_id], TOOLS, add_generation_prompt=True)
        assert self.sent[call_id][0] == self.r.inner.tokenizer.encode(full, add_special_tokens=False)


def test_each_call_continues_its_parents_ids(templated) -> None:
    run = Run(templated)
    replies = ["Let me look.", tool_call(1), tool_call(2) + "\n" + tool_call(3), "Done reading.", tool_call(4)]
    for n, text in enumerate(replies):
        run.call(text)
        if n:
            run.check_continues_parent()
    # every new message was rendered on its own: only the new messages were tokenized
    assert all(p.prefix_len > 0 for p in run.plans[1:])


def test_parallel_tool_turns_plan_in_constant_renders(templated) -> None:
    run = Run(templated)
    run.call("Start.")
    per_plan = []
    for turn in range(30):
        before = templated.renders
        run.call("\n".join(tool_call(10 * turn + k) for k in range(3)))  # three results come back
        per_plan.append(templated.renders - before)
        run.check_continues_parent()
    run.call("All read.")
    run.check_continues_parent()
    # shape measured once; after that a turn renders its few new messages and the reply check
    assert max(per_plan[1:]) <= 8 and per_plan[-1] == per_plan[1]


def test_a_boundary_inside_a_run_of_tool_results_is_not_reused(renderer) -> None:
    """A call whose request ended after the first of two tool results: the next request
    (both results) must not continue after that result's closed block when the template
    renders the run as one block."""
    r = with_template(renderer, TEMPLATES["tool-run-block"])
    run = Run(r)
    run.call(tool_call(1) + "\n" + tool_call(2))
    both = run.msgs
    run.msgs = both[:-1]  # the client sends the first result alone, then both
    run.call("Waiting for the second.")
    run.msgs = both
    run.call("Both read.")
    plan = run.plans[-1]
    assert plan.parent_call_id == "c0" and plan.matched_messages == 3  # after c0's reply, not inside the run
    run.check_full_render("c2")


def test_an_unmeasurable_template_stops_scanning_at_the_first_failure(renderer) -> None:
    """A template that is never prefix-stable (the message count in its first line): every
    call forks, and a plan tries one boundary, not every shorter one."""
    counted = "<|im_start|>system\n{{ messages | length }}<|im_end|>\n" + template(think_when_last=False,
                                                                                      run_block=True)
    r = with_template(renderer, counted)
    run = Run(r)
    per_plan = []
    for turn in range(20):
        before = r.renders
        run.call(tool_call(2 * turn) + "\n" + tool_call(2 * turn + 1))
        per_plan.append(r.renders - before)
    assert all(p.parent_call_id is None and p.drift.value == "fork" for p in run.plans[1:])
    assert per_plan[-1] == per_plan[2] <= 10
    for call_id in run.sent:
        run.check_full_render(call_id)  # each fork rendered its whole conversation
