"""GPU check for the trainer (never run yet: no GPU was lent to the task that wrote it).

    python -m services.trainer.gpu_check --out trainer_gpu_check.json [--bench-preset default]

Records, without asserting: (1) tree == per-branch training on CUDA for both backends
with each attention path (dense, compiled flex with its block mask, blocks), loss and
gradient differences in fp32; (2) megatron-core on CUDA (NCCL, one process) against the
torch backend from one checkpoint; (3) the benchmark on CUDA for both backends (the
preset given; ``default`` is the issue's target scale). Each step is ok/failed with its
detail and time; the JSON is what a closing note quotes.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback


def _step(report: dict, name: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        report[name] = {"ok": True, "detail": fn()}
    except Exception as exc:  # record and go on: the report is the product
        report[name] = {"ok": False, "detail": repr(exc), "trace": traceback.format_exc()[-2000:]}
    report[name]["s"] = round(time.perf_counter() - t0, 2)


def _equality(backend_name: str, mode: str) -> dict:
    import torch

    from services.trajectory.bench import packed_samples

    from .attention import AttentionConfig
    from .backends.torch_hf import TinyModelConfig, TorchBackend
    from .batch import branch_batch, tree_batch
    from .bench import _fold
    from .step import TrainConfig, compute_micro_step

    cfg = TinyModelConfig(vocab_size=4096, hidden_size=128, intermediate_size=256)
    ref = TorchBackend.tiny(cfg)
    ref.model.cuda()
    if backend_name == "megatron":
        from .backends.megatron import MegatronBackend

        model = MegatronBackend(cfg)
        model.load_hf_state_dict({k: v.cpu() for k, v in ref.hf_state_dict().items()})
        model.model.cuda()
    else:
        model = ref
    samples = [(_fold(p, cfg.vocab_size), 1.0 - 2.0 * (i % 2)) for i, p in enumerate(packed_samples("small"))]
    config = TrainConfig(attention=AttentionConfig(mode=mode, block_size=128))
    tree = compute_micro_step(model, tree_batch(samples), config)
    flat = compute_micro_step(model, branch_batch(samples), TrainConfig())
    out = {"loss_diff": abs(tree.loss_sum - flat.loss_sum),
           "grad_diff": float((tree.gradient - flat.gradient).abs().max()),
           "grad_max": float(tree.gradient.abs().max())}
    if backend_name == "megatron":
        with torch.no_grad():
            a = ref.target_logprobs(tree_batch(samples), AttentionConfig())
            b = model.target_logprobs(tree_batch(samples), AttentionConfig())
        out["logprob_diff_vs_torch"] = float((a - b).abs().max())
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="trainer_gpu_check.json")
    parser.add_argument("--bench-preset", default="small")
    args = parser.parse_args()
    import torch

    report: dict = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    for backend in ("torch", "megatron"):
        for mode in ("dense", "flex", "blocks"):
            _step(report, f"equality_{backend}_{mode}", lambda b=backend, m=mode: _equality(b, m))
    from .bench import run_bench

    for backend in ("torch", "megatron"):
        _step(report, f"bench_{backend}", lambda b=backend: run_bench(b, preset=args.bench_preset, device="cuda",
                                                                      repeats=3))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v.get("ok") if isinstance(v, dict) else v for k, v in report.items()}))


if __name__ == "__main__":
    main()
