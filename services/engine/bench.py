"""``gyre bench engine``: the embedded engine against transformers ``generate``, same model.

Both sides run the default tiny Qwen-architecture model (fp32, 32k positions), greedy, on
the same random prompts. Throughput counts generated tokens over wall time of the whole
call (prefill included) for 8 prompts run one at a time (b1) and all at once (b8); each
figure is the median of ``repeats`` runs, the two sides interleaved. The
prefix-cache figure times a follow-up turn (64 new prompt tokens, 32 generated) after a
4k-token prefix, with the prefix cached and after ``flush_cache``; the ``first_token_*``
fields time the same turn stopped after its first token (prefill only), which is the part
the cache can save: with this model each of the 32 decode steps costs a full pass over the
78 MB fp32 output matrix, which the cache cannot shorten. The engine is driven in-process
(no HTTP) so both sides measure model work, not transport. Both sides are warmed up
before any timing: the first large frees in a process move glibc's adaptive mmap threshold,
and before that transformers' ``generate`` ran 5-9x slower here (page faults on fresh
mmaps each step), so without the warm-up the baseline depended on what ran before it.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import torch

from .params import parse_sampling_params
from .settings import EngineSettings


def run_bench(
    *,
    model: str = "tiny-qwen",
    prompts: int = 8,
    prompt_tokens: int = 256,
    new_tokens: int = 64,
    prefix_tokens: int = 4096,
    turn_tokens: int = 64,
    turn_new_tokens: int = 32,
    repeats: int = 3,
    seed: int = 0,
    cache_dir: str | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    from .main import build

    if threads:
        torch.set_num_threads(threads)  # transformers runs on this thread, the engine on its own
    settings = EngineSettings(model=model, cache_dir=cache_dir, kv_cache_bytes=1 << 30, num_threads=threads)
    service = build(settings)
    try:
        engine = service.engine
        gen = torch.Generator().manual_seed(seed)
        vocab = engine.vocab_limit - 300  # ordinary tokens only
        batch = torch.randint(0, vocab, (prompts, prompt_tokens), generator=gen)
        asyncio.run(_warm_up(engine, batch.tolist()))  # warm-up of both sides (see above)
        limit = engine.vocab_limit  # the engine never picks the embedding's padding rows; HF is told the same
        _hf_throughput(engine.runner.model, batch[:, :64], 4, limit)
        # Both sides `repeats` times, interleaved, medians: a busy machine slows both alike.
        hf_runs, our_runs = [], []
        for _ in range(repeats):
            hf_runs.append(_hf_throughput(engine.runner.model, batch, new_tokens, limit))
            our_runs.append(asyncio.run(_engine_throughput(engine, batch.tolist(), new_tokens)))
        hf_b1, hf_b8 = (statistics.median(run[i] for run in hf_runs) for i in (0, 1))
        ours_b1, ours_b8 = (statistics.median(run[i] for run in our_runs) for i in (0, 1))
        hf_ids = hf_runs[0][2]
        outputs_match = all(run[2] == hf_ids for run in hf_runs + our_runs)
        prefix = torch.randint(0, vocab, (prefix_tokens,), generator=gen).tolist()
        turns = [torch.randint(0, vocab, (turn_tokens,), generator=gen).tolist() for _ in range(repeats)]
        cached, uncached = asyncio.run(_turn_latency(engine, prefix, turns, turn_new_tokens))
        # the same turns cut to their first token: what the cache saves before decoding starts
        first_cached, first_uncached = asyncio.run(_turn_latency(engine, prefix, turns, 1))
        output_kernel = engine.runner._one_row_kernel  # the one-row output matmul the runner timed faster
    finally:
        service.close()
    return {
        "model": model,
        "dtype": "float32",
        "output_kernel": output_kernel,
        "max_positions": engine.runner.shape.max_positions,
        "threads": torch.get_num_threads(),
        "prompts": prompts,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "decode_tok_s_b1": round(ours_b1, 2),
        "hf_decode_tok_s_b1": round(hf_b1, 2),
        "decode_tok_s_b8": round(ours_b8, 2),
        "hf_decode_tok_s_b8": round(hf_b8, 2),
        "b8_ratio": round(ours_b8 / hf_b8, 3),
        "greedy_outputs_match_hf": outputs_match,
        "repeats": repeats,
        "prefix_tokens": prefix_tokens,
        "turn_latency_cached_s": round(cached, 4),
        "turn_latency_uncached_s": round(uncached, 4),
        "prefix_cache_speedup": round(uncached / cached, 3),
        "turn_new_tokens": turn_new_tokens,
        "first_token_latency_cached_s": round(first_cached, 4),
        "first_token_latency_uncached_s": round(first_uncached, 4),
        "first_token_speedup": round(first_uncached / first_cached, 3),
    }


def _hf_throughput(model, batch: torch.Tensor, new_tokens: int,
                   vocab_limit: int | None = None) -> tuple[float, float, list[list[int]]]:
    from transformers import GenerationConfig

    size = model.config.vocab_size
    padding = list(range(vocab_limit, size)) if vocab_limit is not None and vocab_limit < size else None
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0, eos_token_id=None, suppress_tokens=padding)

    def generate(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)

    generate(batch[:1, :16])  # warm-up
    start = time.perf_counter()
    for row in batch:
        generate(row[None])
    b1 = batch.shape[0] * new_tokens / (time.perf_counter() - start)
    start = time.perf_counter()
    out = generate(batch)
    b8 = batch.shape[0] * new_tokens / (time.perf_counter() - start)
    return b1, b8, out[:, batch.shape[1]:].tolist()


async def _run(engine, ids: list[int], max_new: int) -> dict:
    params = parse_sampling_params({"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True})
    subscriber = await engine.submit(engine.new_sequence(ids, params, False, None), stream=False)
    async for snapshot, _ in subscriber.updates():
        last = snapshot
    return last


async def _warm_up(engine, prompts: list[list[int]]) -> None:
    """Runs the prompts at once (multi-row steps build the packed output matrix), then forgets them."""
    await asyncio.gather(*[_run(engine, ids, 8) for ids in prompts])
    await engine.acall(engine.flush_cache)


async def _engine_throughput(engine, prompts: list[list[int]], new_tokens: int):
    await _run(engine, prompts[0][:16], 4)  # warm-up
    await engine.acall(engine.flush_cache)
    start = time.perf_counter()
    for ids in prompts:
        await _run(engine, ids, new_tokens)
    b1 = len(prompts) * new_tokens / (time.perf_counter() - start)
    await engine.acall(engine.flush_cache)
    start = time.perf_counter()
    outs = await asyncio.gather(*[_run(engine, ids, new_tokens) for ids in prompts])
    b8 = len(prompts) * new_tokens / (time.perf_counter() - start)
    await engine.acall(engine.flush_cache)
    return b1, b8, [out["output_ids"] for out in outs]


async def _turn_latency(engine, prefix: list[int], turns: list[list[int]], new_tokens: int):
    """Median wall time of a follow-up turn generating ``new_tokens``: (cached, uncached)."""
    cached, uncached = [], []
    for turn in turns:
        await engine.acall(engine.flush_cache)
        await _run(engine, prefix, 1)  # the earlier turns: leaves the prefix's KV cached
        start = time.perf_counter()
        out = await _run(engine, prefix + turn, new_tokens)
        cached.append(time.perf_counter() - start)
        assert out["meta_info"]["cached_tokens"] == len(prefix)
        await engine.acall(engine.flush_cache)
        start = time.perf_counter()
        out = await _run(engine, prefix + turn, new_tokens)
        uncached.append(time.perf_counter() - start)
        assert out["meta_info"]["cached_tokens"] == 0
    await engine.acall(engine.flush_cache)
    return statistics.median(cached), statistics.median(uncached)


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run_bench(threads=int(sys.argv[1]) if len(sys.argv) > 1 else None), indent=2))
