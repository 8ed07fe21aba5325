"""Shared models for the trainer tests (built once per session: megatron's model-parallel
state is process-wide)."""

from __future__ import annotations

import pytest

from services.trainer.backends.torch_hf import TinyModelConfig, TorchBackend

from .samples import two_branch_tree, workload_samples

TINY = TinyModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2)


@pytest.fixture
def torch_backend() -> TorchBackend:
    return TorchBackend.tiny(TINY)


@pytest.fixture(scope="session")
def megatron_model():
    pytest.importorskip("megatron.core")
    from services.trainer.backends.megatron import MegatronBackend

    return MegatronBackend(TINY)


@pytest.fixture
def megatron_backend(megatron_model, torch_backend):
    """The session's megatron model, loaded with a fresh tiny checkpoint."""
    megatron_model.load_hf_state_dict(torch_backend.hf_state_dict())
    return megatron_model


@pytest.fixture(scope="session")
def samples():
    """Two workload executions (tiny preset) and one hand-made tree, with advantages."""
    return list(zip(workload_samples(TINY.vocab_size), [0.7, -1.1])) + [(two_branch_tree("rx"), 0.5)]
