"""``gyre bench train --backend megatron|torch --json``: tree-packed vs per-branch training.

One step on the same selected samples (the tree benchmark's generator,
:func:`services.trajectory.bench.packed_samples`), a small Qwen2-shaped model, one
micro-step per execution: once as packed trees (tree attention), once with every selected
branch on its own, packed end to end without padding (the flat baseline; shared
trained tokens weighted 1/k so both compute the same loss). Both start from the same
weights; the time covers forward, backward and the reduction of the step's gradients.

Fields (issue 6): ``tree_tokens``, ``flat_tokens``, ``token_ratio``, ``tree_step_s``,
``flat_step_s``, ``speedup`` (flat / tree time), ``max_abs_loss_diff`` (step loss,
fp32), ``backend``; extras explain the run (``max_abs_grad_diff``, model size, preset,
and ``long_micro_steps`` / ``flat_long_micro_steps``: micro-steps over the attention's
``dense_max_tokens``, which use block-sparse attention (flex on GPU) instead of one dense
mask; with the defaults the trees stay dense and the longer flat micro-steps do not).

Options: ``preset`` (``small``, the default preset's shape at 1/40 of its token sizes
with 2 rollouts: the same calls, compactions and fork points, about 7k tree tokens per
execution, which a 2-core machine trains in about a minute; ``default`` is the issue's
target scale and needs a GPU), any workload override
accepted by ``packed_samples``, ``budget`` (branches per execution, 5), ``vocab`` (4096:
the workload's ids in [0, 65536) are folded into it, the same for both sides),
``hidden``, ``layers``, ``attention`` (``auto`` | ``dense`` | ``blocks`` | ``flex``),
``repeats`` (best of N, 1), ``device``.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import replace

import torch

from services.trajectory.bench import packed_samples
from services.trajectory.packing import PackedTree

from .attention import AttentionConfig
from .backends.torch_hf import TinyModelConfig
from .batch import TreeBatch, branch_batch, tree_batch, validate_sample
from .step import StepReducer, TrainConfig, compute_micro_step


def run_bench(backend: str = "torch", **opts) -> dict:
    preset = opts.pop("preset", "small")
    vocab = int(opts.pop("vocab", 4096))
    hidden = int(opts.pop("hidden", 64))
    model_cfg = TinyModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                num_layers=int(opts.pop("layers", 2)))
    config = TrainConfig(attention=AttentionConfig(mode=opts.pop("attention", "auto")))
    repeats = int(opts.pop("repeats", 1))
    device = opts.pop("device", "cpu")
    budget = int(opts.pop("budget", 5))
    torch.set_num_threads(int(opts.pop("threads", torch.get_num_threads())))
    samples = [(_fold(p, vocab), adv) for p, adv in _with_advantages(packed_samples(preset, budget=budget, **opts))]
    for p, adv in samples:
        validate_sample(p, adv, vocab)
    model = _backend(backend, model_cfg, device)
    samples = [(_on_policy(p, adv * (1.0 + 0.5 * k), model, config), adv * (1.0 + 0.5 * k))
               for k, (p, adv) in enumerate(samples)]
    trees = [tree_batch([s]) for s in samples]
    flats = [branch_batch([s]) for s in samples]
    _run_step(model, trees[:1], config)  # warm-up: first-call allocations
    tree_s, tree_red = _best(model, trees, config, repeats)
    flat_s, flat_red = _best(model, flats, config, repeats)
    n = max(1, len(tree_red.executions))
    tree_tokens = sum(b.n_tokens for b in trees)
    flat_tokens = sum(b.n_tokens for b in flats)
    return {
        "backend": backend,
        "tree_tokens": tree_tokens,
        "flat_tokens": flat_tokens,
        "token_ratio": round(flat_tokens / max(1, tree_tokens), 3),
        "tree_step_s": round(tree_s, 4),
        "flat_step_s": round(flat_s, 4),
        "speedup": round(flat_s / max(1e-9, tree_s), 3),
        "max_abs_loss_diff": abs(tree_red.loss_sum - flat_red.loss_sum) / n,
        "max_abs_grad_diff": float((tree_red.gradient - flat_red.gradient).abs().max()) / n,
        "step_loss": tree_red.loss_sum / n,
        "preset": preset,
        "executions": n,
        "micro_steps": len(trees),
        "trained_tokens": sum(b.n_targets for b in trees),
        "flat_trained_tokens": sum(b.n_targets for b in flats),
        "long_micro_steps": sum(t.n_tokens > config.attention.dense_max_tokens for t in trees),
        "flat_long_micro_steps": sum(f.n_tokens > config.attention.dense_max_tokens for f in flats),
        "model": {"vocab": vocab, "hidden": model_cfg.hidden_size, "layers": model_cfg.num_layers,
                  "params": sum(p.numel() for _, p in model.named_parameters())},
        "threads": torch.get_num_threads(),
        "device": device,
    }


def _backend(name: str, cfg: TinyModelConfig, device: str):
    if name == "torch":
        from .backends.torch_hf import TorchBackend

        b = TorchBackend.tiny(cfg)
        b.model.to(device)
        return b
    if name == "megatron":
        from .backends.megatron import MegatronBackend
        from .backends.torch_hf import TorchBackend

        b = MegatronBackend(cfg)
        b.load_hf_state_dict(TorchBackend.tiny(cfg).hf_state_dict())  # the same start as torch
        b.model.to(device)
        return b
    raise ValueError(f"unknown backend {name!r} (torch | megatron)")


def _with_advantages(packed: list[PackedTree]) -> list[tuple[PackedTree, float]]:
    """Alternating +1/-1 per execution (a group's normalised advantages for 0/1 scores)."""
    rollouts = list(dict.fromkeys(p.rollout_id for p in packed))
    adv = {r: (1.0 if i % 2 == 0 else -1.0) for i, r in enumerate(rollouts)}
    return [(p, adv[p.rollout_id]) for p in packed]


def _on_policy(p: PackedTree, adv: float, model, config: TrainConfig) -> PackedTree:
    """Behaviour logprobs = the model's own, give or take 0.1 (the workload's are
    synthetic): ratios near 1, some clipped, so every token's loss depends on the model."""
    with torch.no_grad():
        lp = model.target_logprobs(tree_batch([(p, adv)]), config.attention).cpu().tolist()
    blp = array("f", p.behaviour_logprobs)
    trained = [i for i, m in enumerate(p.loss_mask) if m]
    for k, (i, v) in enumerate(zip(trained, lp)):
        blp[i] = min(0.0, v + (0.1 if k % 3 == 0 else -0.1))
    return replace(p, behaviour_logprobs=blp)


def _fold(p: PackedTree, vocab: int) -> PackedTree:
    return replace(p, token_ids=array("i", [t % vocab for t in p.token_ids]))


def _run_step(model, batches: list[TreeBatch], config: TrainConfig) -> StepReducer:
    reducer = StepReducer(step=0, weight_version=0)
    for k, batch in enumerate(batches):
        reducer.add(compute_micro_step(model, batch, config, micro_step=f"m{k}"))
    return reducer


def _best(model, batches, config, repeats) -> tuple[float, StepReducer]:
    best, reducer = float("inf"), None
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        reducer = _run_step(model, batches, config)
        best = min(best, time.perf_counter() - t0)
    return best, reducer
