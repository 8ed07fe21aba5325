"""SGLang's streamed /generate reports a request it refuses (ValueError: input longer than
the context, a sampling parameter out of range, ...) as HTTP 200 followed by
``data: {"error": {"message": ...}}`` and ``data: [DONE]`` (sglang/srt/entrypoints/
http_server.py, generate_request.stream_results). The proxy always streams from its
cells, so it must read that chunk as the cell's refusal (CellRejected: a 400, or the
context-length retry), not as a cell failure."""

from __future__ import annotations

import json
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from ._fakes import Served

MSG = "The input (40000 tokens) is longer than the model's context length (32768 tokens)."


def sglang_refusing_cell(calls: list[int]) -> FastAPI:
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        await request.json()
        calls.append(1)

        async def chunks():  # exactly what SGLang's stream_results yields after a ValueError
            yield f"data: {json.dumps({'error': {'message': MSG}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


async def test_an_in_stream_refusal_is_a_400_not_an_overloaded_529(proxy) -> None:
    calls: list[int] = []
    served = Served(sglang_refusing_cell(calls))
    proxy.served.append(served)
    for name in list(proxy.service.router.cells):
        proxy.service.router.remove_cell(name)
    proxy.service.add_cell("x", served.url, capacity=4)
    base = await proxy.rollout("sg-1")
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(base + "/v1/messages", headers={"x-api-key": "k-secret"},
                         json={"model": "claude-x", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]})
    # Claude Code compacts on a 400 invalid_request_error; a 529 overloaded_error it just
    # sends again (x-should-retry: true), forever getting the same answer
    assert r.status_code == 400, (r.status_code, r.text, f"cell asked {len(calls)} times")
    assert r.json()["error"]["type"] == "invalid_request_error"
