"""Tree attention: each token sees its own segment up to itself and its ancestor segments.

Three ways to compute it, all exact:

- ``dense``: a boolean [s, s] mask built from the layout, one SDPA call (short trees).
- ``flex``: ``torch.nn.attention.flex_attention`` with a block mask whose ``mask_mod``
  reads the segment table (long trees on GPU; torch 2.13 has no flex backward on CPU).
- ``blocks``: block-sparse SDPA in plain autograd ops: each block of queries attends only
  to the tokens its segments can see, gathered; memory and work grow with the tree's
  depth, not with s^2 (long trees on CPU).

``tree_attention`` picks one by length and device; ``mode`` forces one (tests prove the
three equal). Tensors are [b, heads, s, d] as SDPA takes them; b is 1 for a packed tree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from .batch import TreeLayout

Mode = Literal["auto", "dense", "flex", "blocks"]


@dataclass(frozen=True)
class AttentionConfig:
    mode: Mode = "auto"
    # Above this, a long tree: flex on GPU, blocks on CPU. The dense mask costs s^2 bytes
    # (64 MB at 8192); SDPA itself tiles on CPU and GPU, so dense stays fast up to there.
    dense_max_tokens: int = 8192
    block_size: int = 256


def dense_mask(layout: TreeLayout, device: torch.device | str = "cpu") -> torch.Tensor:
    """[s, s] bool, True = may attend; built on ``device`` (on a GPU the s^2 gather is
    instant, where building it on the host and copying it cost more than the attention)."""
    seg = layout.segment_ids.to(device)
    s = seg.numel()
    idx = torch.arange(s, device=device)
    return layout.visible.to(device)[seg[:, None], seg[None, :]] & (idx[None, :] <= idx[:, None])


def flex_block_mask(layout: TreeLayout, block_size: int = 128, device: str | torch.device = "cpu"):
    """flex_attention's block mask for a tree, built from the segment table.

    ``create_block_mask`` evaluates the mask at every (query, key) pair: s^2 work and, not
    compiled, s^2 bytes (about 90 GB at 300k tokens). A tree's mask is known per segment,
    so the block-level structure comes from which segments each block holds: a key block
    is partial for a query block (below or on the diagonal) when some segment of the one
    sees some segment of the other, and full when every segment present in the query
    block sees every segment present in the key block, the key block lies wholly before
    it and both are whole blocks. The work is [blocks, segments] products, not s^2.
    The sequence is padded to whole blocks with a sentinel segment that sees nothing, so
    ``mask_mod`` never reads past the table (tests check the result against
    ``create_block_mask``)."""
    from torch.nn.attention.flex_attention import BlockMask

    seg = layout.segment_ids.to(device)
    n_seg = int(layout.visible.shape[0])
    s = seg.numel()
    n_blocks = -(-s // block_size)
    pad = n_blocks * block_size - s
    # sentinel segment n_seg: sees nothing and is seen by nothing
    visible = torch.zeros(n_seg + 1, n_seg + 1, dtype=torch.bool, device=device)
    visible[:n_seg, :n_seg] = layout.visible.to(device)
    seg_p = torch.cat([seg, torch.full((pad,), n_seg, dtype=seg.dtype, device=device)])

    block_of = torch.arange(s, device=device) // block_size
    present = torch.zeros(n_blocks, n_seg, dtype=torch.float64, device=device)
    present[block_of, seg] = 1.0  # [blocks, segments]: the block holds a token of the segment
    vis = layout.visible.to(device=device, dtype=torch.float64)
    some = (present @ vis @ present.T) > 0  # some query segment sees some key segment
    unseen = (present @ (1.0 - vis) @ present.T) > 0  # some query segment misses some key segment
    rows = torch.arange(n_blocks, device=device)
    on_or_below = rows[None, :] <= rows[:, None]
    strictly_below = rows[None, :] < rows[:, None]
    whole = torch.ones(n_blocks, dtype=torch.bool, device=device)
    whole[-1] = pad == 0
    full = strictly_below & ~unseen & whole[:, None] & whole[None, :]
    partial = on_or_below & some & ~full

    def as_indices(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = m.sum(-1, dtype=torch.int32)
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # kept blocks first, ascending
        return counts[None, None], order[None, None]

    kv_num, kv_idx = as_indices(partial)
    full_num, full_idx = as_indices(full)

    def mask_mod(b, h, q, kv):
        return (kv <= q) & visible[seg_p[q], seg_p[kv]]

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=mask_mod, seq_lengths=(s, s))


@dataclass(frozen=True)
class _Block:
    start: int
    stop: int
    kv_index: torch.Tensor  # tokens this block's queries may see (some of them)
    mask: torch.Tensor  # [stop - start, len(kv_index)] bool


def attention_blocks(layout: TreeLayout, block_size: int) -> list[_Block]:
    """Per query block, the visible key positions and the exact mask over them."""
    seg = layout.segment_ids
    s = seg.numel()
    out = []
    for start in range(0, s, block_size):
        stop = min(s, start + block_size)
        q_seg = seg[start:stop]
        seen_segments = layout.visible[q_seg].any(0)  # [n_seg]
        kv_index = torch.nonzero(seen_segments[seg[:stop]]).flatten()
        q_pos = torch.arange(start, stop)
        mask = layout.visible[q_seg[:, None], seg[kv_index][None, :]] & (kv_index[None, :] <= q_pos[:, None])
        out.append(_Block(start, stop, kv_index, mask))
    return out


class TreeAttention:
    """The attention structure of one batch, prepared once and used by every layer."""

    def __init__(self, layout: TreeLayout, config: AttentionConfig = AttentionConfig(),
                 device: torch.device | str = "cpu") -> None:
        self.layout = layout
        self.config = config
        self.device = torch.device(device)
        self.mode = self._pick(config.mode)
        self._dense = dense_mask(layout, self.device) if self.mode == "dense" else None
        self._flex = flex_block_mask(layout, 128, self.device) if self.mode == "flex" else None
        self._blocks = attention_blocks(layout, config.block_size) if self.mode == "blocks" else None

    def _pick(self, mode: Mode) -> str:
        if mode != "auto":
            return mode
        if self.layout.n_tokens <= self.config.dense_max_tokens:
            return "dense"
        return "flex" if self.device.type == "cuda" else "blocks"

    def dense(self) -> torch.Tensor:
        """The dense mask (for backends that only take one, e.g. megatron's local attention)."""
        return self._dense if self._dense is not None else dense_mask(self.layout, self.device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """q [b, h, s, d], k/v [b, h_kv, s, d] -> [b, h, s, d]."""
        if k.shape[1] != q.shape[1]:  # grouped-query attention: share each kv head
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.mode == "dense":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self._dense, scale=scale)
        if self.mode == "flex":
            return _flex_attention(q.is_cuda)(q, k, v, block_mask=self._flex, scale=scale)
        parts = []
        for blk in self._blocks:
            kv = blk.kv_index.to(q.device)
            parts.append(F.scaled_dot_product_attention(
                q[:, :, blk.start:blk.stop], k[:, :, kv], v[:, :, kv],
                attn_mask=blk.mask.to(q.device), scale=scale))
        return torch.cat(parts, dim=2)


#: compiled flex_attention variants one process may hold (dtype, head size, grad mode, ...).
#: torch's default of 8 was used up by the GPU check's mix of models; past the limit torch
#: would run flex eagerly, which materialises [s, s] scores (1.3 TB at 300k tokens).
FLEX_RECOMPILE_LIMIT = 64


@functools.cache
def _flex_attention(cuda: bool):
    """Compiled on GPU (the eager version materialises the scores; it is what CPU runs,
    forward only, in tests). Sequence lengths are dynamic, so batches of new sizes reuse
    the compiled kernel (checked on CPU: 1 graph for 6 layouts of two sizes); grad mode,
    dtype and head size each compile once. Past ``FLEX_RECOMPILE_LIMIT`` variants the call
    fails with a clear error instead of falling back to the eager, s^2-memory version.
    Checked on an H200 by ``services.trainer.gpu_check``."""
    from torch.nn.attention.flex_attention import flex_attention

    if not cuda:
        return flex_attention
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, FLEX_RECOMPILE_LIMIT)
    if not dynamo_config.suppress_errors:  # the two cannot both be set
        dynamo_config.fail_on_recompile_limit_hit = True
    compiled = torch.compile(flex_attention, dynamic=True)

    def call(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except Exception as exc:
            if type(exc).__name__ == "FailOnRecompileLimitHit":
                raise RuntimeError(
                    f"flex attention was compiled more than {dynamo_config.recompile_limit} times in this "
                    "process (each dtype, head size and grad mode is one variant); running it uncompiled "
                    "would hold the full [tokens, tokens] score matrix, so the trainer stops here. Raise "
                    "services.trainer.attention.FLEX_RECOMPILE_LIMIT or use attention mode 'blocks'") from exc
            raise

    return call
