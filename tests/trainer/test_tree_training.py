"""Tree-packed training equals per-branch training (1/k weights): loss and gradients,
both backends; the attention paths agree; both backends give the same logits."""

from __future__ import annotations

import pytest
import torch

from services.trainer.attention import AttentionConfig, TreeAttention
from services.trainer.batch import branch_batch, tree_batch
from services.trainer.objective import ObjectiveConfig
from services.trainer.step import TrainConfig, compute_micro_step

from .samples import two_branch_tree, with_behaviour

UNCLIPPED = ObjectiveConfig(eps_low=1e9, eps_high=1e9)


def test_layout_of_the_example_tree():
    batch = tree_batch([(two_branch_tree(), 1.0)])
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 5, 6, 7]
    # targets: each trained token, predicted from its parent (30 from 21, not from 23)
    assert batch.target_ids.tolist() == [20, 21, 22, 23, 30, 31, 32]
    assert batch.source_index.tolist() == [2, 3, 4, 5, 4, 7, 8]
    flat = branch_batch([(two_branch_tree(), 1.0)])
    # 20 and 21 are in both branches: each copy weighs 1/2 of the tree's weight
    assert flat.weights.tolist()[:2] == pytest.approx([1 / 14, 1 / 14])
    assert float(flat.weights.sum()) == pytest.approx(float(batch.weights.sum()))


