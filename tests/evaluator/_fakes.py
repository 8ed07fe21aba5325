"""Test double for one edge: a remote LLM judge.

Fakes an OpenAI-compatible ``POST /v1/chat/completions`` endpoint, served for real over
HTTP on 127.0.0.1 (a free port) by ``http.server`` in a background thread. What it says
is scripted: each request takes the next ``Reply`` (the last one repeats): a chat answer
with some content, an HTTP error status, a body that is not a chat completion, or a
delay longer than the client's timeout. Every request body is recorded.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class Reply:
    content: str | None = None  # chat answer text
    status: int = 200
    raw_body: str | None = None  # sent as is instead of a chat completion
    delay_s: float = 0.0


class FakeJudge:
    def __init__(self, replies: list[Reply]) -> None:
        self.replies = list(replies)
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> FakeJudge:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _next(self, body: dict) -> Reply:
        with self._lock:
            self.requests.append(body)
            return self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802  (http.server's naming)
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path != "/v1/chat/completions":
                    self.send_error(404)
                    return
                reply = fake._next(body)
                if reply.delay_s:
                    time.sleep(reply.delay_s)
                if reply.raw_body is not None:
                    data = reply.raw_body.encode()
                else:
                    data = json.dumps({
                        "id": "chatcmpl-fake", "object": "chat.completion", "model": body.get("model"),
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": reply.content}}],
                    }).encode()
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
                    pass

        return Handler
