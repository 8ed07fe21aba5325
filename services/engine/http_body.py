"""Reading request bodies the same way on every route (the engine's own, the KV and weight ports)."""

from __future__ import annotations

import json

from fastapi import Request

from .params import InvalidRequest


async def json_body(request: Request) -> dict:
    """The body as a JSON object; an empty body is ``{}``. Anything else is a 400."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise InvalidRequest("body is not JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequest("body must be a JSON object")
    return body
