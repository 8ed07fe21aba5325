"""What the trainer needs from a model, whatever runs it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from ..attention import AttentionConfig
    from ..batch import TreeBatch


@runtime_checkable
class PolicyBackend(Protocol):
    name: str
    vocab_size: int

    def target_logprobs(self, batch: "TreeBatch", attention: "AttentionConfig") -> "torch.Tensor":
        """Log-probability of every target token of ``batch`` ([t], with gradient)."""

    def named_parameters(self) -> Iterator[tuple[str, "torch.nn.Parameter"]]:
        """The trainable parameters, in a stable order (gradients travel in this order)."""

    def hf_state_dict(self) -> dict[str, "torch.Tensor"]:
        """The weights under HF names: what inference cells load."""

    def load_hf_state_dict(self, state: dict[str, "torch.Tensor"]) -> None: ...


def gather_logprobs(logits: "torch.Tensor", targets: "torch.Tensor") -> "torch.Tensor":
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1)
