"""Opt-in: the SGLang adapter and client against a real SGLang 0.5.23 server on CPU.

Set ``GYRE_SGLANG_PYTHON`` to an interpreter with SGLang (``bash
services/engine/sglang_cpu_env.sh`` builds one); takes ~3-5 minutes (SGLang starts in
~90 s here). Runs the same calls as the GPU check script and compares SGLang's greedy
tokens and logprobs with the embedded engine's on the same model.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.engine.gpu_check import GREEDY, PROMPT, _free_port, run_checks

pytestmark = pytest.mark.slow
SGLANG_PYTHON = os.environ.get("GYRE_SGLANG_PYTHON")

if not SGLANG_PYTHON:
    pytest.skip("GYRE_SGLANG_PYTHON not set (bash services/engine/sglang_cpu_env.sh builds an SGLang CPU env)",
                allow_module_level=True)


async def test_real_sglang_answers_every_call_like_the_embedded_engine(tiny_model_dir, tmp_path, http):
    report = await run_checks("tiny-qwen", Path(tiny_model_dir), _free_port(), tmp_path, python=SGLANG_PYTHON,
                              cpu=True)
    failed = [s for s in report["steps"] if not s["ok"]]
    assert not failed, failed
    theirs = next(s for s in report["steps"] if s["step"] == "generate")["detail"]
    ours = (await http.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY,
                                               "return_logprob": True})).json()
    assert ours["output_ids"] == theirs["output_ids"]
    pairs = zip(ours["meta_info"]["output_token_logprobs"], theirs["meta_info"]["output_token_logprobs"])
    assert max(abs(a[0] - b[0]) for a, b in pairs) < 1e-4
