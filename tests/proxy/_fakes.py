"""Test doubles for the proxy's edges.

``ScriptedEngine`` fakes an SGLang inference server (a GPU engine on a CPU machine) with
a script instead of a model: it speaks SGLang's native ``/generate`` (``input_ids``,
``sampling_params``, ``return_logprob``, ``stream`` with cumulative chunks, ``rid``) and
``/abort_request``, and answers each request with the next scripted reply, encoded by the
real tokenizer. It records every ``input_ids`` it received, so tests can compare what the
proxy recorded with what the engine saw. Faked: the model (replies are scripted), the
logprobs (a fixed value per position), the KV cache (none). Options: ``split_tokens``
(emit a reply as one token per character, so its text re-encodes to other ids), ``fail``
(drop the connection after N tokens, once), ``delay_s`` per token, ``healthy`` (what
``GET /health`` answers), ``honour_stop`` (end a reply at the first ``stop`` string, kept
in the output, as SGLang with ``no_stop_trim``; off: the proxy's own cutting is tested).
With ``top_logprobs_num`` each position also gets that many alternatives (the sampled
token first). ``bodies`` keeps every request body.
The real adapter is the embedded engine (``services/engine``) and SGLang itself.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from libs.common.natsserver import free_port


@dataclass
class ScriptedEngine:
    tokenizer: Any
    replies: list[str | Callable[[str], str]] = field(default_factory=list)
    default_reply: Any = "ok"  # a string, or a function of the decoded input
    split_tokens: bool = False
    fail_after_tokens: int | None = None  # drop the connection once, after this many tokens
    delay_s: float = 0.0
    weight_version: int = 0
    received: list[list[int]] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    by_rid: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)  # rid -> (input, output)
    aborted: list[str] = field(default_factory=list)
    name: str = "cell"
    healthy: bool = True  # what GET /health answers
    honour_stop: bool = False  # end at the first sampling_params.stop string, as SGLang does
    bodies: list[dict] = field(default_factory=list)

    def _reply_ids(self, input_ids: list[int]) -> list[int]:
        script = self.replies.pop(0) if self.replies else self.default_reply
        text = script(self.tokenizer.decode(input_ids)) if callable(script) else script
        split = self.split_tokens
        if isinstance(text, tuple):  # (text, split this reply into one token per character)
            text, split = text
        end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if split:
            ids = [i for ch in text for i in self.tokenizer.encode(ch, add_special_tokens=False)]
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        ids = ids + [end]
        # like a deterministic model: an input that already ends with part of the answer
        # (a generation continued on this cell) gets only the rest
        for k in range(min(len(ids), len(input_ids)), 0, -1):
            if input_ids[-k:] == ids[:k]:
                return ids[k:]
        return ids

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request) -> Any:
            body = await request.json()
            input_ids = list(body["input_ids"])
            self.received.append(input_ids)
            sp = body.get("sampling_params") or {}
            self.bodies.append(body)
            ids = self._reply_ids(input_ids)[: int(sp.get("max_new_tokens", 128))]
            finish = {"type": "stop", "matched": ids[-1]} if ids and ids[-1] in (sp.get("stop_token_ids") or []) \
                else {"type": "length", "length": len(ids)}
            stops = [sp["stop"]] if isinstance(sp.get("stop"), str) else list(sp.get("stop") or [])
            if self.honour_stop and stops:
                for n in range(1, len(ids) + 1):
                    hit = next((st for st in stops if st in self.tokenizer.decode(ids[:n])), None)
                    if hit is not None:
                        ids, finish = ids[:n], {"type": "stop", "matched": hit}
                        break
            self.outputs.append(ids)
            self.by_rid[str(body.get("rid"))] = (input_ids, ids)
            top_n = int(body.get("top_logprobs_num") or 0)

            def snapshot(n: int, done: bool) -> dict:
                out = ids[:n]
                return {"text": self.tokenizer.decode(out), "output_ids": out, "meta_info": {
                    "id": body.get("rid"), "finish_reason": finish if done else None,
                    "prompt_tokens": len(input_ids), "completion_tokens": n, "cached_tokens": 0,
                    "weight_version": self.weight_version,
                    "output_token_logprobs": [[-0.25 - 0.01 * (i % 7), t, None] for i, t in enumerate(out)],
                    **({"output_top_logprobs": [[[-0.25 - 0.01 * (i % 7) - j, t + j, None] for j in range(top_n)]
                                                for i, t in enumerate(out)]} if top_n else {})}}

            if not body.get("stream"):
                return JSONResponse(snapshot(len(ids), True))

            async def chunks():
                for n in range(1, len(ids) + 1):
                    if self.fail_after_tokens is not None and n > self.fail_after_tokens:
                        self.fail_after_tokens = None
                        raise ConnectionError("scripted cell failure")
                    if self.delay_s:
                        await asyncio.sleep(self.delay_s)
                    yield f"data: {json.dumps(snapshot(n, n == len(ids)))}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(chunks(), media_type="text/event-stream")

        @app.get("/health")
        async def health() -> Any:
            return JSONResponse({}, status_code=200 if self.healthy else 503)

        @app.post("/abort_request")
        async def abort(request: Request) -> Any:
            body = await request.json()
            self.aborted.append(str(body.get("rid")))
            return {"success": True}

        return app


class Served:
    """An ASGI app on a real loopback port, in a background thread; stop() ends it."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
