"""Bad input and refusals: each a 4xx/5xx in the caller's own API error shape, and
nothing recorded for a refused call."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from libs.common.events import Context, RolloutFinished

from ._fakes import Served
from .conftest import ADMIN, RUN
from .tito_check import recorded_calls

OA = "/v1/chat/completions"
AN = "/v1/messages"
RS = "/v1/responses"
KEY = {"Authorization": "Bearer k-secret"}


def oa_body(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def an_body(**kw):
    return {"model": "claude-x", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], **kw}


def is_openai_error(r: httpx.Response, status: int, word: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert word in err["message"] and err["type"]


def is_anthropic_error(r: httpx.Response, status: int, kind: str, word: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and word in body["error"]["message"]


async def test_auth_errors(proxy) -> None:
    base = await proxy.rollout("e-1")
    async with httpx.AsyncClient() as c:
        is_openai_error(await c.post(base + OA, json=oa_body()), 401, "API key")
        is_openai_error(await c.post(base + OA, json=oa_body(), headers={"Authorization": "Bearer nope"}), 401, "API key")
        is_anthropic_error(await c.post(proxy.url + "/r/unknown" + AN, json=an_body(), headers={"x-api-key": "k"}),
                           401, "authentication_error", "unknown")
        is_openai_error(await c.post(proxy.url + OA, json=oa_body(), headers=KEY), 401, "/r/<rollout_id>")
        await proxy.bus.publish(RolloutFinished(run_id=RUN, rollout_id="e-1", wall_time_s=1.0))
        proxy.service.book.rollouts.clear()  # as a fresh replica that reads the log
        is_anthropic_error(await c.post(base + AN, json=an_body(), headers={"x-api-key": "k-secret"}),
                           401, "authentication_error", "finished")
        r = await c.get(proxy.url + "/admin/cells")
        assert r.status_code == 401
        r = await c.get(proxy.url + "/admin/cells", headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200 and len(r.json()["cells"]) == 2


@pytest.mark.parametrize(
    ("path", "body", "status", "word"),
    [
        (OA, b"{not json", 400, "not valid JSON"),
        (OA, {"model": 3, "messages": []}, 400, "'model' must be a string"),
        (OA, {"model": "m", "messages": []}, 400, "must not be empty"),
        (OA, oa_body(messages=[{"role": "wizard", "content": "x"}]), 400, "role"),
        (OA, oa_body(temperature=7), 400, "temperature"),
        (OA, oa_body(tools=[{"type": "function", "function": {"name": "", "parameters": {}}}]), 400, "name"),
        (OA, oa_body(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
         400, "type 'object'"),
        (OA, oa_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), 400,
         "not supported"),
        (RS, {"model": "m", "input": [{"type": "mystery"}]}, 400, "not supported"),
        (RS, {"model": "m", "input": "x", "tools": [{"type": "function", "name": ""}]}, 400, "name"),
        (RS, {"model": "m", "input": "x", "previous_response_id": "resp_1"}, 400, "store: false"),
        # wrong JSON types are refused before use, never a 500
        (OA, oa_body(tools=5), 400, "'tools' must be an array"),
        (OA, oa_body(messages=[{"role": "assistant", "content": "x", "tool_calls": 5}]), 400, "tool_calls"),
        (OA, oa_body(messages=[{"role": "tool", "tool_call_id": "x", "content": "r", "name": 5}]), 400, "name"),
    ],
)
async def test_openai_bad_input(proxy, path, body, status, word) -> None:
    base = await proxy.rollout("e-2")
    async with httpx.AsyncClient() as c:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        is_openai_error(await c.post(base + path, headers=KEY, **kw), status, word)
    assert await proxy.bus.last_seq(Context.CALLS) == 0  # nothing recorded


@pytest.mark.parametrize(
    ("body", "word"),
    [
        ({"model": "c", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (an_body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), "not supported"),
        (an_body(system=[{"type": "image"}]), "system"),
        (an_body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "server tool"),
        (an_body(messages=[{"role": "user", "content": [{"type": "bogus"}]}]), "unsupported content block"),
        (an_body(tools=5), "'tools' must be an array"),
    ],
)
async def test_anthropic_bad_input(proxy, body, word) -> None:
    base = await proxy.rollout("e-3")
    async with httpx.AsyncClient() as c:
        r = await c.post(base + AN + "?beta=true", headers={"x-api-key": "k-secret"}, json=body)
    is_anthropic_error(r, 400, "invalid_request_error", word)


async def test_claude_code_extras_are_accepted(proxy) -> None:
    base = await proxy.rollout("e-4")
    body = an_body(system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.f23;"},
                           {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
                   messages=[{"role": "user", "content": [{"type": "text", "text": "hi",
                                                           "cache_control": {"type": "ephemeral"}}]},
                             {"role": "system", "content": "agent types: general-purpose"}],
                   thinking={"type": "adaptive"}, metadata={"user_id": "{\"device_id\":\"d\"}"},
                   context_management={"edits": [{"type": "clear_thinking_20251015"}]},
                   output_config={"effort": "high"})
    async with httpx.AsyncClient() as c:
        assert (await c.head(base)).status_code == 200
        assert (await c.head(proxy.url + "/")).status_code == 200
        r = await c.post(base + AN + "?beta=true", headers={"x-api-key": "k-secret"}, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message"


async def test_context_over_the_limit_is_a_prompt_too_long_error(proxy) -> None:
    proxy.service.max_context = 64
    base = await proxy.rollout("e-5")
    async with httpx.AsyncClient() as c:
        r = await c.post(base + AN, headers={"x-api-key": "k-secret"},
                         json=an_body(messages=[{"role": "user", "content": "word " * 200}]))
    is_anthropic_error(r, 400, "invalid_request_error", "prompt is too long")


async def test_oversized_body_and_strict_models(proxy) -> None:
    base = await proxy.rollout("e-6")
    proxy.service.config.strict_models = True
    async with httpx.AsyncClient() as c:
        is_anthropic_error(await c.post(base + AN, headers={"x-api-key": "k-secret"}, json=an_body()), 404,
                           "not_found_error", "not found")
        is_openai_error(await c.post(base + OA, headers=KEY, json=oa_body(model="policy")), 200 - 200 + 200, "") \
            if False else None
        r = await c.post(base + OA, headers=KEY, json=oa_body(model="policy"))
        assert r.status_code == 200
        big = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * (65 * 1024 * 1024) + b'"}]}'
        is_openai_error(await c.post(base + OA, headers=KEY, content=big), 413, "limit")


async def test_no_cell_is_an_overloaded_error(proxy) -> None:
    base = await proxy.rollout("e-7")
    for name in list(proxy.service.router.cells):
        proxy.service.router.drain(name)
    async with httpx.AsyncClient() as c:
        r = await c.post(base + AN, headers={"x-api-key": "k-secret"}, json=an_body())
        is_anthropic_error(r, 529, "overloaded_error", "cell")
        r = await c.post(base + OA, headers=KEY, json=oa_body())
        assert r.status_code == 529 and r.json()["error"]["code"] == "overloaded"


def _only_cell(proxy, app) -> None:
    """Serve every call from ``app`` (a stand-in engine) instead of the scripted cells."""
    served = Served(app)
    proxy.served.append(served)
    for name in list(proxy.service.router.cells):
        proxy.service.router.remove_cell(name)
    proxy.service.add_cell("x", served.url, capacity=4)


async def test_a_cell_refusing_the_request_is_a_400_in_the_callers_shape(proxy) -> None:
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        return JSONResponse({"error": {"message": "Input length exceeds the maximum allowed length"}}, status_code=400)

    _only_cell(proxy, app)
    base = await proxy.rollout("e-8")
    async with httpx.AsyncClient(timeout=20) as c:
        r = await c.post(base + AN, headers={"x-api-key": "k-secret"}, json=an_body())
        is_anthropic_error(r, 400, "invalid_request_error", "maximum allowed length")
        r = await c.post(base + OA, headers=KEY, json=oa_body(stream=True))  # before any token: a plain error
        is_openai_error(r, 400, "maximum allowed length")
    assert proxy.service.router.cells["x"].state.value == "active"  # the cell is fine: not marked down
    await proxy.service.drain_background()
    assert not await recorded_calls(proxy.bus, proxy.blobs, RUN)  # no tokens: nothing to record


async def test_an_internal_failure_is_an_error_in_the_callers_shape_streamed_or_not(proxy, monkeypatch) -> None:
    async def broken(*args, **kwargs):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(proxy.service, "_record", broken)
    base = await proxy.rollout("e-9")
    async with httpx.AsyncClient(timeout=20) as c:
        r = await c.post(base + AN, headers={"x-api-key": "k-secret"}, json=an_body())
        is_anthropic_error(r, 500, "api_error", "failed")
        r = await c.post(base + OA, headers=KEY, json=oa_body())
        is_openai_error(r, 500, "failed")
        r = await c.post(base + AN, headers={"x-api-key": "k-secret"}, json=an_body(stream=True))
        assert r.status_code == 200  # the headers were out before the failure
        assert "event: error" in r.text and '"api_error"' in r.text and "message_stop" not in r.text
        r = await c.post(base + RS, headers=KEY, json={"model": "m", "input": "hi", "stream": True})
        # OpenAI's shape: the response, failed (the SDK and Codex read its error)
        assert "event: response.failed" in r.text and '"server_error"' in r.text and "response.completed" not in r.text


async def test_a_template_refusing_the_conversation_is_a_400_on_every_path(proxy, renderer) -> None:
    """Fresh render, continuation (message texts) and the reply check all go through the
    renderer, which turns jinja's errors into the proxy's TemplateError."""
    original = renderer.tokenizer.chat_template
    renderer.tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('System message must be at the beginning.') }}{% endif %}{% endfor %}" + original)
    try:
        base = await proxy.rollout("e-10")
        h = {"x-api-key": "k-secret"}
        async with httpx.AsyncClient(timeout=20) as c:
            late_system = [{"role": "user", "content": "a"}, {"role": "system", "content": "x"},
                           {"role": "user", "content": "b"}]
            r = await c.post(base + AN, headers=h, json=an_body(messages=late_system))
            is_anthropic_error(r, 400, "invalid_request_error", "System message must be at the beginning")
            r = await c.post(base + AN, headers=h, json=an_body(messages=[{"role": "user", "content": "a"}]))
            reply = r.json()["content"][0]["text"]
            continued = [{"role": "user", "content": "a"}, {"role": "assistant", "content": reply},
                         {"role": "system", "content": "x"}, {"role": "user", "content": "b"}]
            r = await c.post(base + AN, headers=h, json=an_body(messages=continued))
            is_anthropic_error(r, 400, "invalid_request_error", "System message must be at the beginning")
            r = await c.post(base + "/v1/messages/count_tokens", headers=h, json=an_body(messages=continued))
            is_anthropic_error(r, 400, "invalid_request_error", "System message must be at the beginning")
    finally:
        renderer.tokenizer.chat_template = original


@pytest.mark.parametrize(("path", "body", "word"), [
    ("/admin/cells", {"name": "x", "url": "http://127.0.0.1:9", "capacity": [1]}, "'capacity' must be an integer"),
    ("/admin/cells", {"name": "x", "url": "http://127.0.0.1:9", "capacity": 1.5}, "'capacity' must be an integer"),
    ("/admin/cells", {"name": "x", "url": "http://127.0.0.1:9", "capacity": 0}, "'capacity' must be an integer"),
    ("/admin/cells/cell-a/drain", {"timeout_s": {}}, "'timeout_s' must be a number"),
    ("/admin/cells/cell-a/drain", {"timeout_s": -1}, "'timeout_s' must be a number"),
    ("/admin/cells/cell-a/evacuate", {"migrate": "false"}, "'migrate' must be true or false"),
    ("/admin/sessions/move", {"session": ["s"], "to_cell": "cell-b"}, "'session' and 'to_cell'"),
])
async def test_admin_fields_of_the_wrong_kind_are_400s_naming_them(proxy, path, body, word) -> None:
    """Before, a list or object raised TypeError (a 500) and the string "false" meant true;
    nothing is changed by a refused command."""
    async with httpx.AsyncClient() as c:
        r = await c.post(proxy.url + path, json=body, headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 400 and word in r.text, r.text
        cells = (await c.get(proxy.url + "/admin/cells", headers={"Authorization": f"Bearer {ADMIN}"})).json()["cells"]
        assert {c["name"]: c["state"] for c in cells} == {"cell-a": "active", "cell-b": "active"}


async def test_paths_and_methods_no_route_takes_answer_in_the_apis_error_shape(proxy) -> None:
    """Not FastAPI's {"detail": ...}: the SDKs show the message of their own shape."""
    base = await proxy.rollout("e-unrouted")
    async with httpx.AsyncClient() as c:
        r = await c.get(base + OA, headers=KEY)
        is_openai_error(r, 405, "GET is not allowed on")
        assert "POST" in r.headers.get("allow", "")
        is_openai_error(await c.post(base + "/v1/completions", headers=KEY, json={"model": "m", "prompt": "x"}),
                        404, "no such endpoint: POST")
        is_anthropic_error(await c.get(base + AN, headers=KEY), 405, "invalid_request_error", "GET is not allowed")
        is_anthropic_error(await c.post(base + AN + "/batches", headers=KEY, json={}), 404, "not_found_error",
                           "no such endpoint")


async def test_count_tokens_counts_what_a_call_would_refuse_for_its_answer(proxy) -> None:
    """A forced tool choice or a server tool changes the answer, not the prompt: Anthropic's
    count_tokens counts such requests, and so does this one (the call itself is refused)."""
    base = await proxy.rollout("e-count")
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    async with httpx.AsyncClient() as c:
        plain = await c.post(base + AN + "/count_tokens", headers=KEY, json=an_body(tools=tools))
        assert plain.status_code == 200, plain.text
        for extra in ({"tool_choice": {"type": "any"}},
                      {"tools": [*tools, {"type": "web_search_20250305", "name": "web_search"}]}):
            r = await c.post(base + AN + "/count_tokens", headers=KEY, json=an_body(tools=tools) | extra)
            assert r.status_code == 200 and r.json() == plain.json(), r.text
        r = await c.post(base + AN, headers=KEY, json=an_body(tools=tools, tool_choice={"type": "any"}))
        is_anthropic_error(r, 400, "invalid_request_error", "not supported by this proxy")
