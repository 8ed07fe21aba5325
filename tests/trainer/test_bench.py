"""``gyre bench train``: the report's fields, on the tiny preset, for both backends."""

from __future__ import annotations

import pytest

from services.trainer.bench import run_bench

FIELDS = {"tree_tokens", "flat_tokens", "token_ratio", "tree_step_s", "flat_step_s", "speedup",
          "max_abs_loss_diff", "backend"}


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_bench_reports_tree_against_flat(backend):
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    report = run_bench(backend, preset="tiny", vocab=512)
    assert FIELDS <= set(report) and report["backend"] == backend
    assert report["flat_tokens"] > report["tree_tokens"] > 0
    assert report["token_ratio"] == pytest.approx(report["flat_tokens"] / report["tree_tokens"], abs=1e-3)
    assert report["max_abs_loss_diff"] <= 1e-5 and report["max_abs_grad_diff"] <= 1e-5
    assert report["step_loss"] != 0.0  # the loss depends on the model, not only on the advantages
