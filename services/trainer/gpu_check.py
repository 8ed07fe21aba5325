"""GPU check for the trainer: the CUDA paths a CPU machine cannot run, recorded as a report.

    python -m services.trainer.gpu_check --out trainer_gpu_check.json [--device cuda]
        [--bench-preset small] [--default-bench torch,megatron] [--skip STEP,...]

Records, without asserting (each step ok/failed with its detail and seconds; the JSON is
rewritten after every step, so a run cut short keeps what it measured):

1. ``equality_<backend>_<mode>``: tree == per-branch training for both backends with each
   attention path (dense, compiled flex with the segment-table block mask, blocks): loss
   and gradient differences in fp32; megatron's logprobs against the torch backend's from
   one checkpoint (megatron-core on CUDA, NCCL, one process).
2. ``attention_speed``: tree attention forward + backward in bf16 (8 heads, head dim 64)
   on the workload's trees, small (7.7k tokens) and default (about 300k) and a default
   per-branch batch (about 970k): flex against blocks and dense where they fit, and
   against causal flash SDPA over the same number of tokens; ``pairs`` counts the
   (query, key) pairs the tree lets attend, ``tflops`` is 4·d·h·pairs·3.5 per second.
3. ``flex_series_<backend>``: twelve micro-steps of new sizes with the no-grad logprob
   pass between them, as a long-running trainer does: the compiled flex kernel must be
   reused (each step reports ``compiled_graphs``; the compile cache is reset per step).
3b. ``bench_<backend>``: ``gyre bench train`` on the device for the ``--bench-preset``.
4. ``nccl_broadcast``: a two-process NCCL broadcast of 256 MB (the weight path to SGLang
   cells) on two GPUs; on one GPU a one-rank group (NCCL refuses two ranks on one device).
5. ``bench_default_<backend>``: the issue's target scale (``default`` preset) for each
   backend named in ``--default-bench``.

``--device cpu`` runs the same steps on CPU (a smoke test of this script; flex has no
backward there and is recorded as failed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback


def _compiled_graphs() -> int:
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _step(report: dict, name: str, fn, out: str) -> None:
    import torch._dynamo

    torch._dynamo.reset()  # each step stands for its own trainer process: a fresh compile cache
    t0 = time.perf_counter()
    graphs = _compiled_graphs()
    try:
        report[name] = {"ok": True, "detail": fn()}
    except Exception as exc:  # record and go on: the report is the product
        report[name] = {"ok": False, "detail": repr(exc)[:2000], "trace": traceback.format_exc()[-2000:]}
    report[name]["s"] = round(time.perf_counter() - t0, 2)
    report[name]["compiled_graphs"] = _compiled_graphs() - graphs
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({name: {k: v for k, v in report[name].items() if k != "trace"}})[:3000], flush=True)


def _tiny_models(backend_name: str, device: str):
    """(config, the torch reference, the model under test): the same tiny checkpoint in
    the named backend (the reference itself for ``torch``), on ``device``."""
    from .backends.torch_hf import TinyModelConfig, TorchBackend

    cfg = TinyModelConfig(vocab_size=4096, hidden_size=128, intermediate_size=256)
    ref = TorchBackend.tiny(cfg)
    ref.model.to(device)
    if backend_name != "megatron":
        return cfg, ref, ref
    from .backends.megatron import MegatronBackend

    model = MegatronBackend(cfg)
    model.load_hf_state_dict({k: v.cpu() for k, v in ref.hf_state_dict().items()})
    model.model.to(device)
    return cfg, ref, model


def _equality(backend_name: str, mode: str, device: str) -> dict:
    import torch

    from services.trajectory.bench import packed_samples

    from .attention import AttentionConfig
    from .batch import branch_batch, tree_batch
    from .bench import _fold
    from .step import TrainConfig, compute_micro_step

    cfg, ref, model = _tiny_models(backend_name, device)
    samples = [(_fold(p, cfg.vocab_size), 1.0 - 2.0 * (i % 2)) for i, p in enumerate(packed_samples("small"))]
    config = TrainConfig(attention=AttentionConfig(mode=mode, block_size=128))
    tree = compute_micro_step(model, tree_batch(samples), config)
    flat = compute_micro_step(model, branch_batch(samples), TrainConfig())
    out = {"tree_tokens": tree.n_tokens, "flat_tokens": flat.n_tokens,
           "loss_diff": abs(tree.loss_sum - flat.loss_sum),
           "grad_diff": float((tree.gradient - flat.gradient).abs().max()),
           "grad_max": float(tree.gradient.abs().max())}
    if backend_name == "megatron":
        with torch.no_grad():
            a = ref.target_logprobs(tree_batch(samples), AttentionConfig())
            b = model.target_logprobs(tree_batch(samples), AttentionConfig())
        out["logprob_diff_vs_torch"] = float((a - b).abs().max())
    return out


def _flex_series(device: str, backend_name: str = "torch", steps: int = 12) -> dict:
    """What a long-running trainer does: micro-steps of a new size each time, with the
    no-grad logprob pass between them, all in flex mode. Sequence lengths are dynamic,
    so the compiled kernel is reused; the count of compiled graphs must stay small."""
    import torch

    from services.trajectory.bench import packed_samples

    from .attention import AttentionConfig
    from .batch import tree_batch
    from .bench import _fold
    from .step import TrainConfig, compute_micro_step

    cfg, _, model = _tiny_models(backend_name, device)
    config = TrainConfig(attention=AttentionConfig(mode="flex", block_size=128))
    sizes, times = [], []
    for i in range(steps):
        # another workload seed and subset each step: a new token count every time
        pool = [_fold(p, cfg.vocab_size) for p in packed_samples("small", seed=i)]
        samples = [(p, 1.0 - 2.0 * ((i + j) % 2)) for j, p in enumerate(pool[: 1 + i % len(pool)])]
        batch = tree_batch(samples)
        t0 = time.perf_counter()
        compute_micro_step(model, batch, config)
        with torch.no_grad():
            model.target_logprobs(batch, config.attention)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        sizes.append(batch.layout.n_tokens)
    first_s, rest_s = times[0], times[1:]
    return {"backend": backend_name, "steps": steps, "distinct_sizes": len(set(sizes)), "sizes": sizes,
            "first_step_s": round(first_s, 3), "later_step_mean_s": round(sum(rest_s) / len(rest_s), 4),
            "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if device == "cuda" else None}


def attended_pairs(layout) -> int:
    """(query, key) pairs a tree lets attend: each token sees its ancestors' segments
    whole and its own segment up to itself."""
    import torch

    lengths = torch.bincount(layout.segment_ids, minlength=layout.visible.shape[0]).double()
    ancestors = (layout.visible.double() @ lengths) - lengths  # tokens in strict ancestors
    return int((lengths * ancestors + lengths * (lengths + 1) / 2).sum())


def _time_fwd_bwd(fn, q, k, v, repeats: int = 3) -> float:
    import torch

    def once():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).sum().backward()

    once()  # compile / warm-up
    if q.is_cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            once()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000 / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        once()
    return (time.perf_counter() - t0) / repeats


def _attention_speed(device: str, include_default: bool = True) -> dict:
    import torch
    import torch.nn.functional as F

    from services.trajectory.bench import packed_samples

    from .attention import AttentionConfig, TreeAttention
    from .batch import branch_batch, tree_batch

    heads, dim = 8, 64
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layouts = {"small_tree": tree_batch([(packed_samples("small")[0], 1.0)]).layout}
    if include_default:
        big = packed_samples("default")[0]
        layouts["default_tree"] = tree_batch([(big, 1.0)]).layout
        layouts["default_flat"] = branch_batch([(big, 1.0)]).layout
    out: dict = {"heads": heads, "head_dim": dim, "dtype": str(dtype)}
    for name, layout in layouts.items():
        s = layout.n_tokens
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(1, heads, s, dim, device=device, dtype=dtype, generator=g).requires_grad_()
                   for _ in range(3))
        pairs = attended_pairs(layout)
        repeats = 3 if s <= 100_000 else 1
        row: dict = {"tokens": s, "pairs": pairs, "density": round(pairs / (s * (s + 1) / 2), 4)}
        modes = ["flex"] + (["dense"] if s <= 16384 else []) + (["blocks"] if s <= 65536 else [])
        for mode in modes:
            try:
                t0 = time.perf_counter()
                attn = TreeAttention(layout, AttentionConfig(mode=mode), device)
                prep = time.perf_counter() - t0
                sec = _time_fwd_bwd(lambda a, b, c: attn(a, b, c), q, k, v, repeats)
                row[mode] = {"fwd_bwd_s": round(sec, 5), "prepare_s": round(prep, 3),
                             "tflops": round(4 * dim * heads * pairs * 3.5 / sec / 1e12, 1)}
            except Exception as exc:  # one mode failing does not hide the others
                row[mode] = {"error": repr(exc)[:300]}
        try:
            if s > 400_000:  # the per-branch batch: causal over all of it is no comparison
                raise RuntimeError("not run: longer than 400k tokens")
            sec = _time_fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), q, k, v,
                                repeats)
            row["causal_sdpa"] = {"fwd_bwd_s": round(sec, 5),
                                  "tflops": round(4 * dim * heads * (s * (s + 1) / 2) * 3.5 / sec / 1e12, 1)}
            if "fwd_bwd_s" in row.get("flex", {}):
                row["flex_over_causal_time"] = round(row["flex"]["fwd_bwd_s"] / sec, 3)
        except Exception as exc:
            row["causal_sdpa"] = {"error": repr(exc)[:300]}
        out[name] = row
        del q, k, v
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


_NCCL_CHILD = r"""
import os, sys, time, torch, torch.distributed as dist
rank = int(sys.argv[1]); port = sys.argv[2]; world = int(sys.argv[3])
torch.cuda.set_device(rank % torch.cuda.device_count())
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
t = torch.full((64 * 1024 * 1024,), float(rank == 0), device="cuda")  # 256 MB fp32
dist.broadcast(t, 0); torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(5):
    dist.broadcast(t, 0)
