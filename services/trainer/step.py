"""One micro-step's gradients, and one step's reduction and update (pure: torch only).

``compute_micro_step`` runs forward + backward on one batch and returns the gradient of
``sum_t weight_t loss_t`` (flattened, parameter order of the backend) with the loss
statistics. ``StepReducer`` is the core's side: it adds the gradients of the current
weight version, refuses stale ones, divides by the step's execution count and applies
one optimizer update, or none when the loss is not finite. An execution counts by the
share of its trained tokens the step kept: 1 when every piece of it was trained, less
when a piece was refused (too stale, a missing blob), so its kept tokens weigh as in a
whole execution and do not dilute the others'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from .attention import AttentionConfig
from .backends.base import PolicyBackend
from .batch import TreeBatch
from .objective import ObjectiveConfig, token_losses, weighted_sum


@dataclass(frozen=True)
class TrainConfig:
    objective: ObjectiveConfig = ObjectiveConfig()
    attention: AttentionConfig = AttentionConfig()
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float | None = 1.0


@dataclass(frozen=True)
class MicroResult:
    """What a cell sends the core for one micro-step."""

    micro_step: str
    weight_version: int
    executions: tuple[str, ...]
    loss_sum: float  # sum_t weight_t loss_t
    n_tokens: int
    n_targets: int
    stats: dict[str, float]
    gradient: torch.Tensor | None  # flat fp32, None when the loss was not finite
    # rollout id -> (its trained tokens here, its execution's): ``TreeBatch.shares``; an
    # execution a cell did not report a share for counts whole
    shares: dict[str, tuple[int, int]] = field(default_factory=dict)


def compute_micro_step(backend: PolicyBackend, batch: TreeBatch, config: TrainConfig, *,
                       micro_step: str = "", weight_version: int = 0) -> MicroResult:
    params = [p for _, p in backend.named_parameters()]
    for p in params:
        p.grad = None
    logprobs = backend.target_logprobs(batch, config.attention)
    terms = token_losses(logprobs, batch.behaviour_logprobs.to(logprobs.device),
                         batch.advantages.to(logprobs.device), config.objective)
    loss = weighted_sum(terms, batch.weights.to(logprobs.device))
    value = float(loss.detach())
    gradient = None
    if math.isfinite(value):
        loss.backward()
        gradient = flatten_grads(params)
    w = batch.weights
    stats = {
        "clip_fraction": float((terms.clipped.float().cpu() * w).sum()),
        "ratio_mean": float((terms.ratio.cpu() * w).sum()),
        "kl": float((terms.kl.cpu() * w).sum()),
        "weight": float(w.sum()),  # sum of weights: the executions' share this micro-step covers
    }
    return MicroResult(micro_step, weight_version, batch.executions, value, batch.n_tokens,
                       batch.n_targets, stats, gradient, dict(batch.shares))


def flatten_grads(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float().cpu()
                      for p in params])


def unflatten_into(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    at = 0
    for p in params:
        n = p.numel()
        p.grad = flat[at:at + n].view_as(p).to(p.device, p.dtype).clone()
        at += n
    if at != flat.numel():
        raise ValueError(f"gradient has {flat.numel()} values for {at} parameters")


def make_optimizer(backend: PolicyBackend, config: TrainConfig) -> torch.optim.Optimizer:
    params = [p for _, p in backend.named_parameters()]
    return torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)


@dataclass
class StepReducer:
    """The core's accumulator for one step at one weight version."""

    step: int
    weight_version: int
    gradient: torch.Tensor | None = None
    executions: set[str] = field(default_factory=set)
    used: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    non_finite: list[str] = field(default_factory=list)
    rejected: list[dict] = field(default_factory=list)  # samples refused, with reasons
    loss_sum: float = 0.0
    stat_sums: dict[str, float] = field(default_factory=dict)
    n_tokens: int = 0
    kept: dict[str, int] = field(default_factory=dict)  # rollout id -> its trained tokens added
    totals: dict[str, int] = field(default_factory=dict)  # rollout id -> its execution's trained tokens

    def add(self, result: MicroResult) -> bool:
        """Takes a micro-step's result; False (and noted as dropped) if it is stale."""
        if result.weight_version != self.weight_version:
            self.dropped.append(result.micro_step)
            return False
        if result.micro_step in self.used:
            return True  # a redelivered duplicate: already counted
        self.used.append(result.micro_step)
        self.executions.update(result.executions)
        for rollout, (kept, total) in result.shares.items():
            self.kept[rollout] = self.kept.get(rollout, 0) + int(kept)
            self.totals[rollout] = int(total)
        self.n_tokens += result.n_tokens
        self.loss_sum += result.loss_sum
        for k, v in result.stats.items():
            self.stat_sums[k] = self.stat_sums.get(k, 0.0) + v
        if result.gradient is None:
            if result.executions or not math.isfinite(result.loss_sum):
                self.non_finite.append(result.micro_step)  # else: every sample was rejected
        elif self.gradient is None:
            self.gradient = result.gradient.clone()
        else:
            self.gradient += result.gradient
        return True

    def execution_count(self) -> float:
        """The step's divisor: its executions, each by the share of its trained tokens
        added (exact: an execution with all its pieces counts exactly 1)."""
        count = Fraction(0)
        for rollout in self.executions:
            total = self.totals.get(rollout, 0)
            count += min(Fraction(self.kept.get(rollout, 0), total), Fraction(1)) if total > 0 else Fraction(1)
        return float(count)

    def partial_executions(self) -> list[str]:
        """Executions of which the step trained only some tokens (a piece was refused)."""
        return sorted(r for r in self.executions if 0 < self.totals.get(r, 0) and self.kept.get(r, 0) < self.totals[r])

    def loss_stats(self) -> dict[str, float]:
        n = self.execution_count() or 1.0
        out = {"loss": self.loss_sum / n, "executions": float(len(self.executions)),
               "tokens": float(self.n_tokens), "micro_steps": float(len(self.used))}
        out.update({k: v / n for k, v in self.stat_sums.items() if k != "weight"})
        return out

    def apply(self, backend: PolicyBackend, optimizer: torch.optim.Optimizer, config: TrainConfig) -> bool:
        """One optimizer update with the step's mean gradient; False (weights unchanged)
        when any loss or the gradient is not finite."""
        if self.gradient is None or self.non_finite or not math.isfinite(self.loss_sum):
            return False
        grad = self.gradient / (self.execution_count() or 1.0)
        if not torch.isfinite(grad).all():
            return False
        params = [p for _, p in backend.named_parameters()]
        unflatten_into(params, grad)
        if config.max_grad_norm:
            clip = getattr(backend, "clip_grad_norm", None)  # a sharded backend knows its global norm
            if clip is not None:
                clip(params, config.max_grad_norm)
            else:
                torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return True
