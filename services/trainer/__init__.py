"""The trainer: tree-attention policy optimisation, core/satellite streaming, publication.

Pure core (torch only; no NATS, HTTP or SQL):

- ``objective``  clipped PPO/GRPO surrogate against the behaviour logprobs, optional
  truncated IS correction and KL
- ``batch``      packed trees -> tensors (targets predicted from their parent's logits,
  per-execution weights), sample validation, the per-branch reference (1/k weights)
- ``attention``  tree attention: dense mask, flex block mask, block-sparse SDPA
- ``step``       one micro-step's gradient; the step's reduction and single update
- ``checkpoint`` weights + optimizer + step + consumed log position, written together

Backends (``backends/``, one Protocol): ``torch_hf`` (transformers model) and
``megatron`` (megatron-core GPTModel, gloo on CPU), ``convert`` (HF <-> megatron names).

Adapters and wiring: ``transfer`` (gradients/weights between cells: in-process, blob
store), ``worker`` (a cell's work loop on the JetStream work queue), ``core`` (the core
cell's updates), ``publish`` (weights to inference cells via EngineClient), ``replay``
(``gyre replay --step N``), ``bench`` (``gyre bench train``), ``seat`` (a satellite
as the cell agent hosts it: join/leave), ``main`` (``gyre serve trainer``), ``gpu_check``.
"""
