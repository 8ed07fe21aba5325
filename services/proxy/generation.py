"""Run one generation on the inference cells, surviving a cell that fails mid-call.

Streams SGLang ``/generate`` chunks (cumulative ``output_ids`` and logprobs) from the cell
the router picks. If the cell fails (connection error, 5xx) or aborts the request (it is
being drained or switched), the generation continues on another active cell from the
same input ids plus the tokens already produced, so the caller sees one uninterrupted
answer and the record holds each token's real logprob and weight version. The failed
attempt is aborted on its cell (best effort), so a cell that is only slow does not keep
generating for nobody. A cell that refuses the request itself (a 4xx) ends the call:
another cell would refuse it too.

When no cell is left to try (every active one failed the call, or none is active), the
caller's ``again`` decides: it may wait (a streamed call that has shown nothing yet waits
for a cell, see ``ProxyService``) and answer True, and the call tries every active cell
again, still from the tokens already produced.

A stop the caller's ``resume`` calls false (the proxy's own ``</tool_call>`` stop written
inside the model's thinking, where it closes no call) does not end the generation either:
it goes on, on the same cell, from the tokens produced so far (the cell's prefix cache
holds them), as one answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from .core.routing import NoCellAvailable, Router

log = logging.getLogger(__name__)


class CellClient(Protocol):
    def generate_stream(self, input_ids: list[int], sampling_params: dict[str, Any] | None = None, *,
                        return_logprob: bool = True, rid: str | None = None) -> AsyncIterator[dict]: ...

    async def abort(self, rid: str | None = None) -> dict: ...

    async def health(self) -> bool: ...


@dataclass
class Piece:
    """New output tokens from one chunk."""

    ids: list[int]
    logprobs: list[float]
    weight_version: int
    cell: str
    top_logprobs: list[list] = field(default_factory=list)  # per token, when asked for: [[logprob, id, text], ...]


@dataclass
class Outcome:
    finish_reason: str = "length"  # stop | length | abort
    matched_stop: Any = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cells: list[str] = field(default_factory=list)


class CellFailure(RuntimeError):
    pass


class CellRejected(RuntimeError):
    """The cell refused the request (4xx): the caller's problem, not the cell's."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


_aborts: set[asyncio.Task] = set()
ABORT_TIMEOUT_S = 5.0
MAX_RESUMES = 64  # false stops one call goes on after (each one needs new tokens anyway)


def _version(meta: dict[str, Any]) -> int:
    v = meta.get("weight_version", 0)
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


