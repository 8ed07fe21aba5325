"""The one rule for the temperature a sampled token's logprob is taken under (shared by
the sampler, the proxy's record and so the trainer): SGLang's."""

from __future__ import annotations

import torch

from services.engine.params import GREEDY_TEMPERATURE_EPS, logprob_temperature, parse_sampling_params
from services.engine.sampler import SampleSpec, sample


def test_the_rule():
    assert logprob_temperature(None) == 1.0  # not sent: the default
    assert logprob_temperature(0.0) == logprob_temperature(GREEDY_TEMPERATURE_EPS / 2) == 1.0  # greedy
    assert logprob_temperature(GREEDY_TEMPERATURE_EPS) == GREEDY_TEMPERATURE_EPS
    assert logprob_temperature(0.7) == 0.7 and logprob_temperature(1.8) == 1.8
    # top_k 1 picks the argmax, but its logprob stays tempered (SGLang keeps temperature 0.7)
    params = parse_sampling_params({"temperature": 0.7, "top_k": 1})
    assert params.greedy and params.logprob_temperature == 0.7
    assert parse_sampling_params({"temperature": 0}).logprob_temperature == 1.0


def test_the_sampler_tempers_a_top_k_1_pick_and_its_top_logprobs():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    spec = SampleSpec(parse_sampling_params({"temperature": 0.7, "top_k": 1}), True, None, top_n=2)
    tokens, logprobs, tops = sample(logits.clone(), [spec], 4)
    expect = torch.log_softmax(logits[0] / 0.7, -1)
    assert tokens == [0]
    assert abs(logprobs[0] - float(expect[0])) < 1e-6
    assert [round(v, 5) for v, _, _ in tops[0]] == [round(float(expect[0]), 5), round(float(expect[1]), 5)]
