"""The official OpenAI and Anthropic SDKs against the proxy: stream and not, tool round
trips, Responses API with function calls; every call recorded token-exactly."""

from __future__ import annotations

import json

import anthropic
import openai

from .conftest import RUN
from .tito_check import check_exact, engine_view, recorded_calls

CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
TOOLS_OA = [{"type": "function", "function": {"name": "read_file", "description": "read a file",
                                              "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                             "required": ["path"]}}}]
TOOLS_AN = [{"name": "read_file", "description": "read a file",
             "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]


def script(proxy, *replies: str) -> None:
    """The replies, in call order, whichever cell serves each call."""
    queue = list(replies)
    for e in proxy.engines.values():
        e.replies = []
        e.default_reply = lambda _input: queue.pop(0) if queue else "ok"


async def exact(proxy) -> dict:
    recorded = await recorded_calls(proxy.bus, proxy.blobs, RUN)
    check_exact(recorded, engine_view(proxy.engines.values()))
    return recorded


async def test_openai_chat_tool_round_trip_non_streaming(sdk, proxy) -> None:
    base = await proxy.rollout("oa-1")
    client = sdk(openai.AsyncOpenAI(base_url=base + "/v1", api_key="k-secret", max_retries=0))
    script(proxy, CALL, "The file defines main().")
    messages = [{"role": "system", "content": "You are careful."}, {"role": "user", "content": "What is in a.py?"}]
    first = await client.chat.completions.create(model="gpt-5", messages=messages, tools=TOOLS_OA)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "read_file" and json.loads(call.function.arguments) == {"path": "a.py"}
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "def main(): pass"}]
    second = await client.chat.completions.create(model="gpt-5", messages=messages, tools=TOOLS_OA)
    assert second.choices[0].message.content == "The file defines main()."
    assert second.usage.completion_tokens > 0
    recorded = list((await exact(proxy)).values())
    assert [r.event.drift.value for r in recorded] == ["fresh", "template_drift"]  # tool JSON re-renders differently
    assert recorded[1].event.parent_call_id == recorded[0].event.call_id


async def test_openai_chat_streaming_with_usage(sdk, proxy) -> None:
    base = await proxy.rollout("oa-2")
    client = sdk(openai.AsyncOpenAI(base_url=base + "/v1", api_key="k-secret", max_retries=0))
    script(proxy, "Streaming déjà vu 🙂 works.", CALL)
    stream = await client.chat.completions.create(
        model="gpt-5", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True})
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage:
            usage = chunk.usage
    assert text == "Streaming déjà vu 🙂 works."
    assert usage is not None and usage.completion_tokens > 0
    async with client.chat.completions.stream(model="gpt-5", tools=TOOLS_OA,
                                              messages=[{"role": "user", "content": "hi"},
                                                        {"role": "assistant", "content": text},
                                                        {"role": "user", "content": "read it"}]) as s:
        final = await s.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.name == "read_file"
    await exact(proxy)


async def test_anthropic_messages_stream_and_tool_use(sdk, proxy) -> None:
    base = await proxy.rollout("an-1")
    client = sdk(anthropic.AsyncAnthropic(base_url=base, api_key="k-secret", max_retries=0))
    script(proxy, "Let me look." + CALL, "It defines main.")
    system = [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in a.py?"}]}]
    async with client.messages.stream(model="claude-opus-4-8", max_tokens=512, system=system, tools=TOOLS_AN,
                                      messages=messages, thinking={"type": "adaptive"},
                                      extra_body={"context_management": {"edits": []}}) as s:
        first = await s.get_final_message()
    assert first.stop_reason == "tool_use"
    kinds = [b.type for b in first.content]
    assert kinds == ["text", "tool_use"]
    tool = first.content[1]
    assert tool.input == {"path": "a.py"}
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool.id,
                                               "content": "def main(): pass"}]}]
    second = await client.messages.create(model="claude-haiku-4-5-20251001", max_tokens=256, system=system,
                                          tools=TOOLS_AN, messages=messages)
    assert second.content[0].text == "It defines main." and second.stop_reason == "end_turn"
    count = await client.messages.count_tokens(model="claude-opus-4-8", system=system, tools=TOOLS_AN,
                                               messages=messages)
    assert count.input_tokens > 10
    recorded = list((await exact(proxy)).values())
    assert len(recorded) == 2 and recorded[1].event.parent_call_id == recorded[0].event.call_id
    assert recorded[0].event.api == "anthropic_messages"


async def test_openai_responses_function_call_round_trip(sdk, proxy) -> None:
    base = await proxy.rollout("rs-1")
    client = sdk(openai.AsyncOpenAI(base_url=base + "/v1", api_key="k-secret", max_retries=0))
    script(proxy, CALL, "Done reading.")
    tools = [{"type": "function", "name": "read_file", "description": "read a file",
              "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]
    items: list = [{"role": "user", "content": "read a.py"}]
    first = await client.responses.create(model="gpt-5-codex", instructions="Be terse.", input=items, tools=tools,
                                          store=False)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "read_file"
    items += [calls[0].model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": "def main(): pass"}]
    text = ""
    async with client.responses.stream(model="gpt-5-codex", instructions="Be terse.", input=items, tools=tools,
                                       store=False) as s:
        async for event in s:
            if event.type == "response.output_text.delta":
                text += event.delta
        final = await s.get_final_response()
    assert text == "Done reading." and final.output_text == "Done reading."
    recorded = list((await exact(proxy)).values())
    assert recorded[1].event.parent_call_id == recorded[0].event.call_id
