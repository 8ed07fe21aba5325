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


def gather_logprobs(logits: "torch.Tensor", targets: "torch.Tensor", temperatures: "torch.Tensor | None" = None,
                    *, in_place: bool = False) -> "torch.Tensor":
    """``log_softmax(logits / temperature)`` at each target ([t, V] logits, [t] targets).

    ``temperatures`` ([t], None: all 1.0) are those the behaviour logprobs were taken under
    (as the engine samples: SGLang returns tempered logprobs), so the ratio is 1 on-policy.
    ``in_place``: see :func:`tempered_logits`.
    """
    import torch

    scaled = tempered_logits(logits, temperatures, in_place=in_place)
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def tempered_logits(logits: "torch.Tensor", temperatures: "torch.Tensor | None", *,
                    in_place: bool = False) -> "torch.Tensor":
    """``logits`` in float32, each row divided by its temperature (``temperatures``: one
    per entry of the leading dimension; None: the logits as they are, no copy for float32).

    ``in_place`` divides the caller's tensor (or its float32 copy) instead of a new one: for
    a backend's own lm-head output, which no backward needs (a linear layer keeps its input
    and weight), so that tempering costs no second [t, V] tensor.
    """
    import torch

    scaled = logits.float()
    if temperatures is None:
        return scaled
    t = temperatures.to(scaled.device, torch.float32).view(-1, *([1] * (scaled.dim() - 1)))
    return scaled.div_(t) if in_place else scaled / t