torch.cuda.synchronize()
sec = (time.perf_counter() - t0) / 5
print("RESULT", rank, float(t.min()), float(t.max()), sec, flush=True)
dist.destroy_process_group()
"""


def _nccl_broadcast() -> dict:
    """Two ranks on two GPUs when there are two; with one GPU NCCL refuses two ranks on
    the same device ("Duplicate GPU detected", seen on an H200 with NCCL 2.28.9), so the
    group has one rank: NCCL's set-up and collective launch are checked, not a transfer."""
    import socket

    import torch

    world = 2 if torch.cuda.device_count() >= 2 else 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, "-c", _NCCL_CHILD, str(r), port, str(world)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=90)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append("timed out after 90 s\n" + (p.communicate()[0] or ""))
    result: dict = {"world_size": world, "returncodes": [p.returncode for p in procs]}
    if world == 1:
        result["two_ranks"] = "not run: one GPU (NCCL refuses two ranks on one device)"
    for r, text in enumerate(outs):
        line = [x for x in text.splitlines() if x.startswith("RESULT")]
        if line:
            _, _, lo, hi, sec = line[0].split()
            result[f"rank{r}"] = {"min": float(lo), "max": float(hi), "s_per_256MB": float(sec),
                                  "GBps": round(0.268435456 / float(sec), 1)}
        else:
            result[f"rank{r}"] = text[-800:]
    if not all(rc == 0 for rc in result["returncodes"]):
        raise RuntimeError(json.dumps(result)[:1800])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="trainer_gpu_check.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--bench-preset", default="small")
    parser.add_argument("--default-bench", default="torch,megatron",
                        help="backends to bench at the default preset ('' for none)")
    parser.add_argument("--skip", default="", help="comma-separated step name prefixes to leave out")
    args = parser.parse_args()
    import torch

    skip = [s for s in args.skip.split(",") if s]
    report: dict = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                    "torch": torch.__version__, "python": sys.version.split()[0]}

    def step(name, fn):
        if not any(name.startswith(s) for s in skip):
            _step(report, name, fn, args.out)

    for backend in ("torch", "megatron"):
        for mode in ("dense", "flex", "blocks"):
            step(f"equality_{backend}_{mode}", lambda b=backend, m=mode: _equality(b, m, args.device))
    for backend in ("torch", "megatron"):
        step(f"flex_series_{backend}", lambda b=backend: _flex_series(args.device, b))
    step("attention_speed", lambda: _attention_speed(args.device, include_default=args.device == "cuda"))
    from .bench import run_bench

    for backend in ("torch", "megatron"):
        step(f"bench_{backend}", lambda b=backend: run_bench(b, preset=args.bench_preset, device=args.device,
                                                             repeats=3))
    if args.device == "cuda" and "nccl" not in skip:
        step("nccl_broadcast", _nccl_broadcast)
    for backend in [b for b in args.default_bench.split(",") if b]:
        step(f"bench_default_{backend}", lambda b=backend: run_bench(b, preset="default", device=args.device,
                                                                     repeats=1))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v.get("ok") if isinstance(v, dict) else v for k, v in report.items()}))
    os._exit(0)  # megatron's process group and compiled kernels need no orderly teardown


if __name__ == "__main__":
    main()
