"""Plain PyTorch backend: a transformers causal LM with tree attention.

Tree attention enters through transformers' attention registry: the model runs with
``attn_implementation="gyre_tree"`` (no mask is built: the registry has no mask function
for it) and the batch's :class:`TreeAttention` travels down to every layer as the
keyword ``gyre_tree`` (transformers passes a forward's extra keywords to the attention
function); RoPE uses the packed position ids (depths). Logits are computed only at the positions whose
child is trained (the lm head over a big vocabulary is the costliest part).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..attention import AttentionConfig, TreeAttention
from ..batch import TreeBatch
from .base import gather_logprobs

ATTENTION_NAME = "gyre_tree"


def _tree_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    tree = kwargs.get("gyre_tree")
    if not isinstance(tree, TreeAttention):
        raise TypeError("the gyre_tree attention needs the batch's TreeAttention (keyword gyre_tree)")
    out = tree(query, key, value, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register_tree_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _tree_attention_forward)


@dataclass(frozen=True)
class TinyModelConfig:
    """A small Qwen2-architecture model for tests and benchmarks (both backends)."""

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    qkv_bias: bool = True  # Qwen2 has biases on q/k/v; Llama has none
    seed: int = 0

    def hf_config(self):
        from transformers import Qwen2Config

        return Qwen2Config(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=1 << 20, rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings, torch_dtype="float32")


class TorchBackend:
    name = "torch"

    def __init__(self, model: torch.nn.Module) -> None:
        register_tree_attention()
        self.model = model
        self.model.config._attn_implementation = ATTENTION_NAME
        self.vocab_size = int(model.config.vocab_size)

    @classmethod
    def tiny(cls, config: TinyModelConfig = TinyModelConfig()) -> "TorchBackend":
        from transformers import Qwen2ForCausalLM

        torch.manual_seed(config.seed)
        return cls(Qwen2ForCausalLM(config.hf_config()).float())

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "TorchBackend":
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32))

    def target_logprobs(self, batch: TreeBatch, attention: AttentionConfig) -> torch.Tensor:
        device = next(self.model.parameters()).device
        tree = TreeAttention(batch.layout, attention, device)
        hidden = self.model.model(
            input_ids=batch.input_ids[None].to(device), position_ids=batch.position_ids[None].to(device),
            gyre_tree=tree, use_cache=False).last_hidden_state[0]
        logits = self.model.lm_head(hidden[batch.source_index.to(device)])
        return gather_logprobs(logits, batch.target_ids.to(device), batch.target_temperatures, in_place=True)

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return ((n, p) for n, p in self.model.named_parameters() if p.requires_grad)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state, strict=False)
