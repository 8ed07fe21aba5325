"""Weights between HF (Qwen2/Llama names) and megatron-core GPTModel (local layer spec).

megatron's fused QKV stores, per query group, that group's query heads, then its key
head, then its value head (``[ng * (q_per_group + 2) * d, hidden]``); its GLU ``fc1`` is
``[gate; up]``. Tensor parallelism splits column-parallel weights (QKV, fc1, vocab)
along dim 0 and row-parallel ones (attention output, fc2) along dim 1; for the GLU each
rank holds ``[gate_r; up_r]``. Pure tensor code: no megatron import.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    tied: bool
    qkv_bias: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def _qkv_to_mcore(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: Shape) -> torch.Tensor:
    ng, per = s.num_kv_heads, s.num_heads // s.num_kv_heads
    tail = q.shape[1:]
    q = q.reshape(ng, per * s.head_dim, *tail)
    k = k.reshape(ng, s.head_dim, *tail)
    v = v.reshape(ng, s.head_dim, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def _qkv_from_mcore(qkv: torch.Tensor, s: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ng, per, d = s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim
    tail = qkv.shape[1:]
    g = qkv.reshape(ng, (per + 2) * d, *tail)
    q, k, v = g.split([per * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _layer_names(i: int) -> dict[str, str]:
    h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    return {
        m + "input_layernorm.weight": h + "input_layernorm.weight",
        m + "self_attention.linear_proj.weight": h + "self_attn.o_proj.weight",
        m + "pre_mlp_layernorm.weight": h + "post_attention_layernorm.weight",
        m + "mlp.linear_fc2.weight": h + "mlp.down_proj.weight",
    }


def hf_to_mcore(hf: dict[str, torch.Tensor], s: Shape) -> dict[str, torch.Tensor]:
    """Full (unsharded) megatron state from an HF state dict."""
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not s.tied:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(s.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out.update({mk: hf[hk] for mk, hk in _layer_names(i).items()})
        a = h + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = _qkv_to_mcore(
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], s)
        if s.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _qkv_to_mcore(
                hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], s)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]])
    return out


def mcore_to_hf(mc: dict[str, torch.Tensor], s: Shape) -> dict[str, torch.Tensor]:
    """HF state dict from a full (unsharded) megatron state."""
    out = {"model.embed_tokens.weight": mc["embedding.word_embeddings.weight"],
           "model.norm.weight": mc["decoder.final_layernorm.weight"]}
    out["lm_head.weight"] = out["model.embed_tokens.weight"] if s.tied else mc["output_layer.weight"]
    for i in range(s.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out.update({hk: mc[mk] for mk, hk in _layer_names(i).items()})
        a = h + "self_attn."
        q, k, v = _qkv_from_mcore(mc[m + "self_attention.linear_qkv.weight"], s)
        out.update({a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v})
        if s.qkv_bias:
            q, k, v = _qkv_from_mcore(mc[m + "self_attention.linear_qkv.bias"], s)
            out.update({a + "q_proj.bias": q, a + "k_proj.bias": k, a + "v_proj.bias": v})
        gate, up = mc[m + "mlp.linear_fc1.weight"].chunk(2)
        out.update({h + "mlp.gate_proj.weight": gate, h + "mlp.up_proj.weight": up})
    return out


def split_dim(name: str) -> int | None:
    """The dimension tensor parallelism splits (None: replicated)."""
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight",
                      "word_embeddings.weight", "output_layer.weight")):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's slice of a full megatron tensor."""
    dim = split_dim(name)
    if dim is None or size == 1:
        return full
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
    return full.chunk(size, dim=dim)[rank]


def unshard(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from every rank's slice, in rank order."""
    dim = split_dim(name)
    if dim is None or len(parts) == 1:
        return parts[0]
    if name.endswith("linear_fc1.weight"):
        gates, ups = zip(*(p.chunk(2) for p in parts))
        return torch.cat([*gates, *ups])
    return torch.cat(parts, dim=dim)
