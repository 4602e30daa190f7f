"""What the server sends back: each choice's text built as its tokens arrive, and OpenAI's
response objects and stream chunks for completions and chat completions.

Text is detokenized incrementally (``DetokenizeStream``, which holds back a split UTF-8
character). With stop strings, the last ``len(longest stop) - 1`` characters are held back while
the request runs, so a stream never shows the start of a stop string the engine later cuts off.
A server without a tokenizer returns no text; the tokens come back in ``token_ids``.
"""

from __future__ import annotations

import time
import uuid

from ..detokenize import DetokenizeStream
from .openai_protocol import GenerationRequest
from .server_engine import Update


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Choice:
    """One prompt's output, accumulated update by update."""

    def __init__(self, index: int, prompt_ids: list[int], tokenizer, request: GenerationRequest):
        self.index = index
        self.num_prompt_tokens = len(prompt_ids)
        self.tokenizer = tokenizer
        self.stop = request.params.stop or []
        self.holdback = max(map(len, self.stop)) - 1 if self.stop else 0
        self.detok = DetokenizeStream(tokenizer, prompt_ids=prompt_ids) if tokenizer is not None else None
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.text = ""  # handed out so far
        self.finish_reason: str | None = None

    def add(self, u: Update) -> str:
        """Take an update; returns the text it makes ready (possibly '')."""
        self.token_ids += u.token_ids
        self.logprobs += u.logprobs or []
        self.finish_reason = u.finish_reason
        if self.detok is None:
            return ""
        if u.token_ids:
            self.detok.put(u.token_ids)
        if u.finish_reason is None:
            full = self.detok.text
            ready = full[:max(len(self.text), len(full) - self.holdback)]
        else:
            self.detok.end()
            ready = self.detok.text
            if u.finish_reason == "stop":
                cuts = [i for i in (ready.find(s) for s in self.stop) if i >= 0]
                ready = ready[:min(cuts)] if cuts else ready
        delta = ready[len(self.text):]
        self.text = max(self.text, ready, key=len)
        return delta

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


# -- logprobs ---------------------------------------------------------------------------------------
def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(choice: Choice, ids: list[int], entries: list[dict], k: int, offset: int) -> dict:
    tokens = [choice.token_text(t) for t in ids]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [e.get(t) for t, e in zip(ids, entries)],
            "top_logprobs": [{choice.token_text(i): lp for i, lp in _top(e, k)} for e in entries],
            "text_offset": offsets}


def chat_logprobs(choice: Choice, ids: list[int], entries: list[dict], k: int) -> dict:
    def item(tok, lp):
        s = choice.token_text(tok)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [{**item(t, e.get(t)), "top_logprobs": [item(i, lp) for i, lp in _top(e, k)]}
                        for t, e in zip(ids, entries)]}


# -- bodies -----------------------------------------------------------------------------------------
def usage(choices: list[Choice]) -> dict:
    p = sum(c.num_prompt_tokens for c in choices)
    n = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


class ResponseBuilder:
    """OpenAI's objects for one request: the whole response, or its stream chunks."""

    def __init__(self, request: GenerationRequest, model: str, choices: list[Choice], with_ids: bool):
        self.req, self.model, self.choices = request, model, choices
        self.with_ids = with_ids or request.return_token_ids
        self.id = new_id("chatcmpl" if request.chat else "cmpl")
        self.created = int(time.time())
        self.offsets = [0] * len(choices)  # completions' text_offset, per choice

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, c: Choice, ids, entries):
        k = self.req.top_logprobs
        if k is None:
            return None
        if self.req.chat:
            return chat_logprobs(c, ids, entries, k)
        out = completion_logprobs(c, ids, entries, k, self.offsets[c.index])
        self.offsets[c.index] += sum(len(s) for s in out["tokens"])
        return out

    def response(self) -> dict:
        body = self._head("chat.completion" if self.req.chat else "text_completion")
        body["choices"] = []
        for c in self.choices:
            lp = self._logprobs(c, c.token_ids, c.logprobs)
            if self.req.chat:
                item = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": lp, "finish_reason": c.finish_reason}
            else:
                item = {"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}
            if self.with_ids:
                item["token_ids"] = c.token_ids
            body["choices"].append(item)
        body["usage"] = usage(self.choices)
        return body

    def role_chunk(self, c: Choice) -> dict:
        return self._chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})

    def chunks(self, c: Choice, u: Update, text: str) -> list[dict]:
        """Stream chunks for one update of choice ``c`` (none when it adds nothing to show)."""
        informative = text or (u.token_ids and (self.with_ids or self.req.top_logprobs is not None))
        out = []
        if informative:
            lp = self._logprobs(c, u.token_ids, u.logprobs or [])
            if self.req.chat:
                item = {"index": c.index, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}
            else:
                item = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": None}
            if self.with_ids:
                item["token_ids"] = u.token_ids
            out.append(item)
        if u.finish_reason is not None:
            if out and not self.req.chat:
                out[-1]["finish_reason"] = u.finish_reason
            elif self.req.chat:
                out.append({"index": c.index, "delta": {}, "logprobs": None, "finish_reason": u.finish_reason})
            else:
                out.append({"index": c.index, "text": "", "logprobs": None, "finish_reason": u.finish_reason})
        return [self._chunk(item) for item in out]

    def _chunk(self, item: dict) -> dict:
        body = self._head("chat.completion.chunk" if self.req.chat else "text_completion")
        body["choices"] = [item]
        if self.req.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self) -> dict:
        body = self._head("chat.completion.chunk" if self.req.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(self.choices)
        return body
