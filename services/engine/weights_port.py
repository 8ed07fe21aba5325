"""Weight updates pulled through the transfer port: an alternative to
``update_weights_from_distributed`` for inference cells.

``POST /gyre/weights/pull {"descriptor", "timeout_s"?, "verify"?}`` (admin): checks every
name and shape of the published snapshot against this model first (nothing moves on a
mismatch), pulls it in one batch (``libs.common.transfer.weights.pull_weights``), then
applies it all at once like a tensor update (inside a begin/end window it is staged)
and takes the descriptor's weight version. A failed pull applies nothing, and inside a
window it drops the window (``WeightManager.guard``).
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request

from libs.common.transfer.weights import WeightsDescriptor, pull_weights

from .params import InvalidRequest
from .http_body import json_body
from .weights import WeightManager, wire_dtype


def add_routes(app: FastAPI, weights: WeightManager, agent_of, admin) -> None:
    """``agent_of()`` gives this process's transfer agent (the KV port's)."""

    @app.post("/gyre/weights/pull", dependencies=[admin])
    async def weights_pull(request: Request) -> dict:
        with weights.guard():  # a failure inside a begin/end window drops the window
            return await _pull(request)

    async def _pull(request: Request) -> dict:
        body = await json_body(request)
        try:
            desc = WeightsDescriptor.from_json(body["descriptor"])
            timeout_s = float(body.get("timeout_s", 300.0))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidRequest(f"descriptor must be a weights descriptor: {exc}") from None
        for spec in desc.tensors:  # refuse before moving a byte
            weights.check(spec.name, spec.shape, wire_dtype(spec.dtype))
        try:
            named = await asyncio.to_thread(pull_weights, desc, agent=agent_of(), verify=body.get("verify"),
                                            timeout_s=timeout_s)
        except Exception as exc:  # TransferFailed, ChecksumMismatch: nothing applied
            raise InvalidRequest(f"weight pull failed, nothing applied: {type(exc).__name__}: {exc}") from None
        checked = weights.check_all(named.items())
        await asyncio.wrap_future(weights.submit(checked, desc.version))
        return {"success": True, "tensors": len(checked), "bytes": desc.nbytes, "weight_version": desc.version}
