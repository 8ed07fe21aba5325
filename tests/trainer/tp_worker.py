"""Run under ``torch.distributed.run --nproc_per_node=2``: megatron TP=2 on gloo against
the torch backend (same checkpoint) and per-branch training; rank 0 writes a JSON report."""

from __future__ import annotations

import json
import sys

import torch


def main(out: str) -> None:
    import torch.distributed as dist

    from services.trainer.attention import AttentionConfig
    from services.trainer.backends.megatron import MegatronBackend
    from services.trainer.backends.torch_hf import TorchBackend
    from services.trainer.batch import branch_batch, tree_batch
    from services.trainer.step import TrainConfig, compute_micro_step
    from tests.trainer.conftest import TINY
    from tests.trainer.samples import two_branch_tree, with_behaviour, workload_samples

    torch.set_num_threads(1)
    reference = TorchBackend.tiny(TINY)
    mc = MegatronBackend(TINY, tp=2)
    before = {k: v.clone() for k, v in reference.hf_state_dict().items()}
    mc.load_hf_state_dict(before)
    samples = list(zip(workload_samples(TINY.vocab_size), [0.7, -1.1])) + [(two_branch_tree("rx"), 0.5)]
    samples = with_behaviour(samples, reference)
    with torch.no_grad():
        a = reference.target_logprobs(tree_batch(samples), AttentionConfig())
        b = mc.target_logprobs(tree_batch(samples), AttentionConfig())
    tree = compute_micro_step(mc, tree_batch(samples), TrainConfig())
    flat = compute_micro_step(mc, branch_batch(samples), TrainConfig())
    back = mc.hf_state_dict()
    # one update clipped hard (max_grad_norm far below the gradient's norm): both backends
    # must clip by the whole model's norm and land on the same weights
    from services.trainer.step import StepReducer, make_optimizer

    clipped = TrainConfig(lr=1e-2, max_grad_norm=0.05)
    for backend in (reference, mc):
        reducer = StepReducer(0, 0)
        reducer.add(compute_micro_step(backend, tree_batch(samples), clipped, micro_step="m"))
        assert reducer.apply(backend, make_optimizer(backend, clipped), clipped)
    after_ref, after_mc = reference.hf_state_dict(), mc.hf_state_dict()
    report = {
        "rank": dist.get_rank(),
        "logprob_diff": float((a - b).abs().max()),
        "loss_diff": abs(tree.loss_sum - flat.loss_sum),
        "grad_diff": float((tree.gradient - flat.gradient).abs().max()),
        "grad_max": float(tree.gradient.abs().max()),
        "roundtrip_diff": max(float((back[k] - v).abs().max()) for k, v in before.items()),
        "clipped_update_diff": max(float((after_mc[k] - v).abs().max()) for k, v in after_ref.items()),
    }
    reports = [None, None]
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(reports, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
