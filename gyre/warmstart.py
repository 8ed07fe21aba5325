"""Phase 0 of a run: a warm start by supervised fine-tuning on a scripted solver's
demonstrations of the *train* tasks (held-out tasks are refused), before any RL.

1. **Scripted solver** (``scripted_turns``): each task solved the way the reference agent
   (services/runner/agent) would do it: turn 1 one ``write_file`` call per file of the
   task's ``solution/`` folder, whose real result text comes from running the agent's
   ``Workspace`` tool in a temporary folder; turn 2 a short final reply with no tool call,
   which ends the agent's run. Optionally imperfect (``flawed_files``: ``print`` where the
   solution returns), drawn at ``flaw_rate`` per batch during SFT.
2. **Exact tokens** (``render_demo``): each turn goes the way a live call goes: the agent's
   ``Request`` -> ``openai_body`` -> the proxy's ``openai_chat.parse`` -> the proxy's
   token-in-token-out planner (``Tito``, over ``HFRenderer``) for the prompt ids, so turn 2's
   prompt reuses turn 1's prompt and completion ids as the proxy does. The completion is what
   the model must write: the text the chat template adds for the assistant message (the
   difference between rendering the conversation with the reply, without a generation
   prompt, and the prompt rendering), cut after the end-of-turn token; it must parse back
   (``toolparse.parse_output``) into the same tool calls.
3. **SFT** (``warm_start``): cross-entropy on completion tokens only (the lm_head runs only
   at those positions: over a 151k vocabulary it is the cost; a batch is packed as one
   sequence holding the shared system-and-tools prefix once), AdamW, a fixed seed, a
   prompt-length curriculum (see ``warm_start``), then an HF folder (safetensors + the base
   folder's tokenizer, chat template and generation config) that the engine and the
   trainer's torch backend load like the base model.

``greedy_eval`` measures a model folder offline (greedy turn 1 and turn 2 on the rendered
prompts, the written files graded by the task's hidden tests) for tuning the settings.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.runner.agent.convo import Message, ToolCall
from services.runner.agent.loop import MAIN_SYSTEM, AgentConfig
from services.runner.agent.tools import AGENT_SPEC, SPECS, Workspace
from services.runner.agent.wire import Request, ToolSpec, openai_body
from services.runner.tasks import Task, default_tasks_dir

FINAL_REPLY = "I wrote {paths}; the task is done."
MODEL_NAME = "policy"  # what the harness sends as the model (it does not reach the template)
# files of a model folder that are not weights or config: copied from the base folder
_CARRIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
            "chat_template.json", "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")


class DemoError(ValueError):
    """A task that cannot be demonstrated (no reference solution, held out, bad rendering)."""


def agent_tools(depth: int = 0, config: AgentConfig = AgentConfig()) -> list[ToolSpec]:
    """The reference agent's tool list at ``depth`` (its default config: Agent tool at depth 0)."""
    return [*SPECS.values(), *([AGENT_SPEC] if depth < config.max_depth else [])]


# -- 1. the scripted solver ---------------------------------------------------------------

@dataclass(frozen=True)
class ScriptedTurn:
    request: Request  # what the agent sends
    reply: Message  # what the model should answer (assistant)


