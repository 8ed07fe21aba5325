"""The proxy in front of the real embedded engine (tiny Qwen-architecture model, real
tokenizer): an Anthropic streaming conversation whose second call reuses the first
call's tokens exactly and hits the engine's prefix cache."""

from __future__ import annotations

import anthropic
import pytest

from services.engine.main import build
from services.engine.settings import EngineSettings

from ._fakes import Served
from .conftest import RUN
from .tito_check import recorded_calls


@pytest.fixture(scope="module")
def real_engine(model_dir):
    service = build(EngineSettings(model="tiny-qwen", num_threads=1))
    served = Served(service.app)
    yield served
    served.stop()
    service.close()


async def test_conversation_on_the_real_engine(sdk, proxy, real_engine) -> None:
    for name in list(proxy.service.router.cells):
        proxy.service.router.remove_cell(name)
    proxy.service.add_cell("real", real_engine.url, capacity=4)
    base = await proxy.rollout("real-1")
    client = sdk(anthropic.AsyncAnthropic(base_url=base, api_key="k-secret", max_retries=0))
    messages = [{"role": "user", "content": "Write hello world in Python."}]
    async with client.messages.stream(model="claude-opus-4-8", max_tokens=24, messages=messages,
                                      system="You are a coder.", extra_body={"temperature": 0.0}) as s:
        first = await s.get_final_message()
    text = "".join(b.text for b in first.content if b.type == "text")
    messages += [{"role": "assistant", "content": text or "(empty)"}, {"role": "user", "content": "Now in C."}]
    second = await client.messages.create(model="claude-opus-4-8", max_tokens=8, messages=messages,
                                          system="You are a coder.", extra_body={"temperature": 0.0})
    recorded = list((await recorded_calls(proxy.bus, proxy.blobs, RUN)).values())
    assert len(recorded) == 2
    one, two = recorded
    assert two.event.parent_call_id == one.event.call_id
    assert two.input_ids[: len(one.input_ids) + len(one.output_ids)] == one.input_ids + one.output_ids \
        or two.event.prefix_len <= len(one.input_ids)
    assert two.event.prefix_len > len(one.input_ids) or not text  # generated tokens were reused as generated
    assert second.usage.cache_read_input_tokens >= len(one.input_ids)  # the engine's prefix cache served it
    assert one.event.n_output_tokens == first.usage.output_tokens
