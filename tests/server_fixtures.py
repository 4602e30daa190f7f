"""A live server for tests: a tiny random Qwen3 with SmolLM2's tokenizer, served on loopback from a
thread (uvicorn on its own event loop), stopped and joined on exit."""

from __future__ import annotations

import functools
import socket
import threading
import time
from pathlib import Path

import tiny

ENGINE = dict(num_blocks=160, block_size=8, max_batch_tokens=64, max_num_seqs=8)


@functools.lru_cache(maxsize=None)
def checkpoint() -> Path:
    """Tiny Qwen3 weights with SmolLM2's vocabulary size, its tokenizer saved alongside."""
    import transformers

    from cudaformers.embedded import default_model
    from cudaformers.tokenizer import AutoTokenizer

    import torch

    torch.manual_seed(0)
    config = tiny.hf_config("qwen3")
    config.vocab_size = 49152  # SmolLM2's; EOS 2 is its <|im_end|>
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = Path(__import__("tempfile").mkdtemp(prefix="cf-serve-"))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(*default_model()[:1], gguf_file=default_model()[1]).save_pretrained(folder)
    return folder


@functools.lru_cache(maxsize=None)
def model_and_tokenizer():
    from cudaformers import AutoModelForCausalLM
    from cudaformers.tokenizer import AutoTokenizer

    folder = checkpoint()
    return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


class LiveServer:
    """``with LiveServer(api_key=...) as s: s.url`` — a server on a free loopback port."""

    NAME = "tiny"

    def __init__(self, *, model=None, tokenizer=None, api_key=None, max_queue=16, **engine):
        """Without ``model``: the tiny model and tokenizer above, on the CPU."""
        from cudaformers.engine.server import make_server, make_state

        if model is None:
            model, tokenizer = model_and_tokenizer()
        self.state = make_state(model, tokenizer, served_model_name=self.NAME, api_key=api_key,
                                max_queue=max_queue, **{**ENGINE, **engine})
        self.server = make_server(self.state, log_level="warning")
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[self._sock]), daemon=True)

    def __enter__(self) -> "LiveServer":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self._sock.close()
        assert not self._thread.is_alive(), "the test server did not stop"

    def wait_idle(self, timeout: float = 20) -> dict:
        """Engine counts once nothing is running or waiting and every block is free."""
        deadline = time.monotonic() + timeout
        while True:
            counts = self.state.engine.counts()
            if counts["running"] == counts["waiting"] == counts["blocks_used"] == 0:
                return counts
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine did not become idle: {counts}")
            time.sleep(0.02)
