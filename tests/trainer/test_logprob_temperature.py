"""The trainer scores a token under the temperature its behaviour logprob was taken under.

The engine (as SGLang) returns ``log_softmax(logits / T)`` of each sampled token; the
trainer divides its logits by the same T (carried per token: CallRecorded ->
tree -> packed tree -> batch), so the ratio exp(l - b) is 1 on-policy at any T.
"""

from __future__ import annotations

from array import array
from dataclasses import replace

import pytest
import torch

from services.engine.params import SamplingParams, logprob_temperature
from services.engine.sampler import SampleSpec, sample
from services.trainer.attention import AttentionConfig
from services.trainer.backends.base import gather_logprobs, tempered_logits
from services.trainer.batch import BadSample, branch_batch, tree_batch, validate_sample
from services.trainer.objective import ObjectiveConfig, token_losses

from .samples import two_branch_tree


def _engine_pick(logits: torch.Tensor, params: SamplingParams, seed: int = 0):
    specs = [SampleSpec(params, True, torch.Generator().manual_seed(seed + i)) for i in range(logits.shape[0])]
    tokens, logprobs, _ = sample(logits.clone(), specs, logits.shape[1])
    return torch.tensor(tokens), torch.tensor(logprobs)


@pytest.mark.parametrize("params", [
    {"temperature": 0.7}, {"temperature": 1.3, "top_p": 0.9}, {"temperature": 0.7, "top_k": 1},
    {"temperature": 0.0}, {"temperature": 1e-7}, {},
], ids=["t0.7", "t1.3-top_p", "t0.7-top_k1", "greedy", "below-eps", "default"])
def test_the_engines_logprobs_and_the_trainers_agree_on_policy(params):
    torch.manual_seed(0)
    logits = torch.randn(16, 50) * 3
    sp = SamplingParams(**params)
    tokens, behaviour = _engine_pick(logits, sp)
    # the temperature the proxy records for the call: the one rule, applied to what it sent
    temp = logprob_temperature(params.get("temperature"))
    assert temp == sp.logprob_temperature
    trainer = gather_logprobs(logits, tokens, torch.full((16,), temp))
    assert torch.allclose(trainer, behaviour, atol=1e-5, rtol=0)
    ratio = torch.exp(trainer - behaviour)
    assert torch.allclose(ratio, torch.ones(16), atol=1e-5)
    terms = token_losses(trainer, behaviour, torch.ones(16), ObjectiveConfig(tis_cap=2.0))
    assert torch.allclose(-terms.loss, torch.ones(16), atol=1e-5)  # TIS weight 1, ratio 1
    if temp != 1.0:  # without the temperature the trainer is off, as before the fix
        assert not torch.allclose(gather_logprobs(logits, tokens), behaviour, atol=1e-3)


def test_a_top_k_1_pick_is_the_argmax_with_a_tempered_logprob_as_in_sglang():
    torch.manual_seed(1)
    logits = torch.randn(4, 30) * 2
    tokens, behaviour = _engine_pick(logits, SamplingParams(temperature=0.7, top_k=1))
    assert tokens.tolist() == logits.argmax(-1).tolist()
    expect = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[:, None])[:, 0]
    assert torch.allclose(behaviour, expect, atol=1e-6)
    # greedy by temperature: untempered (SGLang turns it into temperature 1, top_k 1)
    tokens, behaviour = _engine_pick(logits, SamplingParams(temperature=0.0))
    assert torch.allclose(behaviour, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0], atol=1e-6)


def test_a_mixed_batch_tempers_each_row_by_its_own_temperature():
    torch.manual_seed(2)
    logits = torch.randn(3, 40) * 2
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=0.0), SamplingParams(temperature=1.5)]
    specs = [SampleSpec(p, True, torch.Generator().manual_seed(i)) for i, p in enumerate(params)]
    tokens, behaviour, _ = sample(logits.clone(), specs, 40)
    temps = torch.tensor([p.logprob_temperature for p in params])
    assert temps.tolist() == [0.5, 1.0, 1.5]
    trainer = gather_logprobs(logits, torch.tensor(tokens), temps)
    assert torch.allclose(trainer, torch.tensor(behaviour), atol=1e-5)


def test_tempered_logits_copy_unless_asked_in_place_and_skip_all_ones():
    logits = torch.randn(3, 5)
    assert tempered_logits(logits, None) is logits  # float32, no temperature: no copy
    out = tempered_logits(logits, torch.tensor([0.5, 1.0, 2.0]))
    assert out is not logits and torch.allclose(out * torch.tensor([[0.5], [1.0], [2.0]]), logits)
    half = logits.half()
    own = tempered_logits(half, torch.tensor([0.5, 1.0, 2.0]), in_place=True)  # the float copy, scaled
    assert own.dtype == torch.float32 and torch.equal(half, logits.half())
    shard = torch.randn(3, 1, 5)  # megatron's [t, 1, vocab / tp]: one temperature per target
    scaled = tempered_logits(shard, torch.tensor([0.5, 1.0, 2.0]))
    assert torch.allclose(scaled[:, 0], shard[:, 0] / torch.tensor([[0.5], [1.0], [2.0]]))


def _tempered(p, temps_by_target):
    """``p`` with its trained tokens' logprob temperatures set, in order."""
    it = iter(temps_by_target)
    temps = array("f", [next(it) if m else 1.0 for m in p.loss_mask])
    return replace(p, logprob_temperatures=temps)


