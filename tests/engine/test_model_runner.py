"""The model runner's own forward against transformers' forward, for each supported
architecture (tiny random configs), over ragged batches mixing prompt chunks and decodes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine import model_runner
from services.engine.model_runner import ForwardItem, ModelRunner, ThreadChoice
from services.engine.model_store import ModelLocation


def _tiny(arch: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3)
    torch.manual_seed(3)
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common))
    if arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=32, **common))  # head_dim != hidden / heads
    return LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, rope_theta=5e5, **common))


def _qwen2(seed: int, *, vocab: int, positions: int, layers: int = 1):
    """A random Qwen2 of hidden size 64 with a vocabulary big enough for the chosen output kernel."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=positions, initializer_range=0.3)).eval()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_ragged_steps_match_transformers(arch):
    model = _tiny(arch).eval()
    runner = ModelRunner(model, ModelLocation(Path(".")))
    a, b = list(range(10, 50)), list(range(300, 317))
    with torch.inference_mode():
        ref_a = model(torch.tensor([a])).logits[0]
        ref_b = model(torch.tensor([b])).logits[0]
    kv_a, kv_b = runner.new_kv(4), runner.new_kv(4)
    # step 1: a's first chunk alone; step 2: the rest of a with all of b; step 3: both decode
    first = runner.forward([ForwardItem(kv_a, a[:25], True)])
    second = runner.forward([ForwardItem(kv_a, a[25:39], True), ForwardItem(kv_b, b[:16], True)])
    third = runner.forward([ForwardItem(kv_a, a[39:], True), ForwardItem(kv_b, b[16:], True)])
    close = lambda x, y: torch.allclose(x, y, atol=1e-4, rtol=1e-4)
    assert close(first[0], ref_a[24]) and close(second[0], ref_a[38]) and close(third[0], ref_a[39])
    assert close(second[1], ref_b[15]) and close(third[1], ref_b[16])
    assert kv_a.length == 40 and kv_b.length == 17


def test_unsupported_architectures_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelRunner(model, ModelLocation(Path(".")))


@pytest.mark.parametrize("kernel", ["blocked", "linear", "auto"])
def test_output_head_matches_transformers(kernel):
    # A vocabulary big enough for the row-blocked output matmul (the tiny-qwen path).
    model = _qwen2(5, vocab=16384, positions=128)
    runner = ModelRunner(model, ModelLocation(Path(".")))
    runner.output_kernel = kernel
    assert runner._lm_groups > 1
    ids = [list(range(7, 30)), list(range(900, 912)), list(range(15000, 15040))]
    with torch.inference_mode():
        refs = [model(torch.tensor([x])).logits[0, -1] for x in ids]
    kvs = [runner.new_kv(4) for _ in ids]
    one = runner.forward([ForwardItem(kvs[0], ids[0], True)])  # a single row
    many = runner.forward([ForwardItem(kv, x, True) for kv, x in zip(kvs[1:], ids[1:])])
    assert one.shape == (1, 16384) and many.shape == (2, 16384) and many.is_contiguous()
    for got, ref in zip([one[0], many[0], many[1]], refs):
        assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
        assert int(got.argmax()) == int(ref.argmax())
    assert runner._one_row_kernel == (kernel if kernel != "auto" else runner._one_row_kernel)
    assert runner._one_row_kernel in ("linear", "blocked")


def test_auto_output_kernel_is_chosen_once_and_kept(monkeypatch):
    # The two one-row kernels round differently, so "auto" times them once and then keeps
    # the faster for the runner's life, however the later timings go.
    monkeypatch.setattr(model_runner, "_ONE_ROW_CHOICE", {})  # as in a fresh process
    model = _qwen2(5, vocab=16384, positions=128)
    runner = ModelRunner(model, ModelLocation(Path(".")))
    timed = []
    real = runner._one_row
    monkeypatch.setattr(runner, "_one_row", lambda h, k: timed.append(k) or real(h, k))
    kv = runner.new_kv(4)
    first = runner.forward([ForwardItem(kv, [5, 6, 7], True)])
    assert sorted(set(timed)) == ["blocked", "linear"] and len(timed) >= 12  # both timed, interleaved
    chosen = runner._one_row_kernel
    timed.clear()
    for token in (8, 9, 10):
        runner.forward([ForwardItem(kv, [token], True)])
    assert runner._one_row_kernel == chosen and set(timed) <= {chosen}
    assert first.shape == (1, 16384)
    bad = ModelRunner(model, ModelLocation(Path(".")))
    bad.output_kernel = "gemv"
    with pytest.raises(ValueError, match="output_kernel"):
        bad.forward([ForwardItem(bad.new_kv(4), [5], True)])


