"""Streamers for generate(): print tokens as they come, or hand them to another thread."""

from __future__ import annotations

import queue
import sys

from ..detokenize import DetokenizeStream


class BaseStreamer:
    def put(self, value):
        raise NotImplementedError

    def end(self):
        raise NotImplementedError


class TextStreamer(BaseStreamer):
    """Writes the generated text to stdout (or ``file``) as soon as it is printable."""

    def __init__(self, tokenizer, skip_prompt: bool = False, skip_special_tokens: bool = True, file=None):
        self.tokenizer, self.skip_prompt, self.file = tokenizer, skip_prompt, file
        self.skip_special_tokens = skip_special_tokens
        self._stream = None

    def put(self, value):
        ids = value.reshape(-1).tolist()
        if self._stream is None:  # the first call carries the prompt
            self._stream = DetokenizeStream(self.tokenizer, skip_special_tokens=self.skip_special_tokens,
                                            prompt_ids=ids)
            if not self.skip_prompt:
                self.on_text(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))
            return
        text = self._stream.put(ids)
        if text:
            self.on_text(text)

    def end(self):
        if self._stream is not None:
            self.on_text(self._stream.end(), stream_end=True)
        self._stream = None

    def on_text(self, text: str, stream_end: bool = False):
        out = self.file or sys.stdout
        out.write(text + ("\n" if stream_end else ""))
        out.flush()


class TextIteratorStreamer(TextStreamer):
    """Iterate over text pieces in another thread while generate() runs: ``for text in streamer``."""

    def __init__(self, tokenizer, skip_prompt: bool = False, timeout: float | None = None, **decode_kwargs):
        super().__init__(tokenizer, skip_prompt, **decode_kwargs)
        self.queue: queue.Queue = queue.Queue()
        self.timeout = timeout
        self._done = object()

    def on_text(self, text: str, stream_end: bool = False):
        if text:
            self.queue.put(text)
        if stream_end:
            self.queue.put(self._done)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        item = self.queue.get(timeout=self.timeout)
        if item is self._done:
            raise StopIteration
        return item
