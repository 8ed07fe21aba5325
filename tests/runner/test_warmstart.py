"""The warm start (gyre/warmstart.py): the scripted solver's demonstrations are tokenized
exactly as the proxy tokenizes a live rollout (checked against the real proxy and the
real harness in front of a scripted cell), a short SFT lowers the loss, and the saved
folder loads in transformers, the engine and the trainer's torch backend."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from gyre.warmstart import (
    DEFAULT_CURRICULUM, DemoError, _stage_examples, build_demos, build_flawed_demos, completion_loss, flawed_files,
    grade, greedy_eval, render_demo, scripted_turns, stage_steps, train_sft, warm_start,
)
from services.engine.model_store import default_cache_dir, ensure_tiny_qwen
from services.proxy.adapters.template import HFRenderer
from services.proxy.api import openai_chat
from services.proxy.core.messages import Msg, tools_key
from services.proxy.core.tito import Tito
from services.proxy.core.toolparse import parse_output
from services.runner.agent.wire import openai_body
from services.runner.harness import gyre_agent
from services.runner.runner import RolloutRunner, RunnerConfig
from services.runner.tasks import load_tasks
from libs.common.events.calls import DriftClass

STARTERS = [t for t in load_tasks() if t.task_id.startswith("starter_")]
TRAIN = [t for t in STARTERS if t.split == "train"]
HELDOUT = [t for t in STARTERS if t.split == "heldout"]


@pytest.fixture(scope="module")
def base_dir():
    return ensure_tiny_qwen(default_cache_dir())


@pytest.fixture(scope="module")
def hf_renderer(base_dir) -> HFRenderer:
    return HFRenderer(base_dir)


def test_scripted_solver_writes_the_reference_solution_and_refuses_heldout() -> None:
    task = TRAIN[0]
    first, second = scripted_turns(task)
    [call] = first.reply.tool_calls
    solution = (task.files_dir.parent / "solution" / "solution.py").read_text()
    assert call.name == "write_file" and call.arguments == {"path": "solution.py", "content": solution}
    assert [m.role for m in second.request.messages] == ["user", "assistant", "tool"]
    assert second.request.messages[-1].text == f"wrote {len(solution.encode())} bytes to solution.py"
    assert not second.reply.tool_calls and second.reply.text
    assert "Agent" in [t.name for t in first.request.tools]  # the reference agent's depth-0 tool list
    with pytest.raises(DemoError):
        scripted_turns(HELDOUT[0])


def test_render_round_trip(hf_renderer) -> None:
    """Prompt = the proxy's rendering with a generation prompt; completion = the text the
    template adds for the reply, ending with <|im_end|>, parsing back into the same call;
    turn 2's prompt continues turn 1's ids (append, no re-tokenization)."""
    r = hf_renderer
    task = TRAIN[0]
    turns = scripted_turns(task)
    demo = render_demo(r, task.task_id, turns)
    t1, t2 = demo.turns
    req1 = openai_chat.parse(openai_body("policy", turns[0].request, 128, 1.0))
    assert r.decode(t1.prompt_ids) == r.render(req1.messages, req1.tools, add_generation_prompt=True)
    req2 = openai_chat.parse(openai_body("policy", turns[1].request, 128, 1.0))
    assert r.decode(t2.prompt_ids) == r.render(req2.messages, req2.tools, add_generation_prompt=True)
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.completion_ids)] == t1.prompt_ids + t1.completion_ids
    for turn, scripted in zip(demo.turns, turns):
        assert turn.completion_text.endswith("<|im_end|>") and turn.completion_ids[-1] == r.stop_token_ids[-1]
        assert r.decode(turn.completion_ids) == turn.completion_text
        assert r.encode(turn.completion_text) == turn.completion_ids
        parsed = parse_output(turn.completion_text, r.stop_texts)
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == \
               [(c.name, c.arguments) for c in scripted.reply.tool_calls]
    assert '"name": "write_file"' in t1.completion_text and "<tool_call>" not in t2.completion_text

    # the proxy's planner, fed the demo's turn-1 output, continues at the reply boundary
    tito = Tito(r, stop_texts=r.stop_texts)
    key = tools_key(req1.tools)
    plan1 = tito.plan(req1.messages, req1.tools, key)
    tito.record("c1", plan1, t1.completion_ids, parse_output(t1.completion_text, r.stop_texts).as_msg(),
                req1.tools, key, finish_stop=True)
    plan2 = tito.plan(req2.messages, req2.tools, key)
    # same text; retoken_drift only because the template's "assistant\n" + the reply's leading
    # "\n" would merge into one token if re-encoded: the proxy keeps the generated ids either way
    assert plan2.drift in (DriftClass.APPEND, DriftClass.RETOKEN_DRIFT) and plan2.parent_call_id == "c1"
    assert tito.input_ids(plan2) == t2.prompt_ids


async def test_demo_tokens_are_what_the_live_proxy_sends(stack, tmp_path, hf_renderer) -> None:
    """The real harness process, through the real proxy, in front of a cell that answers
    with the demonstration: the cell receives exactly the demo's prompt ids."""
    task = TRAIN[1]
    [demo] = build_demos(hf_renderer, [task])
    # the demo's own ids (the scripted cell's default would drop a leading newline that the
    # prompt already ends with, and the turn-1 completion starts with one, as the template has it)
    script = [list(t.completion_ids) for t in demo.turns]
    stack.engine._reply_ids = lambda input_ids: script.pop(0)
    runner = RolloutRunner(RunnerConfig(stack.run_id, stack.url, tmp_path / "work", harness=gyre_agent("openai")),
                           bus=stack.bus, blobs=stack.blobs)
    [out] = await runner.run_step(1, [task], 1)
    stats = json.loads(out.log_tail.strip().splitlines()[-1])
    assert out.status == "finished" and stats["stop"] == "done" and stats["calls"] == 2, out.log_tail
    assert stack.engine.received == [t.prompt_ids for t in demo.turns]
    assert stack.engine.outputs == [t.completion_ids for t in demo.turns]


