"""SGLang's native HTTP API (the subset Gyre uses) in front of an :class:`Engine`.

Field names and response shapes follow SGLang 0.5.23 (../shared/notes/sglang-api.md), so
the proxy and trainer drive embedded cells and SGLang cells with one client. Control
endpoints need ``Authorization: Bearer <admin token>`` when a token is configured.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from . import kv_transfer
from .engine import Engine, EngineBusy, MemoryReleased
from .http_body import json_body as _json_body
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .params import GenerateRequest, InvalidRequest, parse_generate_request, parse_sampling_params
from .scheduler import PauseMode
from .settings import EngineSettings
from .weights import WeightManager, WeightUpdateError, deserialize_named_tensors

SERVER_VERSION = "gyre-engine 0.1 (sglang 0.5.23 API subset)"  # the client tells us from SGLang by its prefix
METRICS_WAIT_S = 5.0


def create_app(settings: EngineSettings, *, engine: Engine, weights: WeightManager) -> FastAPI:
    app = FastAPI(title="gyre engine")
    app.state.engine, app.state.weights = engine, weights
    admin = Depends(_admin_guard(settings))

    @app.exception_handler(InvalidRequest)
    @app.exception_handler(WeightUpdateError)
    async def _bad_request(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"success": False, "message": str(exc), "error": {"message": str(exc)}}, 400)

    @app.exception_handler(EngineBusy)
    async def _busy(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"success": False, "message": str(exc)}, 400)

    @app.exception_handler(MemoryReleased)
    async def _released(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"error": {"message": str(exc)}}, 503)

    _serving_routes(app, settings, engine)
    _control_routes(app, engine, admin)
    _weight_routes(app, engine, weights, admin)
    _distributed_routes(app, engine, weights, admin)
    _version_routes(app, engine, weights, admin)
    _memory_routes(app, engine, weights, admin)
    kv_transfer.add_routes(app, engine, admin)
    # KV blocks and weight pulls through the transfer port (Mooncake/UCX); the transfer
    # agent opens on first use, so cells that never migrate pay nothing.
    from . import kv_port, weights_port

    app.state.kv_port = kv_port.KVPort(engine, offer_ttl_s=settings.kv_offer_ttl_s)
    kv_port.add_routes(app, app.state.kv_port, admin)
    weights_port.add_routes(app, weights, lambda: app.state.kv_port.agent, admin)
    return app


def _serving_routes(app: FastAPI, settings: EngineSettings, engine: Engine) -> None:
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await _generate(engine, await _json_body(request), request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if not engine.alive or engine.released or engine.scheduler.paused is not None:
            return Response(status_code=503)
        seq = engine.new_sequence([0], parse_sampling_params({"max_new_tokens": 1, "temperature": 0}), False, None)
        subscriber = await engine.submit(seq, stream=False)
        async for _ in subscriber.updates():
            pass
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        if engine.alive:  # gauges from the engine thread; a long step past the wait leaves the last ones
            await asyncio.wait({asyncio.wrap_future(engine.call(engine.refresh_metrics))}, timeout=METRICS_WAIT_S)
        return Response(engine.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict:
        cfg = engine.runner.model.config
        return {
            "model_path": settings.model,
            "served_model_name": settings.model,
            "tokenizer_path": str(engine.runner.location.folder),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": cfg.model_type,
            "architectures": list(getattr(cfg, "architectures", None) or []),
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict:
        stats = await engine.acall(engine.stats)
        public = settings.model_dump(mode="json", exclude={"admin_token"})
        return {
            **public,
            "version": SERVER_VERSION,
            "model_path": settings.model,
            "max_total_num_tokens": engine.prefix_cache.capacity_tokens,
            "max_running_requests": settings.max_running_requests,
            "context_length": engine.max_context,
            "weight_version": engine.weight_version,
            "internal_states": [stats],
        }


def _control_routes(app: FastAPI, engine: Engine, admin) -> None:
    @app.api_route("/flush_cache", methods=["GET", "POST"], dependencies=[admin])
    async def flush_cache() -> Response:
        try:
            await engine.acall(engine.flush_cache)
        except EngineBusy as exc:
            return PlainTextResponse(f"Cache not flushed: {exc}\n", 400)
        return PlainTextResponse("Cache flushed.\n", 200)

    @app.post("/abort_request", dependencies=[admin])
    async def abort_request(request: Request) -> dict:
        body = await _json_body(request)
        rid, abort_all = body.get("rid"), body.get("abort_all", False)
        if not isinstance(abort_all, bool):  # "false" would be truthy: every request aborted
            raise InvalidRequest(f"abort_all must be true or false, not {abort_all!r}")
        if not abort_all and not isinstance(rid, str):
            raise InvalidRequest("give rid (a string) or abort_all")
        rids = None if abort_all else [rid]
        count = await engine.acall(lambda: engine.abort(rids, "aborted by abort_request"))
        return {"success": True, "num_aborted": count}

    @app.post("/pause_generation", dependencies=[admin])
    async def pause_generation(request: Request) -> dict:
        raw = (await _json_body(request)).get("mode", "abort")
        try:
            mode = PauseMode(raw)
        except ValueError:
            raise InvalidRequest(f"mode must be one of abort, retract, in_place; got {raw!r}") from None
        count = await engine.acall(lambda: engine.pause(mode))
        return {"success": True, "status": "ok", "message": f"paused ({mode.value})", "num_paused_requests": count}

    @app.post("/continue_generation", dependencies=[admin])
    async def continue_generation(request: Request) -> dict:
        await engine.acall(engine.resume)
        return {"success": True, "status": "ok", "message": "continued"}


def _weight_routes(app: FastAPI, engine: Engine, weights: WeightManager, admin) -> None:
    @app.post("/begin_weight_update", dependencies=[admin])
    async def begin_weight_update(request: Request) -> dict:
        await _json_body(request)
        while weights.window_busy():  # one window at a time: wait for the open one to end
            await asyncio.sleep(0.02)
        if weights.staged is not None:  # open, and nothing heard of it for WINDOW_IDLE_S
            weights.drop_window("abandoned: no update or end within its idle time; a new window replaced it")
        weights.begin()
        return {"success": True, "message": "weight update window open"}

    @app.post("/end_weight_update", dependencies=[admin])
    async def end_weight_update(request: Request) -> dict:
        body = await _json_body(request)
        version = _version(body.get("weight_version"))
        if not isinstance(body.get("abort", False), bool):
            raise InvalidRequest(f"abort must be true or false, not {body.get('abort')!r}")
        if body.get("abort") is True:  # Gyre extension: close the window, apply nothing
            weights.end(version, abort=True)
            return {"success": True, "message": "weight update window dropped; nothing applied",
                    "num_paused_requests": 0}
        paused = await asyncio.wrap_future(weights.end(version))
        return {"success": True, "message": "weights applied", "num_paused_requests": paused}

    @app.post("/update_weights_from_disk", dependencies=[admin])
    async def update_weights_from_disk(request: Request) -> dict:
        body = await _json_body(request)
        if not body.get("model_path"):
            raise InvalidRequest("model_path is required")
        checked = await asyncio.to_thread(weights.load_from_disk, str(body["model_path"]))
        paused = await asyncio.wrap_future(weights.apply_now(checked, _version(body.get("weight_version")),
                                                             abort_all_requests=bool(body.get("abort_all_requests"))))
        return {"success": True, "message": "weights loaded from disk", "num_paused_requests": paused}

    @app.post("/update_weights_from_tensor", dependencies=[admin])
    async def update_weights_from_tensor(request: Request) -> dict:
        with weights.guard():  # a failure inside a begin/end window drops the window
            body = await _json_body(request)
            payloads = body.get("serialized_named_tensors")
            if not isinstance(payloads, list) or len(payloads) != 1 or not isinstance(payloads[0], str):
                raise InvalidRequest("serialized_named_tensors must be a list with one string "
                                     "(tensor parallel size 1)")
            if body.get("load_format") not in (None, "direct"):
                raise InvalidRequest(f"load_format {body['load_format']!r} is not supported (use direct)")
            named = await asyncio.to_thread(deserialize_named_tensors, payloads[0])
            checked = weights.check_all(named)
            await asyncio.wrap_future(weights.submit(checked, _version(body.get("weight_version"))))
        return {"success": True, "message": f"{len(checked)} tensors accepted"}



def _distributed_routes(app: FastAPI, engine: Engine, weights: WeightManager, admin) -> None:
    @app.post("/init_weights_update_group", dependencies=[admin])
    async def init_weights_update_group(request: Request) -> dict:
        body = await _json_body(request)
        try:
            args = (str(body["master_address"]), int(body["master_port"]), int(body.get("rank_offset", 1)),
                    int(body["world_size"]), str(body.get("group_name", "weight_update_group")))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"bad init_weights_update_group body: {exc}") from None
        await asyncio.to_thread(weights.init_group, *args, str(body.get("backend", "gloo")))
        return {"success": True, "message": "joined the weight update group"}

    @app.post("/update_weights_from_distributed", dependencies=[admin])
    async def update_weights_from_distributed(request: Request) -> dict:
        with weights.guard():  # a failure inside a begin/end window drops the window
            body = await _json_body(request)
            names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
            if not all(isinstance(v, list) for v in (names, dtypes, shapes)):
                raise InvalidRequest("names, dtypes and shapes must be lists")
            group = str(body.get("group_name", weights.group_name or "weight_update_group"))
            checked = await asyncio.to_thread(weights.receive_broadcast, names, dtypes, shapes, group)
            await asyncio.wrap_future(weights.submit(checked, _version(body.get("weight_version"))))
        return {"success": True, "message": f"{len(checked)} tensors received"}

    @app.post("/destroy_weights_update_group", dependencies=[admin])
    async def destroy_weights_update_group(request: Request) -> dict:
        weights.destroy_group((await _json_body(request)).get("group_name"))
        return {"success": True, "message": "left the weight update group"}



def _version_routes(app: FastAPI, engine: Engine, weights: WeightManager, admin) -> None:
    @app.post("/update_weight_version", dependencies=[admin])
    async def update_weight_version(request: Request) -> dict:
        version = _version((await _json_body(request)).get("new_version"))
        if version is None:
            raise InvalidRequest("new_version is required")

        def bump() -> None:
            engine.weight_version = version

        await engine.acall(bump)
        return {"success": True, "message": f"weight version {version}"}

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"], dependencies=[admin])
    async def get_weights_by_name(request: Request) -> Any:
        body = await _json_body(request)
        key = weights.resolve(str(body.get("name")))
        size = body.get("truncate_size", 100)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidRequest("truncate_size must be a non-negative integer")
        values = await engine.acall(lambda: weights.params[key].detach().flatten()[:size].tolist())
        return values


def _memory_routes(app: FastAPI, engine: Engine, weights: WeightManager, admin) -> None:
    @app.post("/release_memory_occupation", dependencies=[admin])
    async def release_memory_occupation(request: Request) -> dict:
        tags = _tags((await _json_body(request)).get("tags"))
        await engine.acall(lambda: weights.release(tags))
        return {"success": True, "message": f"released {', '.join(tags)}"}

    @app.post("/resume_memory_occupation", dependencies=[admin])
    async def resume_memory_occupation(request: Request) -> dict:
        tags = _tags((await _json_body(request)).get("tags"))
        await engine.acall(lambda: weights.resume(tags))
        return {"success": True, "message": f"resumed {', '.join(tags)}"}


async def _generate(engine: Engine, body: dict, request: Request | None = None) -> Response:
    req = parse_generate_request(body)
    prompts, batched = _prompts(engine, req)
    if batched and isinstance(req.rid, str):
        raise InvalidRequest("rid must be a list (one id per prompt) when input_ids is a batch")
    if batched and isinstance(req.rid, list):
        # two prompts of one batch under one id: the second would be refused only while the
        # first still runs, and both answers would carry the same id
        rids = req.rid[:len(prompts)]
        repeated = sorted({rid for rid in rids if rids.count(rid) > 1})
        if repeated:
            raise InvalidRequest(f"rid must be unique within a batch; repeated: {', '.join(map(repr, repeated))}")
    seqs = []
    for i, ids in enumerate(prompts):
        if _pick(req, "logprob_start_len", i, batched) not in (-1, None):
            raise InvalidRequest("only output logprobs are supported (logprob_start_len -1)")
        params = parse_sampling_params(_pick(req, "sampling_params", i, batched))
        rid = _pick(req, "rid", i, batched)
        top_n = int(_pick(req, "top_logprobs_num", i, batched) or 0)
        seqs.append(engine.new_sequence(ids, params, bool(_pick(req, "return_logprob", i, batched)), rid, top_n))
    if req.stream:
        if batched:
            raise InvalidRequest("streaming a batch is not supported; send one request per prompt")
        subscriber = await engine.submit(seqs[0], stream=True)  # errors answer before the stream starts
        return StreamingResponse(_stream(engine, seqs[0], subscriber), media_type="text/event-stream")
    subscribers = []
    try:
        for seq in seqs:
            subscribers.append(await engine.submit(seq, stream=False))
    except BaseException:  # a prompt refused, or the client left: nothing of the batch keeps running unread
        if subscribers:
            engine.call(lambda: engine.abort([seq.rid for seq in seqs[:len(subscribers)]], "batch refused"))
        raise
    finals: list[dict] = []

    async def collect() -> None:
        for subscriber in subscribers:
            async for snapshot, _ in subscriber.updates():
                finals.append(snapshot)

    # Starlette does not cancel a handler whose client leaves: watch the connection meanwhile
    waiters = [asyncio.ensure_future(collect())]
    if request is not None:
        waiters.append(asyncio.ensure_future(_disconnected(request)))
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if waiters[0].done():
            waiters[0].result()  # raises what collecting raised
    finally:
        for waiter in waiters:
            waiter.cancel()
        if len(finals) < len(seqs):  # the client went away (or cancelled): stop spending compute on it
            unfinished = [seq.rid for seq in seqs[len(finals):]]
            engine.call(lambda: engine.abort(unfinished, "client disconnected"))
    if len(finals) < len(seqs):
        return Response(status_code=499)  # nobody reads it: the connection is closed
    return JSONResponse(finals if batched else finals[0])


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body was read already, so
    the next ASGI message is ``http.disconnect``)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # a broken receive channel: the client is as good as gone
        return


async def _stream(engine: Engine, seq, subscriber):
    finished = False
    try:
        async for snapshot, final in subscriber.updates():
            yield f"data: {json.dumps(snapshot)}\n\n"
            finished = final
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away: stop spending compute on it
            engine.call(lambda: engine.abort([seq.rid], "client disconnected"))


def _prompts(engine: Engine, req: GenerateRequest) -> tuple[list[list[int]], bool]:
    if req.input_ids is not None:
        if not req.input_ids:
            raise InvalidRequest("input_ids is empty")
        if isinstance(req.input_ids[0], list):
            return [list(x) for x in req.input_ids], True
        return [list(req.input_ids)], False
    if req.text is None:
        raise InvalidRequest("give input_ids or text")
    texts = req.text if isinstance(req.text, list) else [req.text]
    ids = [engine.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    return ids, isinstance(req.text, list)


def _pick(req: GenerateRequest, name: str, index: int, batched: bool) -> Any:
    """Prompt ``index``'s value of a per-prompt field: one value for all, or a list (batch only)."""
    value = getattr(req, name)
    if not isinstance(value, list):
        return value
    if not batched:
        raise InvalidRequest(f"{name} is a list but input is a single prompt; give one value")
    if index >= len(value):
        raise InvalidRequest(f"{name}: per-prompt lists must match the number of prompts")
    return value[index]


def _version(value: Any) -> str | None:
    return None if value is None else str(value)


def _tags(value: Any) -> list[str]:
    if value is None:
        return ["weights", "kv_cache"]
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value) \
            or not set(value) <= {"weights", "kv_cache", "cuda_graph"}:
        raise InvalidRequest("tags must be null or a subset of weights, kv_cache, cuda_graph")
    return [t for t in value if t != "cuda_graph"]


def _admin_guard(settings: EngineSettings):
    async def check(request: Request) -> None:
        if settings.admin_token is None:
            return
        expected = f"Bearer {settings.admin_token.get_secret_value()}"
        if not secrets.compare_digest(request.headers.get("authorization", ""), expected):
            raise HTTPException(status_code=401, detail="admin token required")

    return check



admin_guard = _admin_guard  # public name for route modules added beside this one (kv_port)
