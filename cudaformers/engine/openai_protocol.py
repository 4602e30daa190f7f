"""OpenAI's completions and chat-completions requests: checked and turned into engine requests.

Pure Python, no web stack. Every problem becomes an ``APIError`` in OpenAI's error shape that
names the field and what would be accepted. Fields the engine cannot honour (``n > 1``,
presence/frequency penalties, ``logit_bias``, tools...) are refused, never ignored, and so are
fields nobody here knows (as OpenAI does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import CudaformersError
from .sampling_params import SamplingParams, SamplingParamsError

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_PROMPTS = 256  # prompts in one /v1/completions call (each is a request of its own)

# Fields accepted and deliberately without effect: bookkeeping for OpenAI's platform.
_INERT = {"user", "metadata", "store", "service_tier"}
_SAMPLING = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
             "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
             # extensions (vLLM's names)
             "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
             "return_token_ids"}
COMPLETION_FIELDS = _INERT | _SAMPLING | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = _INERT | _SAMPLING | {"messages", "max_completion_tokens", "top_logprobs", "response_format",
                                    "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs"}
ROLES = {"system", "developer", "user", "assistant", "tool"}
_TEMPLATE_CALL_ARGS = {"messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                       "return_tensors", "return_dict"}


class APIError(Exception):
    """A request the server refuses, as OpenAI reports it: HTTP status and ``{"error": {...}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param)


@dataclass(frozen=True)
class ModelInfo:
    """What requests are checked against."""

    name: str
    max_model_len: int
    vocab_size: int
    tokenizer: object | None = None


@dataclass
class GenerationRequest:
    chat: bool
    prompts: list[list[int]]  # token ids, one per choice
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    top_logprobs: int | None = None  # None: no logprobs
    return_token_ids: bool = False


# -- typed fields -----------------------------------------------------------------------------------
def _json_type(v) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(v), type(v).__name__)


def _field(body: dict, name: str, kinds: tuple, default, what: str):
    v = body.get(name)
    if v is None:
        return default
    if (isinstance(v, bool) and bool not in kinds) or not isinstance(v, kinds):
        raise invalid(name, f"'{name}' must be {what}, got {_json_type(v)}")
    return v


def _number(body, name, default, lo, hi, *, lo_open=False):
    v = _field(body, name, (int, float), default, "a number")
    if v is default:
        return v
    if not math.isfinite(v) or v < lo or (lo_open and v == lo) or v > hi:
        raise invalid(name, f"'{name}'={v} is out of range: use a number in {'(' if lo_open else '['}{lo}, {hi}]")
    return float(v)


def _integer(body, name, default, lo, hi=None):
    v = _field(body, name, (int,), default, "an integer")
    if v is not default and (v < lo or (hi is not None and v > hi)):
        raise invalid(name, f"'{name}'={v} is out of range: use an integer >= {lo}"
                      + (f" and <= {hi}" if hi is not None else ""))
    return v


def _boolean(body, name, default=False) -> bool:
    return _field(body, name, (bool,), default, "a boolean")


def _refuse_unless(body, name, neutral, hint: str) -> None:
    v = body.get(name)
    if v is not None and v != neutral:
        raise invalid(name, f"'{name}' is not supported by this server{hint}")


# -- prompts ----------------------------------------------------------------------------------------
def _encode(info: ModelInfo, text: str, param: str) -> list[int]:
    if info.tokenizer is None:
        raise invalid(param, "this server runs without a tokenizer (--skip-tokenizer-init): send the prompt "
                             "as token ids (a list of integers) to /v1/completions")
    return list(info.tokenizer.encode(text))


def _token_ids(ids: list, info: ModelInfo, param: str) -> list[int]:
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < info.vocab_size]
    if bad:
        raise invalid(param, f"'{param}' holds token ids outside [0, {info.vocab_size}) or non-integers: {bad[:5]}")
    return ids


def completion_prompts(body: dict, info: ModelInfo) -> list[list[int]]:
    """OpenAI's ``prompt``: a string, a list of strings, a list of token ids or a list of those."""
    p = body.get("prompt")
    what = "a string, an array of strings, an array of token ids or an array of token-id arrays"
    if p is None:
        raise invalid("prompt", f"'prompt' is required: {what}")
    if isinstance(p, str):
        return [_encode(info, p, "prompt")]
    if not isinstance(p, list) or not p:
        raise invalid("prompt", f"'prompt' must be {what} (non-empty), got {_json_type(p)}")
    if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        return [_token_ids(p, info, "prompt")]
    if len(p) > MAX_PROMPTS:
        raise invalid("prompt", f"'prompt' holds {len(p)} prompts; send at most {MAX_PROMPTS} per request")
    if all(isinstance(x, str) for x in p):
        return [_encode(info, x, "prompt") for x in p]
    if all(isinstance(x, list) and x for x in p):
        return [_token_ids(x, info, "prompt") for x in p]
    raise invalid("prompt", f"'prompt' must be {what}; do not mix kinds or send empty arrays")


def _message_text(m: dict, i: int) -> str:
    content, param = m.get("content"), f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(param, "only text content parts ({'type': 'text', 'text': ...}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(param, f"'{param}' must be a string or an array of text parts, got {_json_type(content)}")


def chat_prompt(body: dict, info: ModelInfo) -> list[int]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("messages", "'messages' is required: a non-empty array of {'role': ..., 'content': ...}")
    if info.tokenizer is None:
        raise invalid("messages", "chat needs a tokenizer and this server runs without one "
                                  "(--skip-tokenizer-init); use /v1/completions with token ids")
    conv = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise invalid(f"messages[{i}]", f"each message needs a 'role' in {sorted(ROLES)} and a 'content'")
        if m.get("tool_calls"):
            raise invalid(f"messages[{i}].tool_calls", "tool calls are not supported by this server")
        # Chat templates know "system"; "developer" is OpenAI's newer name for the same thing.
        role = "system" if m["role"] == "developer" else m["role"]
        conv.append({"role": role, "content": _message_text(m, i)})
    kwargs = _field(body, "chat_template_kwargs", (dict,), {}, "an object")
    clash = sorted(set(kwargs) & _TEMPLATE_CALL_ARGS)
    if clash:  # these would change what apply_chat_template returns, not what the template sees
        raise invalid("chat_template_kwargs", f"'chat_template_kwargs' may not set {clash}; it passes "
                                              "variables to the template (e.g. enable_thinking)")
    try:
        ids = info.tokenizer.apply_chat_template(conv, add_generation_prompt=True, **kwargs)
    except CudaformersError as e:  # e.g. no chat template
        raise invalid("messages", f"{e}; or send plain text to /v1/completions") from None
    except Exception as e:  # the template's own raise_exception, or a template that cannot render these
        raise invalid("messages", f"the model's chat template rejected these messages: {e}") from None
    return list(ids)


# -- whole requests ---------------------------------------------------------------------------------
def _check_common(body, info: ModelInfo, chat: bool) -> None:
    if not isinstance(body, dict):
        raise invalid(None, f"the request body must be a JSON object, got {_json_type(body)}")
    unknown = sorted(set(body) - (CHAT_FIELDS if chat else COMPLETION_FIELDS))
    if unknown:
        raise invalid(unknown[0], f"unrecognized request argument(s): {', '.join(unknown)}")
    model = body.get("model")
    if not isinstance(model, str):
        raise invalid("model", f"'model' is required: a string; this server serves {info.name!r}")
    if model != info.name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {info.name!r}",
                       param="model", code="model_not_found")
    if _integer(body, "n", 1, 1) != 1:
        raise invalid("n", "'n' > 1 is not supported by this server; send the request n times (with seeds)")
    for name in ("presence_penalty", "frequency_penalty"):
        _refuse_unless(body, name, 0, "; use 'repetition_penalty' (an extension: > 1 discourages repeats)")
    _refuse_unless(body, "logit_bias", {}, "")


def _stop(body, info: ModelInfo) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise invalid("stop", f"'stop' must be a non-empty string or an array of up to {MAX_STOP_STRINGS} of them")
    if info.tokenizer is None:
        raise invalid("stop", "stop strings need a tokenizer and this server runs without one; use stop_token_ids")
    return stop