def test_short_sft_lowers_the_loss_and_saves_a_loadable_folder(base_dir, tmp_path, hf_renderer) -> None:
    from transformers import AutoModelForCausalLM

    from services.engine.model_runner import ModelRunner
    from services.engine.model_store import resolve_model
    from services.trainer.backends.torch_hf import TorchBackend

    tasks = TRAIN[:3]
    out = tmp_path / "model"
    stats = warm_start(base_dir, out, tasks, steps=6, lr=3e-3, seed=0, batch_size=3, log=lambda _: None)
    assert stats["demos"] == 3 and stats["turns"] == 6 and stats["steps"] == 6 and stats["tokens"] > 0
    assert stats["loss_last"] < stats["loss_first"]

    examples = [(t.prompt_ids + t.completion_ids, len(t.prompt_ids)) for d in build_demos(hf_renderer, tasks)
                for t in d.turns]
    with torch.no_grad():
        before = float(completion_loss(AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32),
                                       examples)[0])
        model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        after = float(completion_loss(model, examples)[0])
    assert after < before - 1.0, (before, after)
    assert after == pytest.approx(stats["loss_final"], abs=1e-3)
    assert model.config.hidden_size == 128 and model.config.num_hidden_layers == 2
    assert model.config.tie_word_embeddings and model.config.vocab_size == 151936

    loc = resolve_model(str(out))  # the engine's loader
    ModelRunner.load(loc)
    TorchBackend.from_pretrained(loc.folder)  # the trainer's torch backend
    msgs = [Msg("system", "s"), Msg("user", "u")]
    assert HFRenderer(out).render(msgs, [], add_generation_prompt=True) == \
           HFRenderer(base_dir).render(msgs, [], add_generation_prompt=True)
    assert json.loads((out / "gyre_model.json").read_text())["recipe"] == "warmstart"


def test_sft_is_deterministic(base_dir, tmp_path) -> None:
    a = warm_start(base_dir, tmp_path / "a", TRAIN[:2], steps=2, lr=1e-3, seed=3, batch_size=4, log=lambda _: None)
    b = warm_start(base_dir, tmp_path / "b", TRAIN[:2], steps=2, lr=1e-3, seed=3, batch_size=4, log=lambda _: None)
    assert a["loss_final"] == b["loss_final"]
    with pytest.raises(DemoError):
        warm_start(base_dir, tmp_path / "c", [HELDOUT[0]], steps=1, lr=1e-3, seed=0, log=lambda _: None)


