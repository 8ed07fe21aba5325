"""An execution split into pieces of which one is refused (here: too stale; the same
holds for a missing blob) counts in the step's divisor by the share of its trained tokens
the step kept, not as a whole execution: its kept tokens weigh as in a whole execution,
and an execution with all its pieces still counts exactly 1 (the step is unchanged)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from libs.common.events import MicroStepDone, MicroStepQueued
from services.trainer.backends.torch_hf import TinyModelConfig, TorchBackend
from services.trainer.batch import tree_batch
from services.trainer.step import MicroResult, StepReducer, TrainConfig, compute_micro_step
from services.trainer.worker import load_samples, result_from_done
from services.trajectory.codec import encode_packed, sha256_hex
from services.trajectory.forks import HARNESS_RULES
from services.trajectory.records import CallRecord
from services.trajectory.rollout_tree import RolloutTree, TreeConfig

PROMPT = list(range(1, 11))


def pieces(rollout: str, max_piece_tokens: int | None, versions=(0, 3)):
    """A 10-token prompt answered twice (a fork at the prompt): 40 tokens at v0, 40 at v3."""
    tree = RolloutTree(rollout, TreeConfig(rules=HARNESS_RULES["generic"], max_piece_tokens=max_piece_tokens))
    tree.add(CallRecord(f"{rollout}-a", rollout, PROMPT, list(range(100, 140)), [-1.0] * 40,
                        weight_version=versions[0]))
    tree.add(CallRecord(f"{rollout}-b", rollout, PROMPT, list(range(200, 240)), [-1.0] * 40,
                        weight_version=versions[1]))
    return tree.seal().packed


class Blobs:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    async def put(self, b: bytes) -> str:
        self.data[sha256_hex(b)] = b
        return sha256_hex(b)

    async def get(self, k: str) -> bytes:
        return self.data[k]


async def reduce(packed_by_step, backend, *, max_staleness):
    """One micro-step per piece, through the worker's loading and the core's reducer."""
    blobs, red = Blobs(), StepReducer(0, 3)
    for k, p in enumerate(packed_by_step):
        ev = MicroStepQueued(run_id="x", step=0, micro_step=f"m{k}", group_id="g", advantages=[1.0], n_tokens=1,
                             sample_digests=[await blobs.put(encode_packed(p))])
        good, rejected = await load_samples(blobs, ev, backend.vocab_size, 3, max_staleness)
        red.rejected.extend(rejected)
        red.add(compute_micro_step(backend, tree_batch(good), TrainConfig(), micro_step=ev.micro_step,
                                   weight_version=3) if good else MicroResult(ev.micro_step, 3, (), 0.0, 0, 0, {}, None))
    return red


@pytest.fixture(scope="module")
def backend():
    torch.manual_seed(0)
    return TorchBackend.tiny(TinyModelConfig())


def test_a_refused_piece_leaves_its_execution_counted_by_the_share_kept(backend) -> None:
    split = pieces("r0", 50)
    assert len(split) == 2 and [p.n_execution_trained_tokens for p in split] == [80, 80]
    other = pieces("r1", None, versions=(3, 3))  # a whole execution, all fresh
    red = asyncio.run(reduce([*split, *other], backend, max_staleness=2))
    assert len(red.rejected) == 1 and "more than 2 versions" in red.rejected[0]["reason"]
    assert red.executions == {"r0", "r1"} and red.partial_executions() == ["r0"]
    assert red.execution_count() == 1.5  # r1 whole, r0 by 40 of its 80 trained tokens
    assert red.loss_stats()["loss"] == pytest.approx(red.loss_sum / 1.5)
    # the gradient applied is the sum over the executions' share, not over 2
    flat = red.gradient.clone()
    params = [p for _, p in backend.named_parameters()]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=1.0)
    assert red.apply(backend, opt, TrainConfig(max_grad_norm=None))
    moved = torch.cat([(b - p.detach()).reshape(-1) for b, p in zip(before, params)])
    assert torch.allclose(moved, flat / 1.5, atol=1e-6)
    with torch.no_grad():
        for b, p in zip(before, params):
            p.copy_(b)


def test_an_execution_with_all_its_pieces_counts_exactly_one(backend) -> None:
    red = asyncio.run(reduce(pieces("r0", 50), backend, max_staleness=None))
    assert red.rejected == [] and red.partial_executions() == []
    assert red.execution_count() == 1.0 == len(red.executions)
    assert red.kept == {"r0": 80} and red.totals == {"r0": 80}


def test_a_satellites_result_carries_its_shares_to_the_core(backend) -> None:
    class NoGradients:
        async def get(self, key):
            raise AssertionError("not asked: no transfer in the descriptor")

    done = MicroStepDone(run_id="x", step=0, micro_step="m0", cell="c1", weight_version=3, n_tokens=50, loss=0.0,
                         gradient={"rejected": [], "executions": ["r0"], "stats": {}, "finite": False,
                                   "shares": {"r0": [40, 80]}})
    res = asyncio.run(result_from_done(done, NoGradients()))
    assert res.shares == {"r0": (40, 80)}
    older = MicroStepDone(run_id="x", step=0, micro_step="m1", cell="c1", weight_version=3, n_tokens=50, loss=0.0,
                          gradient={"rejected": [], "executions": ["r1"], "stats": {}, "finite": False})
    red = StepReducer(0, 3)
    red.add(res)
    red.add(asyncio.run(result_from_done(older, NoGradients())))  # a cell that reports no shares
    assert red.execution_count() == 1.5  # r0 by half, r1 (no share said) whole, as before