def test_runners_of_one_process_use_one_output_kernel(monkeypatch):
    # Two engines in one process timed the kernels each for itself: under load one took
    # "linear", the other "blocked", and a session moved between them with its KV cache
    # went on with other logprobs than on its source (the migration tests' rare failure).
    monkeypatch.setattr(model_runner, "_ONE_ROW_CHOICE", {})
    model = _qwen2(5, vocab=16384, positions=128)
    first, second = ModelRunner(model, ModelLocation(Path("."))), ModelRunner(model, ModelLocation(Path(".")))
    first.forward([ForwardItem(first.new_kv(4), [5, 6, 7], True)])
    other = "linear" if first._one_row_kernel == "blocked" else "blocked"
    monkeypatch.setattr(second, "_time_one_row_kernels", lambda hidden: other)  # its own timing would differ
    a = first.forward([ForwardItem(first.new_kv(4), [5, 6, 7], True)])
    b = second.forward([ForwardItem(second.new_kv(4), [5, 6, 7], True)])
    assert second._one_row_kernel == first._one_row_kernel and torch.equal(a, b)


def test_multi_row_output_follows_weight_writes():
    # The multi-row output matmul may use a packed copy of the matrix; writes must reach it.
    model = _qwen2(6, vocab=8192, positions=64)
    runner = ModelRunner(model, ModelLocation(Path(".")))
    head = model.lm_head.weight
    prompts = [list(range(5, 20)), list(range(700, 709))]

    def check() -> None:
        with torch.inference_mode():
            refs = [model(torch.tensor([x])).logits[0, -1] for x in prompts]
        got = runner.forward([ForwardItem(runner.new_kv(4), x, True) for x in prompts])
        assert all(torch.allclose(g, r, atol=1e-4, rtol=1e-4) for g, r in zip(got, refs))

    check()
    with torch.no_grad():
        head.copy_(head * 0.5 + 0.1)  # in place: autograd's version counter moves
    check()
    with torch.no_grad():
        head.data.copy_(torch.randn(head.shape))  # behind autograd's back: the writer says so
    runner.weights_changed()
    check()
    head.data = torch.randn(head.shape)  # swapped storage (release/resume)
    check()


def test_thread_choice_times_both_then_keeps_the_faster_and_probes_the_other():
    choice = ThreadChoice(warm=2, probe_every=4)
    cost = {1: 3.0, 2: 8.0}  # a busy machine: the second thread costs more than it brings

    def run(n: int) -> list[int]:
        used = []
        for _ in range(n):
            threads = choice.pick(1, 2)
            choice.record(1, 2, threads, cost[threads])
            used.append(threads)
        return used

    assert run(4) == [1, 1, 2, 2]  # every candidate timed `warm` times first
    assert choice.chosen(1, 2) == 1
    assert run(8) == [1, 1, 1, 2, 1, 1, 1, 2]  # every 4th call times the other again
    cost.update({1: 3.0, 2: 1.0})  # the machine goes quiet: the probes see it
    run(12)
    assert choice.chosen(1, 2) == 2 and choice.chosen(7, 2) is None  # keys are separate
    assert ThreadChoice().pick(1, 1) == 1  # one thread available: nothing to choose


@pytest.mark.parametrize("kernel", ["blocked", "linear"])
def test_one_or_all_threads_give_the_same_bits(kernel):
    # The thread choice must move time only: the one-row output kernels (blocked, GEMV),
    # the packed one (several rows) and the layer pass compute each block whole on one thread.
    model = _qwen2(7, vocab=16384, positions=2048, layers=2)
    runner = ModelRunner(model, ModelLocation(Path(".")))
    runner.output_kernel = kernel
    runner.threads = 2
    prompts = [list(range(3, 1203)), list(range(9000, 9300))]  # a layer pass past the serial size
    results = []
    for threads in (1, 2):
        runner.output_threads.pick = runner.layer_threads.pick = lambda key, available, t=threads: t
        kvs = [runner.new_kv(16) for _ in prompts]
        both = runner.forward([ForwardItem(kv, x, True) for kv, x in zip(kvs, prompts)])
        one = runner.forward([ForwardItem(kvs[0], [42], True)])
        results.append((both, one, kvs[0].data[:, :, :, : kvs[0].length].clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results))