async def generate(router: Router, clients: dict[str, CellClient], session: str, rid: str, input_ids: list[int],
                   sampling: dict[str, Any], outcome: Outcome, *, max_attempts: int = 4,
                   again: Callable[[str], Awaitable[bool]] | None = None,
                   top_logprobs: int = 0,
                   resume: Callable[[list[int], Any], Awaitable[bool]] | None = None) -> AsyncIterator[Piece]:
    """Yield output pieces until the generation finishes; fill ``outcome`` at the end.

    At most ``max_attempts`` cells are tried, each once; then (or when no active cell is
    left to try) ``await again(why)`` says whether to try them all once more (it waits
    first), else CellFailure. Attempt ``n`` runs as request ``{rid}-{n}`` on the cell
    ``outcome.cells[n]``. ``top_logprobs`` > 0 asks each cell for that many likeliest
    tokens at every output position (``Piece.top_logprobs``). ``resume(produced, matched)``,
    asked when a cell stops at a stop string (``matched``) after new tokens: True goes on
    generating from there (the stop was not one; at most ``MAX_RESUMES`` times)."""
    produced: list[int] = []
    resumes = 0
    budget = int(sampling.get("max_new_tokens", 128))
    tried: set[str] = set()
    attempt = 0  # over the whole call: each attempt is its own request id
    left = max_attempts  # attempts left in this round
    while True:
        cell = None
        if left > 0:
            try:
                cell = router.pick(session, exclude=tried)
            except NoCellAvailable as exc:
                why = str(exc) if not tried else f"{exc} (failed on {sorted(tried)})"
        else:
            why = f"generation failed on cells {outcome.cells}"
        if cell is None:
            if again is not None and await again(why):
                tried.clear()
                left = max_attempts
                continue
            raise CellFailure(why)
        left -= 1
        outcome.cells.append(cell)
        router.begin(cell)
        resumed = False
        try:
            params = dict(sampling, max_new_tokens=budget - len(produced))
            seen = 0
            top = {"top_logprobs_num": top_logprobs} if top_logprobs else {}  # only then: other clients lack it
            async for chunk in clients[cell].generate_stream(input_ids + produced, params, return_logprob=True,
                                                             rid=f"{rid}-{attempt}", **top):
                ids = chunk.get("output_ids") or []
                meta = chunk.get("meta_info") or {}
                lps = meta.get("output_token_logprobs") or []
                if len(ids) > seen:
                    new = ids[seen:]
                    new_lps = [float(x[0]) if x and x[0] is not None else 0.0 for x in lps[seen:len(ids)]]
                    new_lps += [0.0] * (len(new) - len(new_lps))
                    tops = [t or [] for t in (meta.get("output_top_logprobs") or [])[seen:len(ids)]] \
                        if top_logprobs else []
                    seen = len(ids)
                    produced.extend(new)
                    yield Piece(new, new_lps, _version(meta), cell, tops)
                fin = meta.get("finish_reason")
                if fin:
                    kind = fin.get("type") if isinstance(fin, dict) else str(fin)
                    if attempt == 0 or not outcome.prompt_tokens:
                        outcome.prompt_tokens = int(meta.get("prompt_tokens", len(input_ids)))
                        outcome.cached_tokens = int(meta.get("cached_tokens", 0))
                    if kind == "abort":
                        raise CellFailure(f"cell {cell} aborted the request: {fin}")
                    outcome.finish_reason = kind
                    outcome.matched_stop = fin.get("matched") if isinstance(fin, dict) else None
                    if kind == "stop" and resume is not None and seen and resumes < MAX_RESUMES \
                            and len(produced) < budget and await resume(produced, outcome.matched_stop):
                        resumes += 1
                        resumed = True
                        break
                    return
            if not resumed:
                raise CellFailure(f"cell {cell} closed the stream without finishing")
        except (httpx.TransportError, CellFailure) as exc:
            _note_failure(router, cell, exc)
            _abort_later(clients[cell], f"{rid}-{attempt}")
            tried.add(cell)
        except Exception as exc:
            status = getattr(exc, "status", 0)
            if isinstance(status, int) and 400 <= status < 500:
                raise CellRejected(status, str(getattr(exc, "message", exc))) from exc
            _note_failure(router, cell, exc)
            _abort_later(clients[cell], f"{rid}-{attempt}")
            tried.add(cell)
        finally:
            router.end(cell)
        attempt += 1
        if resumed:  # not a failure: the same cell goes on (it is not excluded)
            left += 1
            continue
        if len(produced) >= budget:
            outcome.finish_reason = "length"
            return


def _note_failure(router: Router, cell: str, exc: BaseException) -> None:
    c = router.cells.get(cell)
    if c is not None and c.state.value == "active" and not isinstance(exc, CellFailure):
        router.mark_down(cell)
    log.warning("cell %s failed a generation (%s); continuing elsewhere", cell, exc)


def _abort_later(client: CellClient, rid: str) -> None:
    """Tell a failed cell to drop the attempt, without holding up the retry elsewhere."""

    async def run() -> None:
        try:
            await asyncio.wait_for(client.abort(rid), ABORT_TIMEOUT_S)
        except Exception as exc:  # the cell may be gone: nothing left to stop
            log.info("abort of %s after a failure did not reach the cell: %r", rid, exc)

    task = asyncio.get_running_loop().create_task(run())
    _aborts.add(task)
    task.add_done_callback(_aborts.discard)
