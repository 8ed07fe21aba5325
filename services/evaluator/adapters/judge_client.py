"""The LLM judge over any OpenAI-compatible Chat Completions endpoint (httpx).

Every attempt has its own timeout; timeouts, connection errors, 429/5xx answers,
malformed bodies and answers without a usable 0-1 score are retried with backoff, up to
``attempts``; other 4xx answers (wrong model, bad key) fail at once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from libs.common.events.envelope import encodable_text

from ..core.judge import JudgeReplyError, parse_judge_score


class JudgeFailed(RuntimeError):
    """No usable score after all attempts; the message says why (last error)."""


class JudgeUnreachable(JudgeFailed):
    """Every attempt failed to get an answer at all (timeout, connection, HTTP 429/5xx):
    the judge, not the rollout, is at fault, and a later try may succeed."""


@dataclass(frozen=True)
class JudgeConfig:
    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str
    api_key: str | None = None
    timeout_s: float = 60.0
    attempts: int = 3
    backoff_s: float = 1.0
    max_tokens: int = 512
    temperature: float = 0.0


class JudgeClient:
    def __init__(self, config: JudgeConfig, client: httpx.AsyncClient | None = None) -> None:
        self.config = config
        self._client = client or httpx.AsyncClient()
        self._owns_client = client is None

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def score(self, messages: list[dict[str, str]]) -> float:
        cfg = self.config
        last, answered = "no attempt made", False
        for attempt in range(1, cfg.attempts + 1):
            try:
                return await self._once(messages)
            except _Fatal as exc:
                raise JudgeFailed(str(exc)) from exc
            except _Retry as exc:
                last = str(exc)
                answered = answered or not exc.unreachable
            if attempt < cfg.attempts:
                await asyncio.sleep(cfg.backoff_s * 2 ** (attempt - 1))
        raise (JudgeFailed if answered else JudgeUnreachable)(f"{last} (after {cfg.attempts} attempts)")

    def time_budget_s(self) -> float:
        """The longest ``score`` can take: every attempt timing out, plus the backoffs."""
        cfg = self.config
        return cfg.attempts * cfg.timeout_s + sum(cfg.backoff_s * 2 ** (a - 1) for a in range(1, cfg.attempts))

    async def _once(self, messages: list[dict[str, str]]) -> float:
        cfg = self.config
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        # text UTF-8 cannot carry (a non-UTF-8 file name in the workspace listing) is sent
        # escaped: httpx would refuse to encode the body, and the rollout be unscorable
        messages = [{k: encodable_text(v) if isinstance(v, str) else v for k, v in m.items()} for m in messages]
        body = {"model": cfg.model, "messages": messages, "temperature": cfg.temperature, "max_tokens": cfg.max_tokens}
        try:
            resp = await self._client.post(
                cfg.base_url.rstrip("/") + "/chat/completions", json=body, headers=headers, timeout=cfg.timeout_s
            )
        except httpx.TimeoutException as exc:
            raise _Retry(f"judge timed out after {cfg.timeout_s:g}s", unreachable=True) from exc
        except httpx.HTTPError as exc:
            raise _Retry(f"judge unreachable: {exc!r}", unreachable=True) from exc
        if resp.status_code == 429 or resp.status_code >= 500:
            raise _Retry(f"judge answered HTTP {resp.status_code}", unreachable=True)
        if resp.status_code >= 400:
            raise _Fatal(f"judge refused the request: HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            content = resp.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise _Retry(f"judge sent a malformed body: {resp.text[:120]!r}") from exc
        try:
            return parse_judge_score(content if isinstance(content, str) else "")
        except JudgeReplyError as exc:
            raise _Retry(f"judge answered nonsense: {exc}") from exc


class _Retry(Exception):
    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable  # no answer at all (as opposed to a useless one)


class _Fatal(Exception):
    pass