def test_the_batch_carries_each_targets_temperature():
    plain = two_branch_tree("r0")
    assert tree_batch([(plain, 1.0)]).target_temperatures is None  # all 1.0: no division at all
    temps = [0.7, 0.7, 0.5, 0.5, 1.0, 1.0, 1.0]  # trained tokens 20 21 22 23 30 31 32
    p = _tempered(plain, temps)
    validate_sample(p, 1.0, 512)
    batch = tree_batch([(p, 1.0), (plain, -1.0)])
    assert batch.target_ids.tolist()[:7] == [20, 21, 22, 23, 30, 31, 32]
    assert torch.allclose(batch.target_temperatures, torch.tensor(temps + [1.0] * 7))
    flat = branch_batch([(p, 1.0)])  # per branch: 20 21 22 23 | 20 21 30 31 32
    assert flat.target_temperatures.tolist() == pytest.approx([0.7, 0.7, 0.5, 0.5, 0.7, 0.7, 1.0, 1.0, 1.0])
    bad = replace(p, logprob_temperatures=array("f", [0.0] * p.n_tokens))
    with pytest.raises(BadSample, match="logprob_temperatures"):
        validate_sample(bad, 1.0)


def _lm_head_logits(backend):
    """Captures the lm head's output (before a backend tempers it)."""
    seen = []
    head = backend.model.lm_head
    handle = head.register_forward_hook(lambda mod, args, out: seen.append(out.detach().clone()))
    return seen, handle


def test_the_torch_backend_scores_under_the_temperature_and_its_gradient_is_right(torch_backend, monkeypatch):
    temps = [0.7, 0.7, 0.5, 0.5, 1.3, 1.3, 1.3]
    p = _tempered(two_branch_tree("r0"), temps)
    batch = tree_batch([(p, 1.0)])
    seen, handle = _lm_head_logits(torch_backend)
    lp = torch_backend.target_logprobs(batch, AttentionConfig())
    handle.remove()
    expect = torch.log_softmax(seen[0] / torch.tensor(temps)[:, None], -1).gather(-1, batch.target_ids[:, None])[:, 0]
    assert torch.allclose(lp.detach(), expect, atol=1e-6)
    params = [q for _, q in torch_backend.named_parameters()]
    (lp * torch.arange(1.0, 8.0)).sum().backward()
    in_place = [q.grad.clone() for q in params]
    for q in params:
        q.grad = None
    from services.trainer.backends import torch_hf

    monkeypatch.setattr(torch_hf, "gather_logprobs",  # the same, out of place
                        lambda logits, targets, temperatures, in_place: gather_logprobs(logits, targets, temperatures))
    (torch_backend.target_logprobs(batch, AttentionConfig()) * torch.arange(1.0, 8.0)).sum().backward()
    for a, q in zip(in_place, params):
        assert torch.allclose(a, q.grad, atol=1e-6)


def test_the_backends_agree_on_tempered_logprobs(torch_backend, megatron_backend, samples):
    tempered = []
    for k, (p, adv) in enumerate(samples):
        n = sum(p.loss_mask)
        tempered.append((_tempered(p, [(0.6, 1.0, 1.4)[(i + k) % 3] for i in range(n)]), adv))
    batch = tree_batch(tempered)
    assert batch.target_temperatures is not None
    with torch.no_grad():
        a = torch_backend.target_logprobs(batch, AttentionConfig())
        b = megatron_backend.target_logprobs(batch, AttentionConfig())
        plain = torch_backend.target_logprobs(tree_batch(samples), AttentionConfig())
    assert torch.allclose(a, b, atol=1e-5)
    assert not torch.allclose(a, plain, atol=1e-3)
    # on-policy behaviour at those temperatures: ratio 1, whatever the backend
    on_policy = [(replace(p, behaviour_logprobs=_behaviour(p, lp)), adv)
                 for (p, adv), lp in zip(tempered, _split(a, tempered))]
    batch = tree_batch(on_policy)
    for backend in (torch_backend, megatron_backend):
        with torch.no_grad():
            lp = backend.target_logprobs(batch, AttentionConfig())
        assert torch.allclose(torch.exp(lp - batch.behaviour_logprobs), torch.ones_like(lp), atol=1e-4)


def _split(lp: torch.Tensor, samples):
    out, at = [], 0
    for p, _ in samples:
        n = sum(p.loss_mask)
        out.append(lp[at : at + n].tolist())
        at += n
    return out


def _behaviour(p, values):
    it = iter(values)
    return array("f", [next(it) if m else 0.0 for m in p.loss_mask])


def test_megatrons_in_place_tempering_keeps_the_gradient_right(megatron_backend, samples, monkeypatch):
    from services.trainer.backends import megatron

    p, adv = samples[0]
    n = sum(p.loss_mask)
    batch = tree_batch([(_tempered(p, [(0.6, 1.4)[i % 2] for i in range(n)]), adv)])
    params = [q for _, q in megatron_backend.named_parameters()]

    def grads():
        for q in params:
            q.grad = None
        lp = megatron_backend.target_logprobs(batch, AttentionConfig())
        (lp * torch.linspace(0.5, 1.5, lp.numel())).sum().backward()
        return lp.detach(), [q.grad.clone() for q in params]

    lp_in_place, in_place = grads()
    monkeypatch.setattr(megatron, "tempered_logits", lambda logits, temps, in_place: tempered_logits(logits, temps))
    lp_copy, copied = grads()
    assert torch.allclose(lp_in_place, lp_copy, atol=1e-6)
    for a, b in zip(in_place, copied):
        assert torch.allclose(a, b, atol=1e-6)
