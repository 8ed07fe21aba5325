"""megatron-core backend: ``GPTModel`` with the local layer spec, on CPU (gloo) or GPU.

Two changes to stock megatron make tree packing exact (see ../shared/notes/megatron-cpu.md):

- RoPE from the packed position ids: ``GPTModel`` builds rotary frequencies for
  0..s-1 and ignores ``position_ids``; :class:`PackedRotary` replaces
  ``model.rotary_pos_emb`` and builds ``[s, 1, 1, d]`` from the depths.
- Logits stay split over the vocabulary (``parallel_output=True``; gathering them is
  CUDA-only in megatron's mappings) and the log-probabilities come from megatron's
  ``vocab_parallel_cross_entropy``.
- Tree attention as the layer spec's ``core_attention`` (:class:`TreeCoreAttention`):
  the decoder receives the batch's :class:`TreeAttention` as its mask and every layer
  calls it (dense mask, flex block mask or block-sparse), which also avoids the CUDA-only
  buffers of megatron's ``DotProductAttention`` on CPU.

Tested: megatron-core 0.16.1 (internals touched: ``_preprocess``, ``decoder``,
``output_layer``, ``rotary_pos_emb``), TP=1 and TP=2 with gloo.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import torch

from ..attention import AttentionConfig, TreeAttention
from ..batch import TreeBatch
from .base import tempered_logits
from .convert import Shape, hf_to_mcore, mcore_to_hf, shard, unshard
from .torch_hf import TinyModelConfig


class PackedRotary(torch.nn.Module):
    """RoPE frequencies for the packed position ids (set before each forward)."""

    def __init__(self, original: torch.nn.Module) -> None:
        super().__init__()
        self.original = original
        self.register_buffer("inv_freq", original.inv_freq.detach().float().cpu().clone(), persistent=False)
        self.position_ids: torch.Tensor | None = None

    def get_rotary_seq_len(self, *args: Any, **kwargs: Any) -> int:
        return self.original.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        if self.position_ids is None:
            raise RuntimeError("PackedRotary needs position_ids set before the forward")
        pos = self.position_ids.to(self.inv_freq.device, torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


class TreeCoreAttention(torch.nn.Module):
    """megatron core attention computed by the batch's :class:`TreeAttention`."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None, **_: Any) -> None:
        super().__init__()
        self.config = config
        head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not isinstance(attention_mask, TreeAttention):
            raise TypeError("TreeCoreAttention needs a TreeAttention as its mask")
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [s, b, h, d] -> [b, h, s, d]
        out = attention_mask(q, k, v, scale=self.scale)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def ensure_model_parallel(tp: int = 1) -> None:
    """A process group (gloo on CPU) and megatron's model-parallel state, once."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # Under torchrun the environment names the group; alone, a private one-rank group
        # (no environment variables set, so nothing leaks into other code in the process).
        init = "env://" if "MASTER_ADDR" in os.environ else f"tcp://127.0.0.1:{_free_port()}"
        dist.init_process_group(backend, init_method=init, rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_gpt(c: TinyModelConfig, tp: int = 1):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    ensure_model_parallel(tp)
    config = TransformerConfig(
        num_layers=c.num_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_heads,
        num_query_groups=c.num_kv_heads, ffn_hidden_size=c.intermediate_size,
        kv_channels=c.hidden_size // c.num_heads, normalization="RMSNorm", layernorm_epsilon=c.rms_norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=c.qkv_bias, bias_activation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, use_cpu_initialization=True, params_dtype=torch.float32,
        apply_rope_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = TreeCoreAttention
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=c.vocab_size,
                     max_sequence_length=1 << 20, parallel_output=True,
                     share_embeddings_and_output_weights=c.tie_word_embeddings,
                     position_embedding_type="rope", rotary_base=int(c.rope_theta))
    model.rotary_pos_emb = PackedRotary(model.rotary_pos_emb)
    return model


class MegatronBackend:
    name = "megatron"

    def __init__(self, config: TinyModelConfig = TinyModelConfig(), tp: int = 1) -> None:
        self.config = config
        self.tp = tp
        self.model = build_gpt(config, tp)
        self.vocab_size = config.vocab_size
        self.shape = Shape(config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
                           config.tie_word_embeddings, config.qkv_bias)

    def target_logprobs(self, batch: TreeBatch, attention: AttentionConfig) -> torch.Tensor:
        m = self.model
        device = next(m.parameters()).device
        tree = TreeAttention(batch.layout, attention, device)
        ids, pos = batch.input_ids[None].to(device), batch.position_ids[None].to(device)
        m.rotary_pos_emb.position_ids = batch.position_ids
        decoder_input, rotary = m._preprocess(input_ids=ids, position_ids=pos)[:2]
        hidden = m.decoder(hidden_states=decoder_input, attention_mask=tree, rotary_pos_emb=rotary)
        h = hidden[batch.source_index.to(device)]  # [t, 1, hidden]
        weight = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else None
        logits, _ = m.output_layer(h, weight=weight)  # [t, 1, vocab / tp]: this rank's vocab shard
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        # divided by the behaviour logprobs' temperatures (each shard by the same: the
        # softmax over the whole vocabulary is that of logits / T)
        scaled = tempered_logits(logits, batch.target_temperatures, in_place=True)
        return -vocab_parallel_cross_entropy(scaled, batch.target_ids.to(device)[:, None])[:, 0]

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return ((n, p) for n, p in self.model.named_parameters() if p.requires_grad)

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """Clips by the norm of the whole model's gradient, as the torch backend does: each
        rank holds a shard of the split parameters (counted on every rank) and a copy of the
        replicated ones (counted once, on TP rank 0), so the squares are summed over the
        tensor-parallel group. A per-rank ``clip_grad_norm_`` would clip by its shard's norm."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        rank = parallel_state.get_tensor_model_parallel_rank() if self.tp > 1 else 0
        square = torch.zeros((), dtype=torch.float64)
        for p in params:
            if p.grad is not None and (rank == 0 or getattr(p, "tensor_model_parallel", False)):
                square += p.grad.detach().double().pow(2).sum()
        if self.tp > 1:
            dist.all_reduce(square, group=parallel_state.get_tensor_model_parallel_group())
        norm = float(square.sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.detach().mul_(coef)
        return norm

    def _local_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.model.state_dict().items()
                if not k.endswith("_extra_state") and "rotary_pos_emb" not in k}

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        local = self._local_state()
        if self.tp > 1:
            local = {k: unshard(k, _all_gather(v.detach())) for k, v in local.items()}
        return {k: v.detach().clone() for k, v in mcore_to_hf(local, self.shape).items()}

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        from megatron.core import parallel_state

        rank = parallel_state.get_tensor_model_parallel_rank()
        full = hf_to_mcore(state, self.shape)
        local = self._local_state()
        missing = set(local) - set(full)
        if missing:
            raise KeyError(f"no HF weights for {sorted(missing)}")
        with torch.no_grad():
            for name, tensor in local.items():
                tensor.copy_(shard(name, full[name], rank, self.tp))


def _all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts
