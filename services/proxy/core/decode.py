"""Incremental detokenisation: text deltas for streamed token ids, O(new tokens) each.

Decoding a token at a time breaks multi-byte characters; decoding everything each time
costs O(output) per step. Keep a short window: decode ids[window:] and emit what grew,
holding back an incomplete character (U+FFFD at the end) until the next token.
"""

from __future__ import annotations

from collections.abc import Callable


class IncrementalDecoder:
    def __init__(self, decode: Callable[[list[int]], str], window: int = 6) -> None:
        self._decode = decode
        self._window = window
        self.ids: list[int] = []
        self._start = 0  # ids[_start:] are decoded together
        self._emitted = ""  # text emitted for ids[_start:]

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        text = self._decode(self.ids[self._start:])
        if text.endswith("\ufffd"):
            return ""  # wait for the rest of the character
        delta = text[len(self._emitted):] if text.startswith(self._emitted) else ""
        self._emitted = text
        if len(self.ids) - self._start > 2 * self._window:  # slide the window
            self._start = len(self.ids) - self._window
            self._emitted = self._decode(self.ids[self._start:])
        return delta