@pytest.mark.parametrize("mode", ["blocks", "flex"])
def test_attention_paths_agree_with_dense(samples, mode):
    layout = tree_batch(samples).layout
    s = layout.n_tokens
    q, k, v = (torch.randn(1, 4, s, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    dense = TreeAttention(layout, AttentionConfig(mode="dense"))(q, k[:, :2], v[:, :2])
    other = TreeAttention(layout, AttentionConfig(mode=mode, block_size=64))(q, k[:, :2], v[:, :2])
    assert torch.allclose(dense, other, atol=1e-5)


def _assert_tree_equals_branches(backend, samples, objective, attention=AttentionConfig()):
    config = TrainConfig(objective=objective, attention=attention)
    tree = compute_micro_step(backend, tree_batch(samples), config)
    flat = compute_micro_step(backend, branch_batch(samples), TrainConfig(objective=objective))
    assert tree.n_tokens < flat.n_tokens
    assert abs(tree.loss_sum - flat.loss_sum) <= 1e-5
    assert float(tree.gradient.abs().max()) > 1e-4  # a real gradient, not zeros
    assert torch.allclose(tree.gradient, flat.gradient, atol=1e-5, rtol=0)
    assert tree.stats["clip_fraction"] == pytest.approx(flat.stats["clip_fraction"], abs=1e-6)


def test_a_group_shared_prompt_is_computed_once_with_the_same_loss(torch_backend, samples):
    samples = with_behaviour(samples, torch_backend)
    merged, apart = tree_batch(samples), tree_batch(samples, merge=False)
    # the two workload rollouts are one group: one system prompt and task between them
    assert merged.n_tokens < apart.n_tokens
    assert merged.target_ids.tolist() == apart.target_ids.tolist()
    a = compute_micro_step(torch_backend, merged, TrainConfig())
    b = compute_micro_step(torch_backend, apart, TrainConfig())
    assert abs(a.loss_sum - b.loss_sum) <= 1e-5
    assert torch.allclose(a.gradient, b.gradient, atol=1e-5, rtol=0)


@pytest.mark.parametrize("objective", [UNCLIPPED, ObjectiveConfig(), ObjectiveConfig(tis_cap=2.0, kl_coef=0.1)],
                         ids=["unclipped", "clipped", "tis+kl"])
def test_torch_tree_equals_branches(torch_backend, samples, objective):
    _assert_tree_equals_branches(torch_backend, with_behaviour(samples, torch_backend), objective)


def test_torch_block_sparse_tree_equals_branches(torch_backend, samples):
    attention = AttentionConfig(mode="blocks", block_size=32)
    _assert_tree_equals_branches(torch_backend, with_behaviour(samples, torch_backend), ObjectiveConfig(), attention)


@pytest.mark.parametrize("mode", ["dense", "blocks"])
def test_megatron_tree_equals_branches(megatron_backend, samples, mode):
    attention = AttentionConfig(mode=mode, block_size=32)
    _assert_tree_equals_branches(megatron_backend, with_behaviour(samples, megatron_backend), ObjectiveConfig(),
                                 attention)


def test_backends_give_the_same_logprobs_from_one_checkpoint(torch_backend, megatron_backend, samples):
    batch = tree_batch(samples)
    with torch.no_grad():
        a = torch_backend.target_logprobs(batch, AttentionConfig())
        b = megatron_backend.target_logprobs(batch, AttentionConfig())
    assert torch.allclose(a, b, atol=1e-5)
    back = megatron_backend.hf_state_dict()
    for name, tensor in torch_backend.hf_state_dict().items():
        assert torch.equal(back[name], tensor), name


def test_megatron_rope_uses_packed_positions(megatron_backend):
    """A branch after a sibling must see position = depth, not its packed index."""
    p = two_branch_tree()
    tree = tree_batch([(p, 1.0)])
    flat = branch_batch([(p, 1.0)])
    with torch.no_grad():
        a = megatron_backend.target_logprobs(tree, AttentionConfig())
        b = megatron_backend.target_logprobs(flat, AttentionConfig())
    # tree targets 30 31 32 are the second branch's last three tokens in the flat batch
    assert torch.allclose(a[4:], b[-3:], atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_both_backends_load_one_hf_folder(tmp_path, samples, family):
    """The serving path: ``build_backend`` reads an HF folder (Qwen2 with RoPE theta 1e6 and
    tied embeddings; Llama without q/k/v biases, untied)."""
    pytest.importorskip("megatron.core")
    from services.trainer.backends.torch_hf import TinyModelConfig, TorchBackend
    from services.trainer.main import build_backend

    if family == "qwen2":
        TorchBackend.tiny(TinyModelConfig(rope_theta=1e6, seed=3)).model.save_pretrained(tmp_path)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(4)
        LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                     rope_theta=5e5)).save_pretrained(tmp_path)
    a = build_backend({"backend": "torch", "model": str(tmp_path)})
    b = build_backend({"backend": "megatron", "model": str(tmp_path)})
    batch = tree_batch(samples)
    with torch.no_grad():
        assert torch.allclose(a.target_logprobs(batch, AttentionConfig()), b.target_logprobs(batch, AttentionConfig()),
                              atol=1e-5)
    back = b.hf_state_dict()
    for name, tensor in a.hf_state_dict().items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("block_size", [16, 64])
def test_tree_block_mask_matches_the_pairwise_one(samples, block_size):
    """The block mask built from the segment table (no s^2 pass) is create_block_mask's."""
    from torch.nn.attention.flex_attention import create_block_mask

    from services.trainer.attention import flex_block_mask

    full_blocks = 0
    for batch in (tree_batch(samples), branch_batch(samples)):
        layout = batch.layout
        seg, visible = layout.segment_ids, layout.visible
        ours = flex_block_mask(layout, block_size)
        ref = create_block_mask(lambda b, h, q, kv: (kv <= q) & visible[seg[q], seg[kv]], None, None,
                                layout.n_tokens, layout.n_tokens, device="cpu", BLOCK_SIZE=block_size)
        assert ours.seq_lengths == ref.seq_lengths and ours.BLOCK_SIZE == ref.BLOCK_SIZE
        for num, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
            a_num, b_num = getattr(ours, num)[0, 0], getattr(ref, num)[0, 0]
            assert a_num.tolist() == b_num.tolist(), num
            a_idx, b_idx = getattr(ours, idx)[0, 0], getattr(ref, idx)[0, 0]
            for row, n in enumerate(a_num.tolist()):
                assert a_idx[row, :n].tolist() == b_idx[row, :n].tolist(), (idx, row)
        full_blocks += int(ours.full_kv_num_blocks.sum())
    assert full_blocks > 0 or block_size > 16  # small blocks: whole ones exist, flex skips their mask


def test_compiled_flex_fails_clearly_past_its_recompile_limit(monkeypatch):
    """On GPU flex attention is compiled; past the recompile limit torch would run it
    eagerly (an [s, s] score matrix: 1.3 TB at 300k tokens, seen on an H200). The trainer
    raises the limit and turns a hit into an error that says what happened."""
    import torch._dynamo.config as dynamo_config
    from torch._dynamo.exc import FailOnRecompileLimitHit

    from services.trainer import attention

    def fake_compile(fn, dynamic=None):  # stands for a compiled kernel whose cache is full
        def run(*args, **kwargs):
            raise FailOnRecompileLimitHit("Hard failure due to fail_on_recompile_limit_hit")
        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(dynamo_config, "recompile_limit", dynamo_config.recompile_limit)
    monkeypatch.setattr(dynamo_config, "fail_on_recompile_limit_hit", dynamo_config.fail_on_recompile_limit_hit)
    attention._flex_attention.cache_clear()
    try:
        call = attention._flex_attention(True)
        assert dynamo_config.recompile_limit >= attention.FLEX_RECOMPILE_LIMIT
        assert dynamo_config.fail_on_recompile_limit_hit
        with pytest.raises(RuntimeError, match="compiled more than .* times"):
            call(None, None, None)
    finally:
        attention._flex_attention.cache_clear()
