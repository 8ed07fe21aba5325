"""One async client for an inference cell, embedded engine or SGLang server alike.

It speaks SGLang's native endpoints (see ../shared/notes/sglang-api.md); the proxy, the
scheduler's cell agent and the trainer use it. Version notes: ``begin_weight_update`` /
``end_weight_update`` exist in SGLang >= 0.5.21 and are required there around tensor and
distributed updates; ``weight_update_window`` calls them only when ``use_update_window``,
and ends the window when its body fails (with ``{"abort": true}``, a Gyre extension that
drops what was staged, only on Gyre's engine; SGLang gets its plain ``{}``).
The ``kv_export``/``kv_import`` calls are Gyre extensions that SGLang does not have.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import httpx

log = logging.getLogger(__name__)
GYRE_ENGINE_VERSION_PREFIX = "gyre-engine"  # /server_info "version" of the embedded engine (http_app)


class CellError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class EngineClient:
    def __init__(
        self,
        base_url: str,
        *,
        admin_token: str | None = None,
        timeout: float = 600.0,
        use_update_window: bool = True,
        gyre_engine: bool | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """``gyre_engine``: whether the cell is Gyre's embedded engine (None: asked from
        ``/server_info`` when it matters, see :meth:`_is_gyre_engine`)."""
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, transport=transport)
        self.use_update_window = use_update_window
        self.gyre_engine = gyre_engine

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- generation ----------------------------------------------------------------------
    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any] | None = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        top_logprobs_num: int = 0,
    ) -> dict:
        body = _generate_body(input_ids, sampling_params, return_logprob, rid, stream=False, top=top_logprobs_num)
        return await self._post("/generate", body)

    async def generate_stream(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any] | None = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        top_logprobs_num: int = 0,
    ) -> AsyncIterator[dict]:
        """Yields SGLang's cumulative stream chunks; the last has a ``finish_reason``. A
        request SGLang refuses once the stream is open (a ``ValueError`` there: an input
        longer than the context, a sampling parameter out of range) comes as a chunk
        ``{"error": {"message": ...}}`` on an HTTP 200: raised as a ``CellError`` 400, as
        the same refusal of a request that is not streamed is answered."""
        body = _generate_body(input_ids, sampling_params, return_logprob, rid, stream=True, top=top_logprobs_num)
        async with self._http.stream("POST", "/generate", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise CellError(response.status_code, response.text)
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                error = chunk.get("error") if isinstance(chunk, dict) else None
                if error is not None:
                    message = error.get("message") if isinstance(error, dict) else None
                    raise CellError(400, str(message or error))
                yield chunk

    # -- state ---------------------------------------------------------------------------
    async def health(self) -> bool:
        try:
            return (await self._http.get("/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def model_info(self) -> dict:
        return await self._get("/model_info")

    async def server_info(self) -> dict:
        return await self._get("/server_info")

    async def flush_cache(self) -> None:
        await self._post("/flush_cache", {})

    async def abort(self, rid: str | None = None) -> dict:
        return await self._post("/abort_request", {"rid": rid} if rid else {"abort_all": True})

    async def pause(self, mode: str = "abort") -> dict:
        return await self._post("/pause_generation", {"mode": mode})

    async def resume_generation(self) -> dict:
        return await self._post("/continue_generation", {})

    async def release_memory(self, tags: list[str] | None = None) -> dict:
        return await self._post("/release_memory_occupation", {"tags": tags})

    async def resume_memory(self, tags: list[str] | None = None) -> dict:
        return await self._post("/resume_memory_occupation", {"tags": tags})

    # -- weights -------------------------------------------------------------------------
    @asynccontextmanager
    async def weight_update_window(self, weight_version: str | None = None):
        """``begin_weight_update`` ... ``end_weight_update`` around the body.

        The window never stays open behind a failure: when the body raises, the window is
        closed without applying what it staged (:meth:`_close_failed_window`) and the body's
        error propagates, so the caller never counts ``weight_version`` as applied. When
        ``end`` itself fails, a Gyre engine's window is dropped too (best effort) and the
        end's error propagates."""
        if not self.use_update_window:
            yield
            return
        await self._post("/begin_weight_update", {})
        try:
            yield
        except (Exception, asyncio.CancelledError):
            await self._close_failed_window()
            raise
        try:
            await self._post("/end_weight_update", {"weight_version": weight_version})
        except Exception:
            if await self._is_gyre_engine():  # e.g. refused while released: do not leave it open
                await self._close_failed_window()
            raise

    async def _close_failed_window(self) -> None:
        """Ends a window whose body failed, never raising (the body's error is the one that
        counts). A Gyre engine gets ``{"abort": true}`` (a Gyre extension) and drops what
        was staged. SGLang has no abort (its ``end_weight_update`` takes ``{}``, see
        ../shared/notes/sglang-api.md): it gets a plain ``{}`` end, without the version, so
        its window does not stay open; updates it already took in stay loaded, and the
        caller, which gets the error, must load the full weights again before counting any
        version."""
        try:
            body = {"abort": True} if await self._is_gyre_engine() else {}
            await self._post("/end_weight_update", body)
        except Exception as exc:  # the engine is gone or refuses: nothing more to do here
            log.warning("closing a failed weight update window: %r", exc)

    async def _is_gyre_engine(self) -> bool:
        """Whether the cell is Gyre's embedded engine (its ``/server_info`` ``version``
        starts with ``gyre-engine``) rather than SGLang; decides whether Gyre-only request
        fields may be sent. Asked once; an engine that does not answer counts as SGLang."""
        if self.gyre_engine is None:
            try:
                version = (await self.server_info()).get("version")
            except Exception:
                return False
            self.gyre_engine = isinstance(version, str) and version.startswith(GYRE_ENGINE_VERSION_PREFIX)
        return self.gyre_engine

    async def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None,
                                       abort_all_requests: bool = False) -> dict:
        body = {"model_path": model_path, "weight_version": weight_version,
                "abort_all_requests": abort_all_requests, "flush_cache": True}
        return await self._post("/update_weights_from_disk", body)

    async def update_weights_from_tensor(self, serialized: str, *, weight_version: str | None = None) -> dict:
        body = {"serialized_named_tensors": [serialized], "flush_cache": True, "weight_version": weight_version}
        return await self._post("/update_weights_from_tensor", body)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str = "gloo") -> dict:
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}
        return await self._post("/init_weights_update_group", body)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, *, weight_version: str | None = None) -> dict:
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "weight_version": weight_version, "flush_cache": True}
        return await self._post("/update_weights_from_distributed", body)

    async def destroy_weights_update_group(self, group_name: str) -> dict:
        return await self._post("/destroy_weights_update_group", {"group_name": group_name})

    # -- Gyre extensions -----------------------------------------------------------------
    async def kv_export(self, input_ids: list[int]) -> bytes:
        response = await self._http.post("/gyre/kv/export", json={"input_ids": input_ids})
        _raise_for(response)
        return response.content

    async def kv_import(self, blob: bytes) -> dict:
        response = await self._http.post("/gyre/kv/import", content=blob,
                                         headers={"content-type": "application/octet-stream"})
        _raise_for(response)
        return response.json()

    # -- plumbing ------------------------------------------------------------------------
    async def _get(self, path: str) -> dict:
        response = await self._http.get(path)
        _raise_for(response)
        return response.json()

    async def _post(self, path: str, body: dict) -> Any:
        response = await self._http.post(path, json=body)
        _raise_for(response)
        if "json" in response.headers.get("content-type", ""):
            return response.json()
        return {"text": response.text}


def _generate_body(input_ids, sampling_params, return_logprob, rid, stream, top=0) -> dict:
    body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling_params or {},
                            "return_logprob": return_logprob, "stream": stream}
    if rid:
        body["rid"] = rid
    if top:
        body["top_logprobs_num"] = top
    return body


def _raise_for(response: httpx.Response) -> None:
    if response.status_code >= 400:
        raise CellError(response.status_code, response.text)
