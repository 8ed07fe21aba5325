"""Trainer backends behind one Protocol (:class:`base.PolicyBackend`).

- ``torch_hf``  plain PyTorch on a transformers causal LM (Qwen2/Llama), tree attention
  through a registered attention function
- ``megatron``  megatron-core ``GPTModel`` (local layer spec; gloo on CPU, NCCL on GPU),
  RoPE fed from the packed position ids; ``convert`` maps weights to and from HF names
"""
