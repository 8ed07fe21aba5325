"""Runs Llama-family causal LMs (Llama, Qwen2, Qwen3) over a ragged batch with per-sequence KV.

The weights are the parameters of a transformers model loaded from a local folder (or
GGUF file); this module keeps references to those ``Parameter`` objects and runs its own
forward, so that one step can mix prompt chunks and single decode tokens of many sequences
(continuous batching) with a KV buffer per sequence. Weight updates change the parameters'
data in place; releasing memory swaps the data for empty tensors.

Each sequence's KV lives in one tensor ``[layers, 2, kv_heads, capacity, head_dim]`` that
grows by doubling. The prefix cache stores slices of it (see :mod:`.kv_cache`).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .model_store import ModelLocation

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

# The one-row output kernel "auto" chose, per output matrix shape and thread count, for
# the whole process: two runners in one process (the cells of a test or of one host's
# embedded run) must round alike, or a session moved between them with its KV cache
# continues with other logprobs than it would have where it was.
_ONE_ROW_CHOICE: dict[tuple, str] = {}
_ONE_ROW_LOCK = threading.Lock()
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
# A step whose biggest layer matmul is under this many multiply-adds runs its layer pass on
# one thread. Its ops are tiny (a decode step of tiny-qwen: 8 rows x 128 x 384), and torch
# hands even tiny bmm/softmax/linear calls to its OpenMP pool: ~10 us per op on an idle CPU,
# 0.4-5 ms per op on a busy one (measured, 2 threads vs 1: mean 0.7-4.8 ms vs 0.04 ms for an
# 8x128x384 linear while other processes ran). Bigger layer passes and the output matmul
# get their thread count from a ThreadChoice; everything else on the engine thread (KV
# copies, sampling) runs on one thread (see Engine._run).
SERIAL_LAYER_MACS = 1 << 22


class ThreadChoice:
    """Picks the intra-op thread count of one recurring op from its own measured times.

    Whether more OpenMP threads help depends on what else runs on the machine: torch splits
    an op's work statically, so when another process holds one of the cores the op waits for
    its slowest share, often a whole scheduler slice. Measured on the 2-core bench machine
    while another job ran: the tiny-qwen output matmul (one row) took 7.4 ms on one thread
    and 16 ms on two, a 4 MB KV copy 0.1 ms and 8-12 ms; on an idle machine two threads are
    the faster for the matmul. The candidates are one thread and all of them. The output
    kernels used here (row-blocked bmm, oneDNN on the packed matrix) and the layer pass gave
    the same bits either way (each block is computed whole by one thread; checked in
    tests/engine/test_model_runner.py and on tiny-qwen's 4k-token prefill), so the choice
    moves time only. (A BLAS may in general round differently by thread count; the serial
    rule above already allowed that.)

    Keyed by a size (the number of rows): each key first times every candidate ``warm``
    times, then runs the one with the lower moving average, and every ``probe_every``-th
    call times the other once more, so a change in load flips the choice within a few
    probes (the current choice is timed on every call, so its own slowdowns show at once).
    Worked example (candidates 1 and 2, warm 2, probe_every 16): calls 1-4 run on 1, 1, 2, 2
    threads; calls 5-15 on the faster; call 16 on the other; and so on.
    """

    ALPHA = 0.5  # weight of the newest time in the moving average

    def __init__(self, warm: int = 2, probe_every: int = 16) -> None:
        self.warm = warm
        self.probe_every = probe_every
        self._calls: dict[tuple[int, int], int] = {}
        self._times: dict[tuple[int, int], dict[int, tuple[int, float]]] = {}  # -> {threads: (runs, avg s)}

    def pick(self, key: int, threads: int) -> int:
        """The thread count for the next call of size ``key`` when ``threads`` are available."""
        if threads <= 1:
            return threads
        slot = (key, threads)
        calls = self._calls[slot] = self._calls.get(slot, 0) + 1
        times = self._times.setdefault(slot, {1: (0, 0.0), threads: (0, 0.0)})
        for candidate, (runs, _) in times.items():
            if runs < self.warm:
                return candidate
        best = min(times, key=lambda t: times[t][1])
        if calls % self.probe_every == 0:
            return 1 if best == threads else threads
        return best

    def record(self, key: int, threads: int, used: int, seconds: float) -> None:
        times = self._times.get((key, threads))
        if times is None or used not in times:
            return
        runs, avg = times[used]
        times[used] = (runs + 1, seconds if runs == 0 else (1 - self.ALPHA) * avg + self.ALPHA * seconds)

    def chosen(self, key: int, threads: int) -> int | None:
        """The current choice for ``key`` once every candidate has been timed (None before)."""
        times = self._times.get((key, threads))
        if times is None or any(runs < self.warm for runs, _ in times.values()):
            return None
        return min(times, key=lambda t: times[t][1])


@dataclass(frozen=True)
class ModelShape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab_size: int
    max_positions: int
    eps: float
    model_type: str

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 4


@dataclass
class _Layer:
    input_norm: torch.nn.Parameter
    post_norm: torch.nn.Parameter
    q: torch.nn.Module
    k: torch.nn.Module
    v: torch.nn.Module
    o: torch.nn.Module
    q_norm: torch.nn.Parameter | None
    k_norm: torch.nn.Parameter | None
    gate: torch.nn.Module
    up: torch.nn.Module
    down: torch.nn.Module


class KVBuffer:
    """The KV of one sequence: ``data[layer, 0|1, kv_head, position, dim]``."""

    def __init__(self, shape: ModelShape, capacity: int, limit: int | None = None) -> None:
        self.shape = shape
        # the most this sequence will hold (its admitted worst case, prompt + max_new_tokens):
        # growth by doubling stops there, so running KV stays within what admission counted
        self.limit = limit
        capacity = max(capacity, 16)
        if limit is not None:
            capacity = max(1, min(capacity, limit))
        self.data = torch.empty(shape.layers, 2, shape.kv_heads, capacity, shape.head_dim)
        self.length = 0

    def reserve(self, needed: int) -> None:
        cap = self.data.shape[3]
        if needed <= cap:
            return
        new_cap = max(needed, cap * 2)
        if self.limit is not None:
            new_cap = max(needed, min(new_cap, self.limit))
        grown = torch.empty(*self.data.shape[:3], new_cap, self.data.shape[4])
        grown[:, :, :, : self.length] = self.data[:, :, :, : self.length]
        self.data = grown

    def append_block(self, block: torch.Tensor) -> None:
        """Appends cached KV ``[layers, 2, kv_heads, n, dim]`` (a prefix-cache hit)."""
        n = block.shape[3]
        self.reserve(self.length + n)
        self.data[:, :, :, self.length : self.length + n] = block
        self.length += n

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def slice(self, start: int, end: int) -> torch.Tensor:
        return self.data[:, :, :, start:end].clone()


@dataclass(frozen=True)
class ForwardItem:
    kv: KVBuffer
    token_ids: list[int]  # fed tokens; their positions start at kv.length
    want_logits: bool


class ModelRunner:
    def __init__(self, model: "PreTrainedModel", location: ModelLocation) -> None:
        self.model = model.eval()
        self.location = location
        cfg = model.config
        if cfg.model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {cfg.model_type!r}; use one of {SUPPORTED_ARCHITECTURES}")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {cfg.hidden_act!r}")
        heads = cfg.num_attention_heads
        self.shape = ModelShape(
            layers=cfg.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            hidden=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            max_positions=cfg.max_position_embeddings,
            eps=cfg.rms_norm_eps,
            model_type=cfg.model_type,
        )
        inner = model.model
        self._embed = inner.embed_tokens
        self._final_norm = inner.norm.weight
        self._lm_head = model.lm_head
        self._rotary = inner.rotary_emb
        self._layers = [_bind_layer(layer) for layer in inner.layers]
        self._scale = self.shape.head_dim**-0.5
        self._macs_per_token = self.shape.hidden * max(getattr(cfg, "intermediate_size", 0), heads * self.shape.head_dim)
        vocab = self.shape.vocab_size
        self._packed_head: tuple[tuple, torch.Tensor] | None = None
        self._pack_usable = torch.backends.mkldnn.is_available()
        self._lm_groups = next((g for g in (64, 32, 16, 8, 4, 2) if vocab % g == 0 and vocab // g >= 1024), 1)
        # the one-row output kernel: "linear", "blocked" or "auto" (both timed on first use,
        # then the faster kept for the life of the runner; see _output_product)
        self.output_kernel: str = "auto"
        self._one_row_kernel: str | None = None
        # intra-op threads the big ops may use (the engine thread itself runs on one)
        self.threads = torch.get_num_threads()
        self.output_threads = ThreadChoice()  # keyed by rows
        self.layer_threads = ThreadChoice()  # keyed by the bit length of the fed token count

    # -- loading ---------------------------------------------------------------------
    @classmethod
    def load(cls, location: ModelLocation) -> "ModelRunner":
        from transformers import AutoModelForCausalLM

        kwargs = {"dtype": torch.float32}
        if location.gguf_file:
            kwargs["gguf_file"] = location.gguf_file
        model = AutoModelForCausalLM.from_pretrained(str(location.folder), **kwargs)
        return cls(model, location)

    def new_kv(self, capacity: int, limit: int | None = None) -> KVBuffer:
        return KVBuffer(self.shape, capacity, limit)

    # -- forward ---------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, items: list[ForwardItem]) -> torch.Tensor:
        """Runs one step; returns last-token logits ``[n_wanted, vocab]`` in item order.

        Each item's KV grows by its fed tokens.
        """
        ids: list[int] = []
        positions: list[int] = []
        for item in items:
            item.kv.reserve(item.kv.length + len(item.token_ids))
            ids.extend(item.token_ids)
            positions.extend(range(item.kv.length, item.kv.length + len(item.token_ids)))
        serial = len(ids) * self._macs_per_token <= SERIAL_LAYER_MACS
        key = len(ids).bit_length()
        use = 1 if serial else self.layer_threads.pick(key, self.threads)
        start = time.perf_counter()
        with thread_count(use):
            h = self._embed(torch.tensor(ids, dtype=torch.long))
            pos = torch.tensor(positions, dtype=torch.long)
            cos, sin = self._rotary(h, pos[None])
            cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # [T, 1, head_dim]
            for index, layer in enumerate(self._layers):
                h = self._layer_forward(index, layer, h, cos, sin, items)
        if not serial:
            self.layer_threads.record(key, self.threads, use, time.perf_counter() - start)
        for item in items:
            item.kv.length += len(item.token_ids)
        last, offset = [], 0
        for item in items:
            offset += len(item.token_ids)
            if item.want_logits:
                last.append(offset - 1)
        if not last:
            return torch.empty(0, self.shape.vocab_size)
        hidden = F.rms_norm(h[last], (self.shape.hidden,), self._final_norm, self.shape.eps)
        return self._logits(hidden)

    def weights_changed(self) -> None:
        """Drops what was derived from the weights (the packed output matrix); call after
        writing parameters by any path that bypasses autograd's version counter (``.data``)."""
        self._packed_head = None

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """:meth:`_output_product` on the thread count :class:`ThreadChoice` picks for this many rows."""
        n = hidden.shape[0]
        if n > 1:
            with thread_count(self.threads):
                self._packed_output_matrix()  # (re)built outside the timed call
        elif self._one_row_kernel is None:
            with thread_count(self.threads):
                self._one_row_kernel = self._choose_one_row_kernel(hidden)  # outside the timed call
        use = self.output_threads.pick(n, self.threads)
        start = time.perf_counter()
        with thread_count(use):
            out = self._output_product(hidden)
        self.output_threads.record(n, self.threads, use, time.perf_counter() - start)
        return out

    def _blocked_usable(self) -> bool:
        weight = self._lm_head.weight
        groups = self._lm_groups
        return (groups > 1 and weight.shape[0] % groups == 0 and self._lm_head.bias is None
                and weight.is_contiguous())

    def _choose_one_row_kernel(self, hidden: torch.Tensor) -> str:
        """The one-row output kernel: the configured one, or under "auto" the faster of the
        two, timed once per process and matrix shape (interleaved, best of 5 each after a
        warm-up) and then kept, so one process's outputs never switch kernels mid-run and
        its runners never differ (the kernels round differently)."""
        if self.output_kernel not in ("auto", "linear", "blocked"):
            raise ValueError(f"output_kernel must be auto, linear or blocked, not {self.output_kernel!r}")
        if self.output_kernel != "auto":
            return self.output_kernel if self._blocked_usable() else "linear"
        if not self._blocked_usable():
            return "linear"
        weight = self._lm_head.weight
        key = (tuple(weight.shape), str(weight.dtype), self._lm_groups, self.threads)
        with _ONE_ROW_LOCK:  # one timing per process and shape; later runners take its answer
            if key not in _ONE_ROW_CHOICE:
                _ONE_ROW_CHOICE[key] = self._time_one_row_kernels(hidden)
            return _ONE_ROW_CHOICE[key]

    def _time_one_row_kernels(self, hidden: torch.Tensor) -> str:
        best = {"linear": float("inf"), "blocked": float("inf")}
        for round_ in range(6):
            for kernel in best:
                start = time.perf_counter()
                self._one_row(hidden, kernel)
                if round_:
                    best[kernel] = min(best[kernel], time.perf_counter() - start)
        kernel = min(best, key=best.get)
        log.info("one-row output kernel: %s (best of 5: linear %.2f ms, blocked %.2f ms)", kernel,
                 best["linear"] * 1e3, best["blocked"] * 1e3)
        return kernel

    def _one_row(self, hidden: torch.Tensor, kernel: str) -> torch.Tensor:
        if kernel == "linear":
            return self._lm_head(hidden)
        weight = self._lm_head.weight
        groups, vocab = self._lm_groups, weight.shape[0]
        blocks = weight.view(groups, vocab // groups, weight.shape[1])
        return torch.bmm(blocks, hidden.T.expand(groups, -1, 1)).view(vocab, 1).T

    def _output_product(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden @ lm_head.T`` as ``[n, vocab]``, exact fp32.

        The output matrix of a small model is most of its bytes (151936 x 128 fp32 is 78 MB
        for the tiny model), so every decode step is one pass over it, and which kernel
        reaches memory speed depends on the CPU. One row: on an AMD EPYC (MKL) ``F.linear``
        read it at about a quarter of memory bandwidth and the same product split into
        ``groups`` row blocks of one batched matmul at memory speed; on an Intel Xeon
        ``F.linear`` took 1.5 ms on two threads and the blocks 3.0 ms (10 ms on one thread).
        So the one-row kernel is timed once per runner and the faster kept
        (``output_kernel``, ``GYRE_ENGINE_OUTPUT_KERNEL`` to fix it). Several rows: oneDNN's
        matmul on a copy of the matrix in its blocked layout (built on first use, rebuilt
        when the weight changes) was the fastest on both (Xeon, 8 rows, two threads: 2.2 ms
        against 3.7 ms for ``F.linear``) and writes ``[n, vocab]`` directly. Same dot
        products, fp32 throughout; only the kernel differs (and with it the last bits).
        """
        weight = self._lm_head.weight
        n = hidden.shape[0]
        if n > 1:
            packed = self._packed_output_matrix()
            if packed is not None:
                return torch.ops.mkldnn._linear_pointwise(hidden, packed, None, "none", [None], "")
        if n == 1:
            if self._one_row_kernel is None:
                self._one_row_kernel = self._choose_one_row_kernel(hidden)
            if self._one_row_kernel == "linear" or not self._blocked_usable():
                return self._lm_head(hidden)
            return self._one_row(hidden, "blocked")
        groups = self._lm_groups
        vocab = weight.shape[0]
        if not self._blocked_usable():
            return self._lm_head(hidden)
        blocks = weight.view(groups, vocab // groups, weight.shape[1])
        out = torch.bmm(blocks, hidden.T.expand(groups, -1, n)).view(vocab, n)
        with single_thread():  # a plain copy: one thread keeps up with memory here
            return out.T.contiguous()

    def _packed_output_matrix(self):
        """The output matrix in oneDNN's layout, or None where that path is unavailable.

        Keyed on the weight's storage, shape and autograd version counter, so in-place
        writes (``param.copy_``) and swapped data (release/resume) rebuild it; writers that
        go through ``.data`` call :meth:`weights_changed`.
        """
        if not self._pack_usable:
            return None
        weight = self._lm_head.weight
        key = (weight.data_ptr(), tuple(weight.shape), weight._version)
        if self._packed_head is not None and self._packed_head[0] == key:
            return self._packed_head[1]
        self._packed_head = None
        if self._lm_head.bias is not None or weight.dim() != 2 or weight.numel() == 0:
            return None
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)
            probe = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0))
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [None], "")
            if not torch.allclose(got, F.linear(probe, weight), atol=1e-4, rtol=1e-4):
                raise RuntimeError("packed output matrix disagrees with F.linear")
        except (RuntimeError, AttributeError) as exc:  # no oneDNN in this torch build, or a changed op
            log.warning("oneDNN output matmul unavailable (%s); using batched matmul", exc)
            self._pack_usable = False
            return None
        self._packed_head = (key, packed)
        return packed

    def _layer_forward(self, index, layer: _Layer, h, cos, sin, items: list[ForwardItem]):
        s = self.shape
        x = F.rms_norm(h, (s.hidden,), layer.input_norm, s.eps)
        t = x.shape[0]
        q = layer.q(x).view(t, s.heads, s.head_dim)
        k = layer.k(x).view(t, s.kv_heads, s.head_dim)
        v = layer.v(x).view(t, s.kv_heads, s.head_dim)
        if layer.q_norm is not None:
            q = F.rms_norm(q, (s.head_dim,), layer.q_norm, s.eps)
            k = F.rms_norm(k, (s.head_dim,), layer.k_norm, s.eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = torch.empty(t, s.heads, s.head_dim)
        offset = 0
        for item in items:
            n = len(item.token_ids)
            past = item.kv.length
            kv = item.kv.data[index]
            kv[0, :, past : past + n] = k[offset : offset + n].transpose(0, 1)
            kv[1, :, past : past + n] = v[offset : offset + n].transpose(0, 1)
            keys, values = kv[0, :, : past + n], kv[1, :, : past + n]
            if n == 1:
                out[offset] = self._attend_one(q[offset], keys, values)
            else:
                query = q[offset : offset + n].transpose(0, 1)[None]
                out[offset : offset + n] = self._attend(query, keys[None], values[None], past, n)[0].transpose(0, 1)
            offset += n
        h = h + layer.o(out.view(t, s.heads * s.head_dim))
        x = F.rms_norm(h, (s.hidden,), layer.post_norm, s.eps)
        return h + layer.down(F.silu(layer.gate(x)) * layer.up(x))

    def _attend_one(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """One decode token: ``query [heads, dim]`` over ``keys/values [kv_heads, L, dim]``.

        Two small batched matmuls and a softmax, query heads grouped per KV head (head ``h``
        reads KV head ``h // group``, as transformers' ``repeat_kv``). Same sums as SDPA; for
        contexts of hundreds of tokens these stay below torch's parallel grain, while SDPA
        always enters a parallel region, whose thread hand-off costs more than the work on
        a busy CPU (measured at 320 tokens, 2 threads, loaded machine: 0.02 ms vs ~6 ms).
        """
        s = self.shape
        grouped = query.view(s.kv_heads, s.heads // s.kv_heads, s.head_dim)
        scores = torch.bmm(grouped, keys.transpose(1, 2)).mul_(self._scale)
        return torch.bmm(torch.softmax(scores, dim=-1), values).view(s.heads, s.head_dim)

    def _attend(self, query, keys, values, past: int, n: int) -> torch.Tensor:
        gqa = self.shape.heads != self.shape.kv_heads
        if past == 0:
            return F.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=self._scale, enable_gqa=gqa
            )
        rows = torch.arange(n)[:, None] + past
        cols = torch.arange(past + n)[None, :]
        mask = cols <= rows
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=self._scale, enable_gqa=gqa)

    # -- weights ---------------------------------------------------------------------
    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.model.named_parameters())

    def tied_aliases(self) -> dict[str, str]:
        """Names a checkpoint may use for a parameter stored under another name."""
        aliases = {}
        if getattr(self.model.config, "tie_word_embeddings", False):
            aliases["lm_head.weight"] = "model.embed_tokens.weight"
        return aliases


def _bind_layer(layer) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    return _Layer(
        input_norm=layer.input_layernorm.weight,
        post_norm=layer.post_attention_layernorm.weight,
        q=attn.q_proj,
        k=attn.k_proj,
        v=attn.v_proj,
        o=attn.o_proj,
        q_norm=q_norm.weight if q_norm is not None else None,
        k_norm=k_norm.weight if k_norm is not None else None,
        gate=mlp.gate_proj,
        up=mlp.up_proj,
        down=mlp.down_proj,
    )


@contextmanager
def thread_count(wanted: int):
    """Runs the block on ``wanted`` intra-op threads (this thread's setting; restored after)."""
    threads = torch.get_num_threads()
    if wanted == threads:
        yield
        return
    torch.set_num_threads(wanted)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def single_thread(active: bool = True):
    """Runs the block on one intra-op thread (when ``active``)."""
    return thread_count(1 if active else torch.get_num_threads())


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
