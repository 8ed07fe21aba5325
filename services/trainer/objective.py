"""The policy objective: clipped PPO/GRPO surrogate against the behaviour logprobs.

Per trained token t (advantage A from the execution's group, behaviour logprob b from
the proxy, current logprob l)::

    r_t    = exp(l_t - b_t)                              ratio against the behaviour policy
    loss_t = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)

With ``tis_cap`` (train/inference mismatch correction, decoupled form) the ratio is
taken against the trainer's own logprobs at the start of the step (``l.detach()``: one
update per step) and the token is reweighted by the truncated importance weight::

    w_t    = min(exp(l_t.detach() - b_t), tis_cap)
    loss_t = -w_t min(r'_t A, clip(r'_t, ...) A),   r'_t = exp(l_t - l_t.detach())

``kl_coef`` > 0 adds ``kl_coef * k3(l, ref)`` per token, ``ref`` being reference
logprobs when given, else the behaviour logprobs (off by default).

``l`` and ``b`` are of the same distribution: the engine returns each token's logprob
under ``softmax(logits / T)`` and the backends divide their logits by that T (per token,
``TreeBatch.target_temperatures``) before the softmax, so r = 1 on-policy. The KL term
sees the same tempered ``l``; reference logprobs, if ever passed, must be taken under the
same temperatures. There is no entropy term.

Normalisation (the trajectory packing's contract): the micro-step returns
``sum_t weight_t loss_t`` (weights are 1/N per execution, shared tokens once); the core
divides the step's sum by the number of executions in the step (each by the share of its
trained tokens the step kept: ``step.StepReducer.execution_count``).

Log-ratios (``l - b`` and the KL's ``ref - l``) are capped at ``LOG_RATIO_MAX`` before
``exp``: float32 overflows past 88.7, and one token whose recorded logprob is far below
the trainer's (-95 against -2) made the ratio inf, the gradient NaN (0 x inf) and the
whole step unapplied. A token capped there is clipped anyway for A > 0 and gets no
gradient for A < 0; tokens below the cap are computed exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOG_RATIO_MAX = 20.0  # exp(20) ~ 4.9e8: far past any clip range, far below float32's limit


@dataclass(frozen=True)
class ObjectiveConfig:
    eps_low: float = 0.2
    eps_high: float = 0.28  # asymmetric upper clip (DAPO's clip-higher); set 0.2 for PPO
    tis_cap: float | None = None  # e.g. 2.0 turns on the truncated IS correction
    kl_coef: float = 0.0


@dataclass(frozen=True)
class TokenTerms:
    """Per-token losses and what the step's statistics are made of."""

    loss: torch.Tensor  # [t], with gradient
    ratio: torch.Tensor  # [t], detached
    clipped: torch.Tensor  # [t] bool, detached: the clipped branch was taken
    kl: torch.Tensor  # [t], detached


def token_losses(logprobs: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor,
                 config: ObjectiveConfig = ObjectiveConfig(), reference: torch.Tensor | None = None) -> TokenTerms:
    if config.tis_cap is not None:
        anchor = logprobs.detach()
        weight = torch.exp((anchor - behaviour).clamp(max=LOG_RATIO_MAX)).clamp(max=config.tis_cap)
    else:
        anchor = behaviour
        weight = torch.ones_like(logprobs)
    ratio = torch.exp((logprobs - anchor).clamp(max=LOG_RATIO_MAX))
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - config.eps_low, 1.0 + config.eps_high) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    loss = -weight * surrogate
    ref = behaviour if reference is None else reference
    delta = (ref - logprobs).clamp(max=LOG_RATIO_MAX)
    kl = torch.exp(delta) - delta - 1.0  # k3 estimator, >= 0
    if config.kl_coef:
        loss = loss + config.kl_coef * kl
    return TokenTerms(loss, ratio.detach(), (clipped < unclipped).detach(), kl.detach())


def weighted_sum(terms: TokenTerms, weights: torch.Tensor) -> torch.Tensor:
    """The micro-step's contribution: sum of weight x token loss (not yet / executions)."""
    return (terms.loss * weights).sum()
