"""The prefix cache: a :class:`RadixCache` whose values are KV tensors ``[layers, 2, kv_heads, n, dim]``.

A new sequence copies its longest cached prefix into its own :class:`KVBuffer` and computes
only the rest; a finished (or retracted) sequence gives its KV back to the tree. The cap is
in bytes and becomes a token cap through the model's KV size per token.
"""

from __future__ import annotations

import torch

from .model_runner import KVBuffer, ModelShape
from .radix import RadixCache


def _split(value: torch.Tensor, at: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Clones, so evicting one half really frees its memory.
    return value[:, :, :, :at].clone(), value[:, :, :, at:].clone()


class PrefixKVCache:
    def __init__(self, shape: ModelShape, capacity_bytes: int) -> None:
        self.shape = shape
        self.capacity_tokens = max(0, capacity_bytes // shape.kv_bytes_per_token)
        self.tree: RadixCache[torch.Tensor] = RadixCache(self.capacity_tokens, _split)
        self.hits = 0
        self.lookups = 0

    @property
    def cached_tokens(self) -> int:
        return self.tree.total_tokens

    def attach_prefix(self, tokens: list[int], kv: KVBuffer) -> int:
        """Copies the longest cached prefix (leaving at least one token to compute) into ``kv``."""
        self.lookups += 1
        if self.capacity_tokens == 0:
            return 0
        matched, blocks = self.tree.match(tokens, limit=len(tokens) - 1)
        if matched:
            self.hits += 1
            kv.reserve(len(tokens) + 16)
            for block in blocks:
                kv.append_block(block)
        return matched

    def store(self, tokens: list[int], kv: KVBuffer) -> int:
        """Adds the sequence's computed KV (its first ``kv.length`` tokens) to the tree."""
        if self.capacity_tokens == 0 or kv.length == 0:
            return 0
        return self.tree.insert(tokens[: kv.length], lambda start, end: kv.slice(start, end))

    def export(self, tokens: list[int]) -> tuple[int, torch.Tensor]:
        matched, blocks = self.tree.match(tokens)
        if not blocks:
            return 0, torch.empty(self.shape.layers, 2, self.shape.kv_heads, 0, self.shape.head_dim)
        return matched, torch.cat(blocks, dim=3)

    def import_(self, tokens: list[int], kv: torch.Tensor) -> int:
        """Adds an imported prefix; returns how many new tokens the cache still holds after
        the insert (0 when it did not fit: what went in was evicted at once)."""
        expected = (self.shape.layers, 2, self.shape.kv_heads, len(tokens), self.shape.head_dim)
        if tuple(kv.shape) != expected or kv.dtype != torch.float32:
            raise ValueError(f"KV must be float32 {expected}, got {kv.dtype} {tuple(kv.shape)}")
        return self._kept(tokens, self.tree.insert(tokens, lambda start, end: kv[:, :, :, start:end].clone()))

    def held(self, tokens: list[int]) -> int:
        """Leading tokens of ``tokens`` whose KV the cache holds now."""
        return self.tree.held(tokens)

    def _kept(self, tokens: list[int], added: int) -> int:
        # An insert longer than the cap (or than what eviction can free) is evicted at once:
        # the new tokens are a leaf with the newest access, so they stay whole or go whole.
        return added if self.tree.held(tokens) == len(tokens) else 0

    def flush(self) -> None:
        self.tree.clear()
