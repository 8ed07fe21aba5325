"""The tiny model's init recipe: what the warm start and the engine tests rely on."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from services.engine.model_store import INIT_STD, QK_INIT_STD, TINY_QWEN_VERSION


def test_tiny_qwen_draws_query_and_key_small_and_the_rest_wide(tiny_model_dir):
    # Wide matrices keep the random model's greedy output peaked and varied; small q/k keep
    # its attention trainable (at 0.2 the warm start left name/constant pairs collapsed).
    assert tiny_model_dir.name.endswith(f"-v{TINY_QWEN_VERSION}")
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    matrices = {name: t for name, t in weights.items() if t.dim() == 2}
    qk = [n for n in matrices if n.endswith(("q_proj.weight", "k_proj.weight"))]
    assert len(qk) == 4  # 2 layers x (q, k)
    for name, t in matrices.items():
        want = QK_INIT_STD if name in qk else INIT_STD
        assert abs(float(t.std()) - want) < 0.1 * want, (name, float(t.std()))


def test_tiny_qwen_random_model_does_not_echo_its_input(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    prompt = torch.arange(7000, 7040)[None]
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    new = out[0, prompt.shape[1]:].tolist()
    assert len(set(new)) > 1 and new[0] != int(prompt[0, -1])
