"""The model's chat template and tokenizer (a Hugging Face model folder), as a Renderer.

It counts the tokens it encodes (``encoded_tokens``): the proxy's own tokenisation work,
which the TITO design keeps proportional to each turn's new messages.

Thread-safe: the proxy renders and tokenises in worker threads (``ProxyService.off_loop``),
several sessions at once. Jinja templates render concurrently; a fast tokenizer's encode
and decode only read the Rust tokenizer, as long as nothing changes its truncation or
padding settings or its special-token splitting (transformers changes them only when a
call asks for other settings than the tokenizer has, and this class never asks for any):
a tokenizer that comes with other settings gets those encode uses here, once, before any
thread uses it.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from ..core.messages import Msg, ToolSpec
from ..core.tito import TemplateError


class HFRenderer:
    def __init__(self, folder: str | Path, *, chat_template: str | None = None) -> None:
        from transformers import AutoTokenizer

        self.folder = Path(folder)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(folder))
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer in {folder} has no chat template")
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:  # encode never asks for truncation or padding: keep none set
            if backend.truncation is not None:
                backend.no_truncation()
            if backend.padding is not None:
                backend.no_padding()
            split = bool(getattr(self.tokenizer, "split_special_tokens", False))  # what encode sets it to
            if getattr(backend, "encode_special_tokens", split) != split:
                backend.encode_special_tokens = split
        self.encoded_tokens = 0
        self._count_lock = threading.Lock()
        eos = self.tokenizer.eos_token
        self.stop_texts: tuple[str, ...] = tuple(t for t in (eos, "<|endoftext|>") if t)
        self.stop_token_ids: list[int] = sorted({self.tokenizer.convert_tokens_to_ids(t) for t in self.stop_texts
                                                 if t in self.tokenizer.get_vocab()})
        self.max_context = int(getattr(self.tokenizer, "model_max_length", 32768) or 32768)
        # byte-level BPE (GPT-2, Qwen, Llama 3): a token's string spells its bytes one character each
        self._byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        self._added = set(getattr(self.tokenizer, "added_tokens_decoder", {}) or {})

    def render(self, msgs: list[Msg], tools: list[ToolSpec], *, add_generation_prompt: bool) -> str:
        """The chat template's text; a template that rejects the conversation (jinja's
        ``raise_exception``, a bad field) raises ``TemplateError``, which callers answer with a 400."""
        try:
            return self.tokenizer.apply_chat_template(
                [m.template_dict() for m in msgs], tools=[t.template_dict() for t in tools] or None,
                tokenize=False, add_generation_prompt=add_generation_prompt,
            )
        except TemplateError:
            raise
        except Exception as exc:  # jinja raises many types for templates that reject input
            raise TemplateError(f"chat template failed: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        with self._count_lock:
            self.encoded_tokens += len(ids)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """Each token's own bytes (a token may hold part of a UTF-8 character, which decoding
        it alone would turn into U+FFFD): OpenAI's logprobs ``bytes``."""
        tokens = self.tokenizer.convert_ids_to_tokens(list(ids))
        out = []
        for i, tok in zip(ids, tokens):
            if self._byte_level and i not in self._added and isinstance(tok, str) and all(c in _BYTE_OF for c in tok):
                out.append(bytes(_BYTE_OF[c] for c in tok))
            else:
                out.append(self.decode([i]).encode("utf-8"))
        return out


def _byte_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character that stands for each byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_BYTE_OF = _byte_table()
