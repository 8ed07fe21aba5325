"""KV export/import of a session's cached prefix, so a session can move between cells.

``POST /gyre/kv/export {"input_ids": [...]}`` answers a safetensors file (one tensor
``kv`` of shape ``[layers, 2, kv_heads, n, head_dim]``, float32) whose metadata holds the
``n`` matched ``input_ids`` and the ``weight_version``; ``POST /gyre/kv/import`` takes that
file back and puts the prefix into this cell's cache. Import refuses KV from another weight
version (it would be stale) and KV whose shape does not fit this model. Since the label is
all that is compared, both ends refuse while their label is stale: weights written by an
update without ``weight_version`` since the label was set (``Engine.check_weight_label``).
The transfer engines (Mooncake/UCX) can carry the same tensor; HTTP is the simple path.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import Response

from .engine import Engine, MemoryReleased
from .http_body import json_body
from .params import InvalidRequest

MEDIA_TYPE = "application/octet-stream"


def export_prefix(engine: Engine, input_ids: list[int]) -> bytes:
    """Engine thread: the cached prefix of ``input_ids`` as safetensors bytes."""
    from safetensors.torch import save

    engine.check_weight_label("KV export")  # its label would vouch for weights it does not name
    matched, kv = engine.prefix_cache.export(input_ids)
    meta = {"input_ids": json.dumps(input_ids[:matched]), "weight_version": engine.weight_version}
    return save({"kv": kv.contiguous()}, metadata=meta)


def import_prefix(engine: Engine, blob: bytes) -> int:
    """Engine thread: adds an exported prefix to the cache; returns the new token count the
    cache still holds (0 when the prefix does not fit: it was evicted at once).
    Refused while the KV cache's memory is released (a cell lent to training)."""
    return import_answer(engine, *_import(engine, blob))["added_tokens"]


def import_answer(engine: Engine, ids: list[int], added: int) -> dict:
    """Engine thread, right after an import of ``ids``: what the cache kept of it. ``success``
    only when it holds the whole prefix (already there counts), so a migration that keeps
    nothing is not reported as one."""
    held = engine.prefix_cache.held(ids) if ids else 0
    answer = {"success": held == len(ids), "added_tokens": added, "tokens": len(ids), "cached_tokens": held}
    if held < len(ids):
        answer["message"] = (f"KV prefix of {len(ids)} tokens not kept: this cell's prefix cache holds "
                             f"{engine.prefix_cache.capacity_tokens} tokens at most; nothing imported")
    return answer


def _import(engine: Engine, blob: bytes) -> tuple[list[int], int]:
    from safetensors.torch import load

    if "kv_cache" in engine.released:
        raise MemoryReleased("the KV cache's memory is released; resume it before importing a prefix")

    try:
        kv = load(blob)["kv"]
        meta = _metadata(blob)
        ids = [int(t) for t in json.loads(meta["input_ids"])]
    except Exception as exc:
        raise InvalidRequest(f"not an exported KV prefix: {exc}") from None
    if meta.get("weight_version") != engine.weight_version:
        raise InvalidRequest(
            f"KV is from weight version {meta.get('weight_version')!r}, this cell runs {engine.weight_version!r}"
        )
    engine.check_weight_label("KV import")  # the label matched, but this cell's weights may not be that version
    if not ids:
        return ids, 0
    try:
        return ids, engine.prefix_cache.import_(ids, kv)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def _metadata(blob: bytes) -> dict:
    # safetensors keeps metadata in the JSON header: 8-byte little-endian length, then JSON.
    length = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + length])
    return header.get("__metadata__", {})


def add_routes(app: FastAPI, engine: Engine, admin) -> None:
    @app.post("/gyre/kv/export", dependencies=[admin])
    async def kv_export(request: Request) -> Response:
        ids = (await json_body(request)).get("input_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequest("input_ids must be a list of token ids")
        blob = await engine.acall(lambda: export_prefix(engine, ids))
        return Response(blob, media_type=MEDIA_TYPE)

    @app.post("/gyre/kv/import", dependencies=[admin])
    async def kv_import(request: Request) -> dict:
        blob = await request.body()
        return await engine.acall(lambda: import_answer(engine, *_import(engine, blob)))


def kv_tensor_shape(engine: Engine, tokens: int) -> tuple[int, ...]:
    s = engine.runner.shape
    return (s.layers, 2, s.kv_heads, tokens, s.head_dim)

