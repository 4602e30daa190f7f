"""The OpenAI-compatible server, live on loopback: the official openai client for completions and
chat (streaming and not, greedy output equal to generate()), raw HTTP for errors, auth, 429,
disconnects (no leaked KV blocks), metrics, health, draining shutdown and the CLI."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from server_fixtures import ENGINE, LiveServer, checkpoint, model_and_tokenizer

NAME = LiveServer.NAME


@pytest.fixture(scope="module")
def server():
    with LiveServer() as s:
        yield s


def client(s, **kw):
    return openai.OpenAI(base_url=s.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, timeout=60, **kw)


def greedy(ids, n):
    model, _ = model_and_tokenizer()
    return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          eos_token_id=None)[0, len(ids):].tolist()


def chat_ids(messages):
    return model_and_tokenizer()[1].apply_chat_template(messages, add_generation_prompt=True)


def decode(ids):
    return model_and_tokenizer()[1].decode(ids, skip_special_tokens=True)


GREEDY = dict(temperature=0, extra_body=dict(ignore_eos=True, return_token_ids=True))


# -- the openai client ------------------------------------------------------------------------------
def test_completion_greedy_equals_generate(server):
    tok = model_and_tokenizer()[1]
    r = client(server).completions.create(model=NAME, prompt="The capital of France is", max_tokens=12, **GREEDY)
    want = greedy(tok.encode("The capital of France is"), 12)
    (choice,) = r.choices
    assert choice.token_ids == want
    assert choice.text == decode(want) and choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tok.encode("The capital of France is")), 12)
    assert r.model == NAME and r.object == "text_completion" and r.id.startswith("cmpl-")


def test_completion_stream_equals_non_stream(server):
    c = client(server)
    kw = dict(model=NAME, prompt="Once upon a time", max_tokens=10, **GREEDY)
    whole = c.completions.create(**kw).choices[0]
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.text
    assert sum((ch.choices[0].token_ids for ch in chunks if ch.choices), []) == whole.token_ids
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(ch.usage is None for ch in chunks[:-1])


def test_token_id_prompts_give_one_choice_each_in_order(server):
    prompts = [[5, 9, 13, 21, 8], list(range(300, 340)), [777]]
    r = client(server).completions.create(model=NAME, prompt=prompts, max_tokens=7, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.token_ids for c in r.choices] == [greedy(p, 7) for p in prompts]
    assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 21


def test_chat_greedy_stream_and_not(server):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    c = client(server)
    want = greedy(chat_ids(msgs), 9)
    r = c.chat.completions.create(model=NAME, messages=msgs, max_completion_tokens=9, **GREEDY)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == decode(want)
    assert r.choices[0].token_ids == want and r.usage.prompt_tokens == len(chat_ids(msgs))
    chunks = list(c.chat.completions.create(model=NAME, messages=msgs, max_tokens=9, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == decode(want)
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].object == "chat.completion.chunk"


def test_chat_eos_finishes_with_stop(server):
    # EOS (<|im_end|>, id 2) forced as the only stop: the first sampled token that is 2 ends it.
    ids = [5, 9, 13]
    want = greedy(ids, 6)
    r = client(server).completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0,
                                          extra_body=dict(stop_token_ids=[want[2]], return_token_ids=True))
    assert r.choices[0].token_ids == want[:3] and r.choices[0].finish_reason == "stop"


def test_logprobs_are_the_model_log_softmax(server):
    model, tok = model_and_tokenizer()
    ids = tok.encode("Hello")
    r = client(server).completions.create(model=NAME, prompt=ids, max_tokens=3, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    out = r.choices[0].token_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1].float()
    ref = torch.log_softmax(logits, -1)
    for i, t in enumerate(out):
        assert lp.token_logprobs[i] == pytest.approx(ref[i, t].item(), abs=1e-4)
        top = list(lp.top_logprobs[i].values())
        assert len(top) == 2 and top[0] == pytest.approx(ref[i].max().item(), abs=1e-4)
    assert lp.tokens == [tok.decode([t]) for t in out]
    chat = client(server).chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=2, logprobs=True, top_logprobs=3, temperature=0)
    entry = chat.choices[0].logprobs.content[0]
    assert len(entry.top_logprobs) == 3 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_stop_string_cuts_text_streamed_or_not(server):
    c = client(server)
    prompt = [11, 22, 33, 44]
    text = decode(greedy(prompt, 12))
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = text[:text.find(stop)]
    kw = dict(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stop=[stop, "\u2603never"])
    r = c.completions.create(**kw)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = list(c.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats_and_models_endpoint(server):
    c = client(server)
    kw = dict(model=NAME, prompt=[3, 4, 5], max_tokens=8, temperature=1.0, top_k=50, seed=1234)
    kw["extra_body"] = dict(top_k=kw.pop("top_k"), min_p=0.0, ignore_eos=True)
    assert c.completions.create(**kw).choices[0].text == c.completions.create(**kw).choices[0].text
    (m,) = c.models.list().data
    assert m.id == NAME and m.owned_by == "cudaformers"


# -- errors over raw HTTP ---------------------------------------------------------------------------
BAD = [
    ("malformed json", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("body not an object", "/v1/completions", [1, 2], 400, None),
    ("unknown model", "/v1/completions", dict(model="gpt-9", prompt="hi"), 404, "model"),
    ("missing model", "/v1/completions", dict(prompt="hi"), 400, "model"),
    ("missing prompt", "/v1/completions", dict(model=NAME), 400, "prompt"),
    ("missing messages", "/v1/chat/completions", dict(model=NAME), 400, "messages"),
    ("bad role", "/v1/chat/completions", dict(model=NAME, messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages[0]"),
    ("image part", "/v1/chat/completions",
     dict(model=NAME, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     400, "messages[0].content"),
    ("max_tokens string", "/v1/completions", dict(model=NAME, prompt="hi", max_tokens="5"), 400, "max_tokens"),
    ("max_tokens bool", "/v1/completions", dict(model=NAME, prompt="hi", max_tokens=True), 400, "max_tokens"),
    ("max_tokens zero", "/v1/completions", dict(model=NAME, prompt="hi", max_tokens=0), 400, "max_tokens"),
    ("max_tokens beyond context", "/v1/completions", dict(model=NAME, prompt="hi", max_tokens=10**9), 400,
     "max_tokens"),
    ("prompt beyond context", "/v1/completions", dict(model=NAME, prompt=[7] * 300), 400, "prompt"),
    ("token id beyond vocab", "/v1/completions", dict(model=NAME, prompt=[1, 49152]), 400, "prompt"),
    ("mixed prompt list", "/v1/completions", dict(model=NAME, prompt=["a", [1, 2]]), 400, "prompt"),
    ("temperature too high", "/v1/completions", dict(model=NAME, prompt="hi", temperature=3), 400, "temperature"),
    ("top_p zero", "/v1/completions", dict(model=NAME, prompt="hi", top_p=0), 400, "top_p"),
    ("n > 1", "/v1/completions", dict(model=NAME, prompt="hi", n=2), 400, "n"),
    ("presence penalty", "/v1/chat/completions",
     dict(model=NAME, messages=[{"role": "user", "content": "x"}], presence_penalty=0.5), 400, "presence_penalty"),
    ("logit bias", "/v1/completions", dict(model=NAME, prompt="hi", logit_bias={"5": 10}), 400, "logit_bias"),
    ("unknown field", "/v1/completions", dict(model=NAME, prompt="hi", temprature=0), 400, "temprature"),
    ("stream_options without stream", "/v1/completions",
     dict(model=NAME, prompt="hi", stream_options={"include_usage": True}), 400, "stream_options"),
    ("logprobs too many", "/v1/completions", dict(model=NAME, prompt="hi", logprobs=50), 400, "logprobs"),
    ("empty stop string", "/v1/completions", dict(model=NAME, prompt="hi", stop=[""]), 400, "stop"),
    ("tools", "/v1/chat/completions",
     dict(model=NAME, messages=[{"role": "user", "content": "x"}], tools=[{"type": "function"}]), 400, "tools"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_requests_get_openai_errors(server, case):
    _, path, body, status, param = case
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param


def test_unknown_routes_and_methods_are_json_errors(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_api_key_required_on_v1_routes():
    with LiveServer(api_key="s3cret") as s:
        assert httpx.get(s.url + "/v1/models").status_code == 401
        wrong = httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(s, api_key="nope").completions.create(model=NAME, prompt=[1, 2], max_tokens=1)
        r = client(s, api_key="s3cret").completions.create(model=NAME, prompt=[1, 2], max_tokens=2, **GREEDY)
        assert r.choices[0].token_ids == greedy([1, 2], 2)
        assert httpx.get(s.url + "/health").status_code == 200


def _stream_lines(s, body):
    """An open streaming request (its response is being read in chunks)."""
    c = httpx.Client(timeout=30)
    resp = c.send(c.build_request("POST", s.url + "/v1/completions", json={**body, "stream": True}), stream=True)
    return c, resp, resp.iter_lines()


def _first_data(lines) -> dict:
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line[6:])
    raise AssertionError("the stream ended without data")


LONG = dict(model=NAME, prompt=[5, 6, 7, 8], max_tokens=200, temperature=0, ignore_eos=True)


def test_full_queue_gets_429_and_capacity_returns():
    with LiveServer(max_num_seqs=1, max_queue=0) as s:
        c, resp, lines = _stream_lines(s, LONG)
        _first_data(lines)
        r = httpx.post(s.url + "/v1/completions", json=dict(model=NAME, prompt=[1], max_tokens=1))
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):
            client(s).completions.create(model=NAME, prompt=[1], max_tokens=1)
        resp.close()
        c.close()
        s.wait_idle()
        deadline = time.monotonic() + 10
        while s.state.engine.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client(s).completions.create(model=NAME, prompt=[1], max_tokens=1).choices[0].finish_reason


def test_disconnect_cancels_and_frees_blocks(server):
    before = server.state.metrics.finished.get("abort", 0)
    blocks = server.state.engine.counts()["blocks_total"]
    c, resp, lines = _stream_lines(server, LONG)
    _first_data(lines)
    assert server.state.engine.counts()["blocks_used"] > 0
    resp.close()
    c.close()
    counts = server.wait_idle()
    assert counts["blocks_used"] == 0 and counts["blocks_total"] == blocks
    assert server.state.metrics.finished.get("abort", 0) == before + 1
    assert server.state.engine.engine.block_manager.num_free_blocks == blocks
    # A non-streaming client that gives up is cancelled too.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 250}, timeout=0.3)
    server.wait_idle()
    assert server.state.metrics.finished.get("abort", 0) == before + 2
    assert server.state.engine.num_in_flight == 0


def test_metrics_and_health(server):
    client(server).completions.create(model=NAME, prompt=[9, 8, 7], max_tokens=4, **GREEDY)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    for name in ("requests_waiting", "requests_running", "kv_blocks_used", "kv_blocks_total",
                 "generation_tokens_total", "generation_tokens_per_second"):
        assert f"cudaformers_{name}" in values, name
    assert values["cudaformers_kv_blocks_total"] == ENGINE["num_blocks"]
    assert values["cudaformers_generation_tokens_total"] >= 4
    assert values["cudaformers_time_to_first_token_seconds_count"] >= 1
    assert values['cudaformers_time_per_output_token_seconds_bucket{le="+Inf"}'] >= 1
    assert values['cudaformers_requests_finished_total{finish_reason="length"}'] >= 1


def test_shutdown_drains_running_requests_and_refuses_new_ones():
    s = LiveServer().__enter__()
    try:
        c, resp, lines = _stream_lines(s, {**LONG, "max_tokens": 60, "return_token_ids": True})
        first = _first_data(lines)
        s.server.handle_exit(signal.SIGTERM, None)  # what the signal handler does
        r = httpx.post(s.url + "/v1/completions", json=dict(model=NAME, prompt=[1], max_tokens=1))
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert httpx.get(s.url + "/health").status_code == 503
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        ids = first["choices"][0]["token_ids"] + sum((e["choices"][0]["token_ids"] for e in rest), [])
        assert ids == greedy(LONG["prompt"], 60) and rest[-1]["choices"][0]["finish_reason"] == "length"
        c.close()
        s._thread.join(20)
        assert not s._thread.is_alive(), "the server did not exit after draining"
    finally:
        s.server.should_exit = True
        s._thread.join(10)


def test_missing_web_stack_names_the_extra(monkeypatch):
    from cudaformers.engine import server as server_module
    from cudaformers.errors import CudaformersError

    monkeypatch.setitem(sys.modules, "uvicorn", None)
    with pytest.raises(CudaformersError, match=r"pip install 'cudaformers\[serve\]'"):
        server_module.require_web_stack()


# -- the CLI, token ids only, and SIGTERM -----------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_cli_serve_without_tokenizer_then_sigterm_drains(tmp_path):
    port = _free_port()
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "cudaformers.cli", "serve", str(checkpoint()), "--port", str(port),
           "--served-model-name", "m", "--skip-tokenizer-init", "--device-map", "cpu",
           "--num-blocks", "64", "--block-size", "8", "--max-num-seqs", "4", "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        text = httpx.post(url + "/v1/completions", json=dict(model="m", prompt="hi"))
        assert text.status_code == 400 and "token ids" in text.json()["error"]["message"]
        chat = httpx.post(url + "/v1/chat/completions", json=dict(model="m", messages=[{"role": "user",
                                                                                        "content": "hi"}]))
        assert chat.status_code == 400 and "tokenizer" in chat.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", json=dict(model="m", prompt=[4, 5, 6], max_tokens=5, temperature=0,
                                                          ignore_eos=True)).json()
        assert r["choices"][0]["token_ids"] == greedy([4, 5, 6], 5) and r["choices"][0]["text"] == ""

        got = []

        def stream():
            with httpx.stream("POST", url + "/v1/completions", json=dict(model="m", prompt=[4, 5, 6], stream=True,
                              max_tokens=80, temperature=0, ignore_eos=True), timeout=60) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        got.append(json.loads(line[6:]))
        t = threading.Thread(target=stream)
        t.start()
        while not got:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert sum((e["choices"][0]["token_ids"] for e in got), []) == greedy([4, 5, 6], 80)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_staggered_streams_join_the_batch_with_async_batching():
    """Requests arriving while others run join the batch; with async batching (a token still on the
    device at each step) every stream still gets exactly generate()'s tokens, and nothing leaks."""
    import asyncio

    prompts = [[5, 9, 13, 21, 8], list(range(300, 340)), [777], list(range(1000, 1013)), [42, 43]]

    async def one(url, p, delay):
        await asyncio.sleep(delay)
        ids, reasons = [], []
        async with httpx.AsyncClient(timeout=60) as c:
            body = dict(model=NAME, prompt=p, max_tokens=24, temperature=0, ignore_eos=True, stream=True,
                        return_token_ids=True)
            async with c.stream("POST", url + "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        ids += choice["token_ids"]
                        reasons.append(choice["finish_reason"])
        return ids, reasons[-1]

    async def all_of(url):
        return await asyncio.gather(*(one(url, p, 0.02 * i) for i, p in enumerate(prompts)))

    with LiveServer(use_async_batching=True, max_batch_tokens=16) as s:
        assert s.state.engine.engine.use_async_batching
        got = asyncio.run(all_of(s.url))
        assert [g[0] for g in got] == [greedy(p, 24) for p in prompts]
        assert {g[1] for g in got} == {"length"}
        s.wait_idle()


def test_chat_template_kwargs_cannot_change_the_call(server):
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + "/v1/chat/completions",
                   json=dict(model=NAME, messages=msgs, chat_template_kwargs={"tokenize": False}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    r = httpx.post(server.url + "/v1/chat/completions", json=dict(model=NAME, messages=msgs, max_tokens=2,
                                                                  chat_template_kwargs={"enable_thinking": False}))
    assert r.status_code == 200, r.text


def test_oversized_body_gets_413(server):
    from cudaformers.engine import server_app

    r = httpx.post(server.url + "/v1/completions", content=b"{" + b" " * (server_app.MAX_BODY_BYTES + 1) + b"}",
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
