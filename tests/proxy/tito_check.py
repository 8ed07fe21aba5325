"""Reconstruct what the proxy recorded and compare it with what the cells saw."""

from __future__ import annotations

from dataclasses import dataclass

from libs.common.blobs import decode_tokens
from libs.common.events import CallRecorded, Context


@dataclass
class Recorded:
    event: CallRecorded
    input_ids: list[int]
    output_ids: list[int]


async def recorded_calls(bus, blobs, run_id: str) -> dict[str, Recorded]:
    out: dict[str, Recorded] = {}
    async for d in bus.read(Context.CALLS, filter_subject=f"gyre.{run_id}.calls.CallRecorded.>"):
        ev = d.event
        new = decode_tokens(await blobs.get(ev.new_input_digest))
        outp = decode_tokens(await blobs.get(ev.output_digest))
        prefix: list[int] = []
        if ev.parent_call_id is not None:
            parent = out[ev.parent_call_id]
            prefix = (parent.input_ids + parent.output_ids)[: ev.prefix_len]
        out[ev.call_id] = Recorded(ev, prefix + new, outp)
    return out


def engine_view(engines) -> dict[str, tuple[list[int], list[int]]]:
    """call id -> (input ids the cell got, output ids it produced), first attempt only."""
    seen: dict[str, tuple[list[int], list[int]]] = {}
    for e in engines:
        for rid, pair in e.by_rid.items():
            call_id, _, attempt = rid.rpartition("-")
            if attempt == "0":
                seen[call_id] = pair
    return seen


def check_exact(recorded: dict[str, Recorded], seen: dict[str, tuple[list[int], list[int]]]) -> None:
    for call_id, rec in recorded.items():
        got_in, got_out = seen[call_id]
        assert rec.input_ids == got_in, f"call {call_id}: recorded input differs from what the cell received"
        assert rec.output_ids == got_out, f"call {call_id}: recorded output differs from what the cell produced"
        ev = rec.event
        if ev.parent_call_id is not None:
            p_in, p_out = seen[ev.parent_call_id]
            assert got_in[: ev.prefix_len] == (p_in + p_out)[: ev.prefix_len], "reused span is not the cell's own ids"