def _max_tokens(body, prompts, info: ModelInfo, name: str, default: int | None) -> int | None:
    n = _integer(body, name, default, 1)
    longest = max(len(p) for p in prompts)
    param = "messages" if "messages" in body else "prompt"
    if longest >= info.max_model_len:
        raise invalid(param, f"the prompt has {longest} tokens and the context holds {info.max_model_len} "
                             "(one must be left to generate); shorten it")
    if n is not None and longest + n > info.max_model_len:
        raise invalid(name, f"'{name}'={n} is too large: the prompt has {longest} tokens and the context holds "
                            f"{info.max_model_len}, so at most {info.max_model_len - longest} can be generated")
    return n


def _request(body: dict, info: ModelInfo, chat: bool, prompts: list[list[int]]) -> GenerationRequest:
    if any(not p for p in prompts):
        raise invalid("messages" if chat else "prompt", "the prompt is empty (no tokens); give it some text")
    stream = _boolean(body, "stream")
    options = _field(body, "stream_options", (dict,), None, "an object")
    if options is not None and not stream:
        raise invalid("stream_options", "'stream_options' is only allowed with 'stream': true")
    include_usage = _boolean(options or {}, "include_usage")
    if chat:
        if body.get("tools"):
            raise invalid("tools", "tools (function calling) are not supported by this server")
        fmt = _field(body, "response_format", (dict,), {"type": "text"}, "an object")
        if fmt.get("type") != "text":
            raise invalid("response_format", "only {'type': 'text'} is supported (no JSON mode)")
        top = _integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
        if _boolean(body, "logprobs"):
            top = top or 0
        elif top is not None:
            raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
            raise invalid("max_tokens", "give 'max_completion_tokens' or 'max_tokens', not both")
        name = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
        max_tokens = _max_tokens(body, prompts, info, name, None)
    else:
        if _boolean(body, "echo"):
            raise invalid("echo", "'echo' is not supported by this server; prepend the prompt yourself")
        if _integer(body, "best_of", 1, 1) != 1:
            raise invalid("best_of", "'best_of' > 1 is not supported by this server")
        if _field(body, "suffix", (str,), "", "a string"):
            raise invalid("suffix", "'suffix' (insertion) is not supported by this server")
        top = _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
        max_tokens = _max_tokens(body, prompts, info, "max_tokens", 16)  # OpenAI's default for completions
    stop_ids = _field(body, "stop_token_ids", (list,), None, "an array of token ids")
    if stop_ids is not None:
        _token_ids(stop_ids, info, "stop_token_ids")
    seed = _integer(body, "seed", None, -(2 ** 63), 2 ** 64 - 1)
    try:
        params = SamplingParams(
            temperature=_number(body, "temperature", 1.0, 0, 2),
            top_p=_number(body, "top_p", 1.0, 0, 1, lo_open=True),
            top_k=_integer(body, "top_k", -1, -1),
            min_p=_number(body, "min_p", 0.0, 0, 1),
            repetition_penalty=_number(body, "repetition_penalty", 1.0, 0, 10, lo_open=True),
            max_tokens=max_tokens, stop=_stop(body, info), stop_token_ids=stop_ids,
            seed=None if seed is None else seed % 2 ** 64,
            ignore_eos=_boolean(body, "ignore_eos"), logprobs=top, min_tokens=_integer(body, "min_tokens", 0, 0))
    except SamplingParamsError as e:
        raise invalid(str(e).split("=")[0].removeprefix("SamplingParams."), str(e)) from None
    return GenerationRequest(chat, prompts, params, stream, include_usage, top,
                             _boolean(body, "return_token_ids"))


def parse_completion(body, info: ModelInfo) -> GenerationRequest:
    _check_common(body, info, chat=False)
    return _request(body, info, False, completion_prompts(body, info))


def parse_chat(body, info: ModelInfo) -> GenerationRequest:
    _check_common(body, info, chat=True)
    return _request(body, info, True, [chat_prompt(body, info)])
