"""The clipped objective by hand, bad samples refused with their reason, and a
non-finite loss that leaves the weights alone."""

from __future__ import annotations

import math
from array import array
from dataclasses import replace

import pytest
import torch

from services.trainer.batch import BadSample, tree_batch, validate_sample
from services.trainer.objective import ObjectiveConfig, token_losses
from services.trainer.step import StepReducer, TrainConfig, compute_micro_step, make_optimizer

from .samples import two_branch_tree


def test_clipped_surrogate_by_hand():
    behaviour = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    current = torch.log(torch.tensor([0.75, 0.75, 0.25, 0.25])).requires_grad_()  # ratios 1.5, 1.5, .5, .5
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    t = token_losses(current, behaviour, adv, ObjectiveConfig(eps_low=0.2, eps_high=0.28))
    # A>0, r=1.5: clipped to 1.28; A<0, r=1.5: -1.5 (unclipped is smaller); A>0, r=.5: .5; A<0, r=.5: -.8
    assert t.loss.tolist() == pytest.approx([-1.28, 1.5, -0.5, 0.8])
    assert t.clipped.tolist() == [True, False, False, True]
    t.loss.sum().backward()
    assert current.grad.tolist() == pytest.approx([0.0, 1.5, -0.5, 0.0])  # clipped tokens carry no gradient


def test_truncated_importance_sampling_and_kl():
    behaviour = torch.log(torch.tensor([0.1, 0.5]))
    current = torch.log(torch.tensor([0.5, 0.25]))
    t = token_losses(current, behaviour, torch.tensor([1.0, 1.0]), ObjectiveConfig(tis_cap=2.0))
    # ratio against the trainer's own logprobs is 1; weights min(5, 2) = 2 and 0.5
    assert t.loss.tolist() == pytest.approx([-2.0, -0.5])
    k = token_losses(current, behaviour, torch.tensor([0.0, 0.0]), ObjectiveConfig(kl_coef=0.5))
    d = behaviour - current
    assert k.loss.tolist() == pytest.approx((0.5 * (torch.exp(d) - d - 1)).tolist())


def test_loss_weights_count_each_execution_once():
    batch = tree_batch([(two_branch_tree("a"), 1.0), (two_branch_tree("b"), 1.0)])
    assert batch.executions == ("a", "b")
    assert float(batch.weights.sum()) == pytest.approx(2.0)  # each execution sums to 1


@pytest.mark.parametrize("change, reason", [
    (lambda p: replace(p, position_ids=array("i", [0, 1, 2, 3, 4, 5, 6, 6, 7, 8])), "position_ids[7] = 6"),
    (lambda p: replace(p, parent_index=array("i", [-1, 0, 1, 2, 3, 4, 5, 3, 7, 8])), "segment 2's first token"),
    (lambda p: replace(p, loss_mask=bytes([0, 0, 0, 1, 1, 1, 1, 1, 1, 0])), "loss_weights[9]"),
    (lambda p: replace(p, behaviour_logprobs=array("f", [0.0] * 3 + [float("nan")] * 7)), "behaviour_logprobs[3]"),
    (lambda p: replace(p, token_ids=array("i", [1, 2, 5, 20, 21, 22, 23, 30, 31, 9999])), "outside the vocabulary"),
    (lambda p: replace(p, weight_versions=array("i", [0] * 9)), "weight_versions has 9 entries"),
    (lambda p: replace(p, segments=p.segments[:2] + (replace(p.segments[2], depth=7),)), "segment 2 has depth 7"),
])
def test_bad_samples_are_refused_with_the_reason(change, reason):
    validate_sample(two_branch_tree(), 1.0, 512)
    with pytest.raises(BadSample, match=reason.replace("[", r"\[").replace("]", r"\]")):
        validate_sample(change(two_branch_tree()), 1.0, 512)
    with pytest.raises(BadSample, match="advantage"):
        validate_sample(two_branch_tree(), math.nan, 512)


def test_non_finite_loss_skips_the_update(torch_backend):
    config = TrainConfig()
    optimizer = make_optimizer(torch_backend, config)
    before = {k: v.clone() for k, v in torch_backend.hf_state_dict().items()}
    good = compute_micro_step(torch_backend, tree_batch([(two_branch_tree("a"), 1.0)]), config, micro_step="m0")
    with torch.no_grad():
        torch_backend.model.model.norm.weight[0] = float("nan")
    bad = compute_micro_step(torch_backend, tree_batch([(two_branch_tree("b"), 1.0)]), config, micro_step="m1")
    with torch.no_grad():
        torch_backend.model.model.norm.weight[0] = before["model.norm.weight"][0]
    assert bad.gradient is None and math.isnan(bad.loss_sum)
    reducer = StepReducer(0, 0)
    reducer.add(good)
    reducer.add(bad)
    assert not reducer.apply(torch_backend, optimizer, config)
    assert reducer.non_finite == ["m1"]
    after = torch_backend.hf_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("advantage", [0.0, 1.0, -1.0])
@pytest.mark.parametrize("config", [ObjectiveConfig(), ObjectiveConfig(tis_cap=2.0, kl_coef=0.1)])
def test_a_far_off_behaviour_logprob_leaves_loss_and_gradient_finite(advantage, config):
    """exp(-2 - -95) overflows float32: the ratio was inf, the gradient NaN (0 x inf), and
    the whole step went unapplied for one token. The log-ratio is capped before exp; the
    other token's loss and gradient are what they were."""
    logprobs = torch.tensor([-2.0, -1.0], requires_grad=True)
    behaviour = torch.tensor([-95.0, -1.2])
    terms = token_losses(logprobs, behaviour, torch.full((2,), advantage), config)
    total = (terms.loss * torch.full((2,), 0.5)).sum()
    total.backward()
    assert math.isfinite(float(total)) and torch.isfinite(logprobs.grad).all(), (float(total), logprobs.grad)
    assert torch.isfinite(terms.ratio).all() and torch.isfinite(terms.kl).all()
    alone = torch.tensor([-1.0], requires_grad=True)  # the ordinary token on its own: unchanged
    ref = token_losses(alone, behaviour[1:], torch.full((1,), advantage), config)
    (ref.loss * 0.5).sum().backward()
    assert terms.loss[1].item() == pytest.approx(ref.loss[0].item())
    assert logprobs.grad[1].item() == pytest.approx(alone.grad[0].item())
