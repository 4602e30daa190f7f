"""Incremental detokenization for streaming: generated ids in, printable text out."""

from __future__ import annotations


def as_list(value) -> list:
    return value.tolist() if hasattr(value, "tolist") else list(value)


class DetokenizeStream:
    """Incremental detokenization: feed generated ids, get the text they add once it is printable.

    A token can end inside a multi-byte UTF-8 character (byte-level and byte-fallback vocabularies
    split emoji and CJK across tokens) and sentencepiece decoders drop a leading space at the start of
    a decode. So each step decodes a short window of recent ids and emits only the text past what that
    window already showed, holding it back while it ends in an incomplete character.
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True, prompt_ids=None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A few prompt tokens give the first generated token its left context (leading spaces).
        self._ids: list[int] = [int(i) for i in as_list(prompt_ids)[-4:]] if prompt_ids is not None else []
        self._prefix = 0                 # window start
        self._read = len(self._ids)      # ids before this were emitted
        self.text = ""

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def put(self, token_ids) -> str:
        """Add one id or a list of ids; return the newly printable text ('' when none yet)."""
        self._ids.extend([int(token_ids)] if isinstance(token_ids, int) else [int(i) for i in as_list(token_ids)])
        shown = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        if len(full) <= len(shown) or full.endswith("\ufffd"):
            return ""
        new = full[len(shown):]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += new
        return new

    def end(self) -> str:
        """The text still held back (an incomplete character at the end of generation)."""
        full = self._decode(self._ids[self._prefix:])
        shown = self._decode(self._ids[self._prefix:self._read])
        new = full[len(shown):] if len(full) > len(shown) else ""
        self._prefix = self._read = len(self._ids)
        self.text += new
        return new