def solution_files(task: Task, tasks_root: Path | None = None) -> dict[str, str]:
    folder = (tasks_root or default_tasks_dir()) / task.task_id / "solution"
    files = {p.relative_to(folder).as_posix(): p.read_text(encoding="utf-8")
             for p in sorted(folder.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}
    if not files:
        raise DemoError(f"task {task.task_id}: no reference solution in {folder}")
    return files


_RETURN_LINE = re.compile(r"^(?P<indent>[ \t]*)return (?P<value>.+?)[ \t]*$", re.MULTILINE)


def flawed_files(files: dict[str, str]) -> dict[str, str] | None:
    """The scripted solver's flawed variant of a solution: every ``return VALUE`` line
    prints the value instead (``print(VALUE)``), a beginner's bug that the hidden tests
    catch (the function returns ``None``). ``None`` when no file has such a line."""
    out = {path: _RETURN_LINE.sub(lambda m: f"{m['indent']}print({m['value']})", text) for path, text in files.items()}
    return out if out != files else None


def scripted_turns(task: Task, tasks_root: Path | None = None, *, tools: list[ToolSpec] | None = None,
                   files: dict[str, str] | None = None) -> list[ScriptedTurn]:
    """The two turns of the scripted solver, with the tool's real result text. ``files``:
    what turn 1 writes (default: the task's reference solution)."""
    if task.split != "train":
        raise DemoError(f"task {task.task_id} is {task.split}: the warm start never sees held-out tasks")
    tools = agent_tools() if tools is None else tools
    files = solution_files(task, tasks_root) if files is None else files
    calls = tuple(ToolCall(f"call_{i}", "write_file", {"path": path, "content": text},
                           json.dumps({"path": path, "content": text}))
                  for i, (path, text) in enumerate(files.items()))
    first = Message("assistant", "", calls)
    history = [Message("user", task.prompt)]
    turns = [ScriptedTurn(Request(MAIN_SYSTEM, list(history), tools, {}), first)]
    with tempfile.TemporaryDirectory(prefix="gyre-demo-") as tmp:
        if task.files_dir is not None:
            shutil.copytree(task.files_dir, tmp, dirs_exist_ok=True)
        ws = Workspace(Path(tmp))
        results = []
        for c in calls:
            text, is_error = ws.call(c.name, c.arguments or {})
            if is_error:
                raise DemoError(f"task {task.task_id}: the scripted {c.name} failed: {text}")
            results.append(Message("tool", text, tool_call_id=c.id, is_error=is_error))
    history += [first, *results]
    final = Message("assistant", FINAL_REPLY.format(paths=", ".join(files)))
    turns.append(ScriptedTurn(Request(MAIN_SYSTEM, list(history), tools, {}), final))
    return turns


# -- 2. exact tokens ----------------------------------------------------------------------

@dataclass(frozen=True)
class TokenTurn:
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_text: str
    short_prompt_ids: Sequence[int] = ()  # the same turn without the system prompt and tool list (curriculum)


@dataclass(frozen=True)
class Demo:
    task_id: str
    turns: tuple[TokenTurn, ...]


def _proxy_request(req: Request) -> Any:
    from services.proxy.api import openai_chat

    return openai_chat.parse(openai_body(MODEL_NAME, req, 128, 1.0))


def completion_text(renderer: Any, req: Request, reply: Message) -> str:
    """What the model must write for ``reply``: the template's text for the assistant message
    after the generation prompt, up to and including the end-of-turn token."""
    before = _proxy_request(req)
    after = _proxy_request(Request(req.system, [*req.messages, reply], req.tools, req.headers))
    prompt = renderer.render(before.messages, before.tools, add_generation_prompt=True)
    full = renderer.render(after.messages, after.tools, add_generation_prompt=False)
    if not full.startswith(prompt):
        raise DemoError("the chat template does not extend the prompt with the reply")
    added = full[len(prompt):]
    eot = renderer.tokenizer.eos_token or "<|im_end|>"
    cut = added.rfind(eot)
    if cut < 0 or added[cut + len(eot):].strip():
        raise DemoError(f"the rendered reply does not end with {eot!r}: {added[-40:]!r}")
    return added[: cut + len(eot)]


def _same_calls(parsed: Sequence[Any], wanted: Sequence[ToolCall]) -> bool:
    return [(c.name, c.arguments) for c in parsed] == [(c.name, c.arguments) for c in wanted]


def render_demo(renderer: Any, task_id: str, turns: list[ScriptedTurn]) -> Demo:
    """Token ids of every turn, as the proxy would build them (one ``Tito`` per rollout)."""
    from services.proxy.core.messages import tools_key
    from services.proxy.core.toolparse import parse_output
    from services.proxy.core.tito import Tito

    stops = tuple(getattr(renderer, "stop_texts", ("<|im_end|>",)))
    tito = Tito(renderer, stop_texts=stops)
    out = []
    for i, turn in enumerate(turns):
        req = _proxy_request(turn.request)
        key = tools_key(req.tools)
        plan = tito.plan(req.messages, req.tools, key)
        prompt_ids = tito.input_ids(plan)
        text = completion_text(renderer, turn.request, turn.reply)
        ids = renderer.encode(text)
        parsed = parse_output(text, stops)
        if not _same_calls(parsed.tool_calls, turn.reply.tool_calls) or parsed.content.strip() != turn.reply.text.strip():
            raise DemoError(f"task {task_id} turn {i + 1}: the completion does not parse back: {text!r}")
        tito.record(f"demo-{i}", plan, ids, parsed.as_msg(), req.tools, key, finish_stop=True)
        rest = [m for m in req.messages if m.role != "system"]
        short = renderer.encode(renderer.render(rest, [], add_generation_prompt=True))
        out.append(TokenTurn(prompt_ids, ids, text, short))
    return Demo(task_id, tuple(out))


def build_demos(renderer: Any, tasks: Sequence[Task], tasks_root: Path | None = None) -> list[Demo]:
    return [render_demo(renderer, t.task_id, scripted_turns(t, tasks_root)) for t in tasks]


def build_flawed_demos(renderer: Any, tasks: Sequence[Task], tasks_root: Path | None = None) -> list[Demo | None]:
    """Per task (same order as ``tasks``): the demonstration of its flawed solution
    (``flawed_files``), or ``None`` when the solution has no ``return`` line to get wrong."""
    out: list[Demo | None] = []
    for t in tasks:
        bad = flawed_files(solution_files(t, tasks_root))
        out.append(None if bad is None else render_demo(renderer, t.task_id, scripted_turns(t, tasks_root, files=bad)))
    return out


# -- 3. SFT -------------------------------------------------------------------------------

def _examples(demos: Sequence[Demo], *, short: bool = False) -> list[tuple[list[int], int]]:
    """(prompt + completion ids, prompt length) for every turn; ``short``: the turns'
    short-context variants (no system prompt, no tool list) instead."""
    if short:
        return [(list(t.short_prompt_ids) + t.completion_ids, len(t.short_prompt_ids)) for d in demos for t in d.turns]
    return [(t.prompt_ids + t.completion_ids, len(t.prompt_ids)) for d in demos for t in d.turns]


def _common_prefix(seqs: Sequence[list[int]]) -> int:
    first = seqs[0]
    n = min(len(s) for s in seqs)
    for s in seqs[1:]:
        i = 0
        while i < n and s[i] == first[i]:
            i += 1
        n = i
    return n


def completion_loss(model: Any, batch: Sequence[tuple[list[int], int]], pad_id: int = 0) -> tuple[Any, int]:
    """Mean cross-entropy over the completion tokens of a batch.

    The batch is packed into one sequence: the prefix its examples share (the system
    prompt and tool list) once, then each example's rest, attending to the shared prefix
    and to itself only (a block mask, each part with its own positions): the same logits
    as separate forwards at a fraction of the cost. The lm_head runs only at the positions
    that predict a completion token. ``pad_id`` is unused (nothing is padded)."""
    import torch
    import torch.nn.functional as F

    shared = min(_common_prefix([ids for ids, _ in batch]), min(n for _, n in batch) - 1)
    tokens = list(batch[0][0][:shared])
    positions = list(range(shared))
    owner = [-1] * shared  # -1: the shared prefix
    picks, targets = [], []
    for j, (ids, n_prompt) in enumerate(batch):
        offset = len(tokens) - shared  # packed index of original position p is offset + p
        tokens += ids[shared:]
        positions += range(shared, len(ids))
        owner += [j] * (len(ids) - shared)
        for p in range(n_prompt - 1, len(ids) - 1):
            picks.append(offset + p)
            targets.append(ids[p + 1])
    n = len(tokens)
    own = torch.tensor(owner)
    pos = torch.tensor(positions)
    # query i may see key k when k is in the shared prefix or in i's own part, and k is not after i
    allowed = ((own[None, :] == -1) | (own[None, :] == own[:, None])) & (torch.arange(n)[None, :] <= torch.arange(n)[:, None])
    hidden = model.model(input_ids=torch.tensor([tokens]), position_ids=pos[None], attention_mask=allowed[None, None],
                         use_cache=False).last_hidden_state[0]
    logits = model.lm_head(hidden[torch.tensor(picks)])
    return F.cross_entropy(logits, torch.tensor(targets)), len(targets)


Example = tuple[list[int], int]  # (prompt + completion ids, prompt length)

# The default curriculum: (prompt form, weight: its share of the steps is weight / sum). "short": the turn without system
# prompt and tool list; an int L: the exact prompt's last L tokens (the start cut off);
# "full": the exact prompt. Measured on the starter tasks (2 layers, hidden 128): after the
# short stage alone the model copies every value behind ~30 tokens but none behind the
# ~520-token prompt, and full-prompt steps from there leave it on a plateau that picks
# among the names (and among 3/5/7) at chance; lengthening the prompt in stages carries
# the copy over (the decision tokens' mean probability 0.46 -> 0.60 at the same cost).
DEFAULT_CURRICULUM: tuple[tuple[str | int, float], ...] = (
    ("short", 60), (96, 40), (192, 40), (320, 40), ("full", 80))


def _stage_examples(examples: Sequence[Any], short: Sequence[Any], form: str | int) -> list[Any]:
    """A stage's pool: the examples in the stage's prompt form (``None`` entries stay ``None``)."""
    if form == "full":
        return list(examples)
    if form == "short":
        return list(short)
    if isinstance(form, bool) or not isinstance(form, int) or form < 1:
        raise ValueError(f"curriculum stage {form!r}: 'short', 'full' or a prompt length >= 1")
    out: list[Any] = []
    for ex in examples:
        if ex is None:
            out.append(None)
            continue
        ids, n = ex
        cut = max(0, n - form)
        out.append((ids[cut:], n - cut))
    return out


def stage_steps(steps: int, curriculum: Sequence[tuple[str | int, float]]) -> list[int]:
    """Steps per stage: each stage's weight / the weights' sum of ``steps``, rounded; the
    last stage takes the rest."""
    if not curriculum:
        return []
    total = sum(share for _, share in curriculum)
    if total <= 0 or any(share < 0 for _, share in curriculum):
        raise ValueError("curriculum weights must be >= 0 with a positive sum")
    counts = [int(round(steps * share / total)) for _, share in curriculum[:-1]]
    while sum(counts) > steps:
        counts[counts.index(max(counts))] -= 1
    return [*counts, steps - sum(counts)]


def train_sft(model: Any, examples: list[Example], *, steps: int, lr: float, seed: int,
              batch_size: int, pad_id: int = 0, log: Callable[[str], None] = print, log_every: int = 20,
              warmup: int = 10, hook: Callable[[int, Any], None] | None = None,
              stages: Sequence[tuple[str, list[Example], int]] | None = None,
              flawed: Sequence[Sequence[Example | None]] | None = None, flaw_rate: float = 0.0,
              should_stop: Callable[[], bool] | None = None) -> list[float]:
    """AdamW on the completion loss; linear warm-up then cosine decay to 10 %. Returns the losses.

    ``stages``: a curriculum, ``(name, examples, steps)`` in order (their steps add up to
    ``steps``); without it every step draws from ``examples``. Each pool is drawn in a
    shuffled order, a fresh shuffle when it runs out. ``flawed``: per stage, the flawed
    variant of each example of its pool (same order; ``None`` where there is none); each
    draw takes the flawed variant with probability ``flaw_rate`` (its own seeded stream, so
    the order of draws does not depend on it)."""
    import torch

    plan = list(stages) if stages else [("full", examples, steps)]
    if sum(n for _, _, n in plan) != steps:
        raise ValueError(f"the curriculum's stages add up to {sum(n for _, _, n in plan)} steps, not {steps}")
    if not 0.0 <= flaw_rate < 1.0:
        raise ValueError(f"flaw_rate must be in [0, 1), not {flaw_rate}")
    variants = list(flawed) if flawed is not None else [[None] * len(pool) for _, pool, _ in plan]
    if len(variants) != len(plan) or any(len(v) != len(pool) for v, (_, pool, _) in zip(variants, plan)):
        raise ValueError("flawed: one list per stage, as long as the stage's pool")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    flaw_rng = random.Random(f"flaw-{seed}")
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    losses: list[float] = []
    started = time.monotonic()
    step = 0
    for (name, pool, n_steps), alts in zip(plan, variants):
        if n_steps and not pool:
            raise ValueError(f"curriculum stage {name!r} has no examples")
        order: list[int] = []
        size = min(batch_size, len(pool)) if pool else 0
        for _ in range(n_steps):
            if should_stop is not None and should_stop():
                raise WarmStartInterrupted(f"warm start stopped at step {step}/{steps}")
            if len(order) < size:
                fresh = list(range(len(pool)))
                rng.shuffle(fresh)
                order += fresh
            batch = [alts[i] if alts[i] is not None and flaw_rate > 0 and flaw_rng.random() < flaw_rate else pool[i]
                     for i in order[:size]]
            del order[:size]
            loss, _ = completion_loss(model, batch, pad_id)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            step += 1
            if step == 1 or step % log_every == 0 or step == steps:
                recent = losses[-log_every:]
                log(f"step {step}/{steps} [{name}] loss {sum(recent) / len(recent):.4f} "
                    f"({time.monotonic() - started:.0f} s)")
                if hook is not None:
                    hook(step, model)
                    model.train()
    model.eval()
    return losses


class WarmStartInterrupted(Exception):
    """``should_stop`` said stop (a Ctrl-C or SIGTERM during phase 0): nothing was saved."""


def save_model(model: Any, base_dir: Path, out_dir: Path, meta: dict[str, Any]) -> None:
    """An HF folder like the base one (weights replaced), written beside and renamed in."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".warmstart-", dir=out_dir.parent))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        for name in _CARRIED:
            if (base_dir / name).is_file():
                shutil.copy2(base_dir / name, tmp / name)
        (tmp / "gyre_model.json").write_text(json.dumps({"recipe": "warmstart", "base": str(base_dir), **meta},
                                                        sort_keys=True) + "\n")
        tmp.chmod(0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def warm_start(base_dir: Path, out_dir: Path, tasks: list[Task], *, steps: int, lr: float, seed: int,
               batch_size: int = 8, curriculum: Sequence[tuple[str | int, float]] = DEFAULT_CURRICULUM,
               tasks_root: Path | None = None, max_completion_tokens: int | None = None,
               flaw_rate: float = 0.0, log: Callable[[str], None] = print,
               should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """SFT of the model in ``base_dir`` on the scripted demonstrations of ``tasks`` (train
    split only), saved as an HF folder in ``out_dir``. Demonstrations whose completion is
    longer than ``max_completion_tokens`` (the run's sampling budget) are left out.

    Curriculum (``DEFAULT_CURRICULUM``): stages in order, each a share of the steps, on the
    same completions after prompts of growing length: the turn without system prompt and
    tool list ("short"), the exact prompt's last 96, 192 and 320 tokens, then the exact
    prompt ("full"). Behind ~520 tokens of system prompt and tools a 2-layer model's
    attention does not find the task's values from scratch in a few hundred steps; behind
    30 tokens it learns to copy them within ~60 steps, and each longer stage carries the
    copy a little further. ``curriculum=(("full", 1.0),)`` trains on the exact prompts only.

    ``flaw_rate``: the scripted solver is imperfect: each time a demonstration is drawn, it
    is the flawed one (``flawed_files``: ``print`` where the solution returns) with this
    probability, so the warm-started model prints instead of returning about that often,
    whatever the task (what RL then has to correct from the tests' rewards alone)."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.proxy.adapters.template import HFRenderer

    started = time.monotonic()
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    held = [t.task_id for t in tasks if t.split != "train"]
    if held:
        raise DemoError(f"the warm start never sees held-out tasks: {held}")
    renderer = HFRenderer(base_dir)
    demos = build_demos(renderer, tasks, tasks_root)
    bad_demos = build_flawed_demos(renderer, tasks, tasks_root) if flaw_rate > 0 else [None] * len(demos)
    if max_completion_tokens is not None:
        def too_long(d: Demo | None) -> bool:
            return d is not None and max(len(t.completion_ids) for t in d.turns) > max_completion_tokens
        long = [d.task_id for d, bad in zip(demos, bad_demos) if too_long(d) or too_long(bad)]
        if long:
            log(f"left out {len(long)} demonstrations over {max_completion_tokens} completion tokens: {long}")
        keep = [i for i, d in enumerate(demos) if d.task_id not in long]
        demos, bad_demos = [demos[i] for i in keep], [bad_demos[i] for i in keep]
    if not demos:
        raise DemoError("no demonstrations to train on")
    examples = _examples(demos)
    short_examples = _examples(demos, short=True)
    # the flawed variant of each example, in the same order (None for a demo without one)
    bad_examples: list[Example | None] = []
    bad_short: list[Example | None] = []
    for d, bad in zip(demos, bad_demos):
        bad_examples += _examples([bad]) if bad is not None else [None] * len(d.turns)
        bad_short += _examples([bad], short=True) if bad is not None else [None] * len(d.turns)
    counts = stage_steps(steps, curriculum)
    stages = [(str(form), _stage_examples(examples, short_examples, form), n)
              for (form, _), n in zip(curriculum, counts)]
    flawed = [_stage_examples(bad_examples, bad_short, form) for form, _ in curriculum]
    n_flawed = sum(bad is not None for bad in bad_demos)
    if flaw_rate > 0:
        log(f"flawed demonstrations: {n_flawed} of {len(demos)} tasks have one (print instead of return), "
            f"drawn with probability {flaw_rate:g}")
    n_tokens = sum(len(ids) - n for ids, n in examples)
    plan = ", ".join(f"{name} {n}" for name, _, n in stages if n)
    log(f"{len(demos)} demonstrations, {len(examples)} turns, {n_tokens} completion tokens; "
        f"{steps} steps of {min(batch_size, len(examples))} turns (prompt forms in order: {plan}), lr {lr:g}, seed {seed}")
    threads = torch.get_num_threads()
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32,
                                                 attn_implementation="sdpa")  # the packed boolean mask needs SDPA
    pad_id = renderer.tokenizer.pad_token_id if renderer.tokenizer.pad_token_id is not None else 0
    losses = train_sft(model, examples, steps=steps, lr=lr, seed=seed, batch_size=min(batch_size, len(examples)),
                       pad_id=pad_id, log=log, stages=stages, flawed=flawed, flaw_rate=flaw_rate,
                       should_stop=should_stop)
    with torch.no_grad():  # the exact prompts' loss, per completion token
        parts = [completion_loss(model, examples[i: i + 8], pad_id) for i in range(0, len(examples), 8)]
        final = float(sum(loss * n for loss, n in parts) / sum(n for _, n in parts))
    k = max(1, min(10, len(losses) // 3))
    stats = {"demos": len(demos), "turns": len(examples), "tokens": n_tokens, "steps": steps, "lr": lr,
             "batch_size": min(batch_size, len(examples)), "seed": seed,
             "curriculum": [[name, n] for name, _, n in stages], "flaw_rate": flaw_rate, "flawed_demos": n_flawed,
             "loss_first": round(sum(losses[:k]) / k, 4), "loss_last": round(sum(losses[-k:]) / k, 4),
             "loss_final": round(final, 4), "tasks": [d.task_id for d in demos], "threads": threads}
    save_model(model, base_dir, out_dir, {k2: v for k2, v in stats.items() if k2 != "tasks"})
    stats["seconds"] = round(time.monotonic() - started, 1)
    log(f"done in {stats['seconds']} s: loss {stats['loss_first']} -> {stats['loss_last']} "
        f"(all turns now {stats['loss_final']}); saved {out_dir}")
    return stats


# -- offline check ------------------------------------------------------------------------

_RUN_TESTS = r"""
import importlib.util, json, sys, traceback
ws, files = sys.argv[1], sys.argv[2:]
sys.path.insert(0, ws)
out = {}
for f in files:
    name = f.rsplit("/", 1)[-1][:-3]
    try:
        spec = importlib.util.spec_from_file_location(name, ws + "/" + f)
        mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
        tests = [t for t in dir(mod) if t.startswith("test_")]
    except BaseException:
        out[f] = None
        continue
    for t in tests:
        try:
            getattr(mod, t)(); out[f + "::" + t] = True
        except BaseException:
            out[f + "::" + t] = False
print(json.dumps(out))
"""


def grade(workspace: Path, task: Task, tasks_root: Path | None = None, timeout_s: float = 20.0) -> float:
    """Share of the task's weighted hidden tests that pass in ``workspace`` (a plain-Python
    stand-in for the evaluator's pytest run, for quick offline checks)."""
    import yaml

    root = (tasks_root or default_tasks_dir()) / task.task_id
    spec = yaml.safe_load((root / "evaluator.yaml").read_text(encoding="utf-8")) or {}
    weights: dict[str, float] = spec.get("weights") or {}
    hidden = root / "hidden"
    names = []
    for p in sorted(hidden.rglob("test_*.py")):
        rel = p.relative_to(hidden).as_posix()
        (workspace / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, workspace / rel)
        names.append(rel)
    try:
        proc = subprocess.run([sys.executable, "-c", _RUN_TESTS, str(workspace), *names], capture_output=True,
                              text=True, timeout=timeout_s, cwd=workspace,
                              env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        results = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
    except (subprocess.TimeoutExpired, ValueError):
        results = {}
    total = sum(weights.values()) or 1.0
    return sum(w for test, w in weights.items() if results.get(test)) / total


def greedy_eval(model_dir: Path, tasks: Sequence[Task], *, tasks_root: Path | None = None,
                max_new_tokens: int = 128, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Greedy turn 1 (and turn 2 after the real tool results) of each task from the model in
    ``model_dir``, on prompts built as the proxy builds them; the files the turn-1 tool
    calls write are graded by the hidden tests. Returns per-task scores and summaries:
    ``success`` (share of tasks with every test passing), ``mean_score``, ``format_ok``
    (turn 1 parsed into write_file calls), ``stops_ok`` (turn 2 answered without a tool call)."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.proxy.adapters.template import HFRenderer
    from services.proxy.core.messages import tools_key
    from services.proxy.core.tito import Tito
    from services.proxy.core.toolparse import parse_output

    renderer = HFRenderer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    stops = renderer.stop_texts
    tools = agent_tools()

    def generate(ids: list[int]) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=renderer.stop_token_ids, pad_token_id=renderer.stop_token_ids[0])
        return out[0, len(ids):].tolist()

    per_task: dict[str, dict[str, Any]] = {}
    for task in tasks:
        tito = Tito(renderer, stop_texts=stops)
        history = [Message("user", task.prompt)]
        req = _proxy_request(Request(MAIN_SYSTEM, history, tools, {}))
        key = tools_key(req.tools)
        plan = tito.plan(req.messages, req.tools, key)
        out_ids = generate(tito.input_ids(plan))
        text = renderer.decode(out_ids)
        parsed = parse_output(text, stops)
        tito.record("eval-1", plan, out_ids, parsed.as_msg(), req.tools, key,
                    finish_stop=bool(out_ids) and out_ids[-1] in renderer.stop_token_ids)
        writes = [c for c in parsed.tool_calls if c.name == "write_file" and isinstance(c.arguments, dict)]
        with tempfile.TemporaryDirectory(prefix="gyre-eval-") as tmp:
            if task.files_dir is not None:
                shutil.copytree(task.files_dir, tmp, dirs_exist_ok=True)
            ws = Workspace(Path(tmp))
            calls = tuple(ToolCall(f"call_{i}", c.name, c.arguments if isinstance(c.arguments, dict) else None)
                          for i, c in enumerate(parsed.tool_calls))
            results = []
            for c in calls:
                result, is_error = ws.call(c.name, c.arguments or {})
                results.append(Message("tool", result, tool_call_id=c.id, is_error=is_error))
            score = grade(Path(tmp), task, tasks_root)
        stop_ok = None
        if calls:
            history += [Message("assistant", parsed.content, calls), *results]
            req2 = _proxy_request(Request(MAIN_SYSTEM, history, tools, {}))
            plan2 = tito.plan(req2.messages, req2.tools, key)
            text2 = renderer.decode(generate(tito.input_ids(plan2)))
            stop_ok = not parse_output(text2, stops).tool_calls and "<tool_call>" not in text2
        content = writes[0].arguments.get("content") if writes else None
        per_task[task.task_id] = {"score": round(score, 3), "format_ok": bool(writes), "stop_ok": stop_ok,
                                  "content": content if content is not None else text[:200]}
        if log:
            log(f"{task.task_id}: score {score:.2f} format {bool(writes)} stop {stop_ok} {content!r}")
    n = max(1, len(per_task))
    scores = [v["score"] for v in per_task.values()]
    return {"tasks": len(per_task), "success": round(sum(s >= 1.0 for s in scores) / n, 3),
            "mean_score": round(sum(scores) / n, 3),
            "format_ok": round(sum(v["format_ok"] for v in per_task.values()) / n, 3),
            "stops_ok": round(sum(bool(v["stop_ok"]) for v in per_task.values()) / n, 3), "per_task": per_task}
