"""The sampler's cuts and logprobs (services/engine/sampler.py) on hand-made logits."""

from __future__ import annotations

import math
from collections import Counter

import torch

from services.engine.params import parse_sampling_params
from services.engine.sampler import SampleSpec, new_generator, sample

# probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 over five ids, then padding rows
PROBS = [0.5, 0.25, 0.125, 0.0625, 0.0625]
LOGITS = torch.tensor([[math.log(p) for p in PROBS] + [5.0, 5.0]])  # ids 5, 6: padding beyond vocab_limit
VOCAB = 5


def _draws(n: int = 400, **params) -> Counter:
    spec = SampleSpec(parse_sampling_params(params), want_logprob=False, generator=new_generator(7))
    return Counter(sample(LOGITS.clone(), [spec], VOCAB)[0][0] for _ in range(n))


def test_picks_stay_inside_the_cuts_and_never_on_padding():
    assert set(_draws(temperature=1.0)) == {0, 1, 2, 3, 4}  # padding ids 5, 6 never drawn
    assert set(_draws(temperature=1.0, top_k=2)) == {0, 1}
    assert set(_draws(temperature=1.0, top_p=0.7)) == {0, 1}  # 0.5 + 0.25 is the smallest set holding 0.7
    assert set(_draws(temperature=1.0, min_p=0.3)) == {0, 1}  # p >= 0.3 * 0.5
    draws = _draws(2000, temperature=1.0)
    assert abs(draws[0] / 2000 - 0.5) < 0.05 and abs(draws[1] / 2000 - 0.25) < 0.05


def test_greedy_ignores_the_padding_rows_and_seeded_draws_repeat():
    spec = SampleSpec(parse_sampling_params({"temperature": 0}), want_logprob=True, generator=None)
    tokens, logprobs, _ = sample(LOGITS.clone(), [spec], VOCAB)
    assert tokens == [0]
    # normalised over the whole output, padding rows included (as a trainer computes it)
    assert abs(logprobs[0] - torch.log_softmax(LOGITS[0], -1)[0].item()) < 1e-6
    assert _draws(50, temperature=1.0) == _draws(50, temperature=1.0)


def test_logprobs_are_of_the_temperature_scaled_distribution_before_the_cuts():
    spec = SampleSpec(parse_sampling_params({"temperature": 0.5, "top_k": 2}), want_logprob=True,
                      generator=new_generator(3), top_n=2)
    tokens, logprobs, tops = sample(LOGITS.clone(), [spec], VOCAB)
    want = torch.log_softmax(LOGITS[0] / 0.5, -1)
    assert abs(logprobs[0] - want[tokens[0]].item()) < 1e-6
    assert [t[1] for t in tops[0]] == [0, 1] and abs(tops[0][0][0] - want[0].item()) < 1e-6