def test_greedy_eval_grades_the_written_file(base_dir, tmp_path) -> None:
    """The offline check on a tiny untrained model: it runs end to end and scores 0."""
    task = dataclasses.replace(HELDOUT[0])
    result = greedy_eval(base_dir, [task], max_new_tokens=8)
    assert result["tasks"] == 1 and result["mean_score"] == 0.0 and task.task_id in result["per_task"]



def test_curriculum_stages_split_the_steps_and_cut_prompts_from_the_start():
    assert stage_steps(260, DEFAULT_CURRICULUM) == [60, 40, 40, 40, 80]
    assert sum(stage_steps(7, DEFAULT_CURRICULUM)) == 7
    assert stage_steps(10, [("full", 1.0)]) == [10]
    with pytest.raises(ValueError):
        stage_steps(10, [("short", 0), ("full", 0)])
    full = [([1, 2, 3, 4, 5, 9, 9], 5), ([7, 8, 9], 2)]
    short = [([5, 9, 9], 1)]
    # the last 3 prompt tokens, the completion kept whole; a prompt shorter than the cut stays whole
    assert _stage_examples(full, short, 3) == [([3, 4, 5, 9, 9], 3), ([7, 8, 9], 2)]
    assert _stage_examples(full, short, "short") == short
    assert _stage_examples(full, short, "full") == full
    for bad in (0, -4, "half", True):
        with pytest.raises(ValueError):
            _stage_examples(full, short, bad)


def test_train_sft_refuses_stages_that_do_not_add_up(base_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, attn_implementation="sdpa")
    examples = [([1, 2, 3, 4], 2)]
    with pytest.raises(ValueError, match="add up"):
        train_sft(model, examples, steps=3, lr=1e-3, seed=0, batch_size=1, log=lambda _: None,
                  stages=[("full", examples, 2)])
    with pytest.raises(ValueError, match="no examples"):
        train_sft(model, examples, steps=1, lr=1e-3, seed=0, batch_size=1, log=lambda _: None,
                  stages=[("96", [], 1)])


def test_the_flawed_solution_prints_instead_of_returning_and_the_tests_catch_it(tmp_path):
    assert flawed_files({"a.py": "def f(x):\n    if x:\n        return x + 3  \n    return 0\n"}) == \
        {"a.py": "def f(x):\n    if x:\n        print(x + 3)\n    print(0)\n"}
    assert flawed_files({"a.py": "X = 1\n# return nothing\n"}) is None  # nothing to get wrong
    task = TRAIN[0]
    bad = flawed_files({"solution.py": (task.files_dir.parent / "solution" / "solution.py").read_text()})
    (tmp_path / "solution.py").write_text(bad["solution.py"])
    score = grade(tmp_path, task)
    assert 0.0 < score < 1.0  # the function is defined, nothing it returns is right


def test_flawed_demonstrations_render_and_are_drawn_at_the_flaw_rate(base_dir, hf_renderer):
    from transformers import AutoModelForCausalLM

    [good] = build_demos(hf_renderer, TRAIN[:1])
    [bad] = build_flawed_demos(hf_renderer, TRAIN[:1])
    assert "print(" in bad.turns[0].completion_text and "return" not in bad.turns[0].completion_text
    assert bad.turns[0].prompt_ids == good.turns[0].prompt_ids  # same task, same prompt; turn 2 sees the bad write
    assert bad.turns[1].completion_ids == good.turns[1].completion_ids

    seen: list[int] = []  # the last token of each drawn example: 3 the good variant, 4 the flawed one
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, attn_implementation="sdpa")
    pool, flawed = [([1, 2, 3], 2)], [([1, 2, 4], 2)]
    import gyre.warmstart as ws

    real = ws.completion_loss

    def spy(m, batch, pad_id=0):
        seen.extend(ids[-1] for ids, _ in batch)
        return real(m, batch, pad_id)

    ws.completion_loss = spy
    try:
        train_sft(model, pool, steps=40, lr=1e-6, seed=0, batch_size=1, log=lambda _: None,
                  stages=[("full", pool, 40)], flawed=[flawed], flaw_rate=0.6)
        with pytest.raises(ValueError, match="flaw_rate"):
            train_sft(model, pool, steps=1, lr=1e-6, seed=0, batch_size=1, log=lambda _: None, flaw_rate=1.0)
    finally:
        ws.completion_loss = real
    assert 0.4 < seen.count(4) / len(seen) < 0.8 and set(seen) == {3, 4}
