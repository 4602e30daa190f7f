"""`cudaformers serve [MODEL]`: an OpenAI-compatible HTTP server on the continuous-batching engine.

    cudaformers serve Qwen/Qwen3-0.6B --port 8000 --api-key "$KEY"

Endpoints: POST /v1/completions, POST /v1/chat/completions (both streaming over server-sent
events or not), GET /v1/models, GET /health, GET /metrics (Prometheus). Binds to 127.0.0.1 unless
told otherwise. SIGINT/SIGTERM drain: new requests get 503, running ones finish, then the server
exits; a second signal stops at once. The web stack (starlette, uvicorn) is imported only here,
when serving starts.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import sys

from ..errors import CudaformersError
from .openai_protocol import ModelInfo

logger = logging.getLogger("cudaformers")

INSTALL_HINT = "pip install 'cudaformers[serve]'"
DEFAULT_MAX_QUEUE = 1024
SWITCH_INTERVAL_S = 0.0005


def require_web_stack() -> None:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise CudaformersError(f"serving needs starlette and uvicorn ({e}); install them: {INSTALL_HINT}") from None


def make_state(model, tokenizer=None, *, served_model_name: str, api_key: str | None = None,
               max_queue: int = DEFAULT_MAX_QUEUE, **engine_kwargs):
    """The server's shared state around a new engine for ``model`` (engine options: see ``LLM``)."""
    require_web_stack()
    from .llm_engine import LLMEngine
    from .server_app import ServerState

    if max_queue < 0:
        raise CudaformersError(f"max_queue={max_queue} is invalid; use 0 or more")
    engine = LLMEngine(model, tokenizer, **engine_kwargs)
    info = ModelInfo(served_model_name, engine.scheduler.max_model_len, engine.runner.vocab_size, tokenizer)
    return ServerState(engine, info, api_key=api_key, max_in_flight=engine.scheduler.max_num_seqs + max_queue)


def make_server(state, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"):
    """A uvicorn server for ``state`` whose exit signals drain instead of dropping requests."""
    import uvicorn

    from .server_app import build_app

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if state.draining:  # second signal: stop now
                logger.warning("second stop signal: exiting without waiting for running requests")
                self.should_exit = self.force_exit = True
                return
            state.draining = True
            logger.info("stop signal: refusing new requests (503), finishing %d running ones",
                        state.engine.num_in_flight)

        async def _drain_watch(self) -> None:
            while not (state.draining and state.engine.num_in_flight == 0):
                await asyncio.sleep(0.05)
            self.should_exit = True

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            self._drain_task = asyncio.ensure_future(self._drain_watch())

    config = uvicorn.Config(build_app(state), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=30, access_log=log_level == "debug")
    return DrainingServer(config)


# -- CLI --------------------------------------------------------------------------------------------
def add_arguments(parser) -> None:
    from ..generation.cli import add_kernels_argument

    parser.add_argument("model", nargs="?", default=None,
                        help="model folder, .gguf file or Hub repo id (default: the embedded SmolLM2)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("CUDAFORMERS_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $CUDAFORMERS_API_KEY)")
    parser.add_argument("--served-model-name", default=None, help="the name clients pass as 'model' "
                        "(default: MODEL as given)")
    parser.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                        help="requests that may wait beyond --max-num-seqs running ones; more get 429")
    parser.add_argument("--skip-tokenizer-init", action="store_true",
                        help="serve without a tokenizer: token-id prompts only, text comes back as token_ids")
    g = parser.add_argument_group("model")
    g.add_argument("--dtype", default="auto", help="auto, bfloat16, float16, float32")
    g.add_argument("--device-map", default=None, help="cpu, cuda or cuda:N (default: the GPU when one is visible)")
    g.add_argument("--attn", default=None, help="attention backend (triton, sdpa, eager, flash_attention_2...)")
    g.add_argument("--gguf-file", default=None, help="GGUF file inside MODEL's folder")
    add_kernels_argument(g)
    g = parser.add_argument_group("engine")
    g.add_argument("--max-batch-tokens", type=int, default=8192, help="tokens per step (prefill chunks + decodes)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="requests in the running batch")
    g.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (default: sized from memory)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--max-memory-percent", type=float, default=0.9, help="share of free GPU memory for the cache")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-cuda-graph", action="store_true")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("-v", "--verbose", action="store_true", help="log automatic choices (attention, graphs)")


def _load(args):
    """Model and tokenizer as `generate` loads them (the model alone with --skip-tokenizer-init), with
    the engine's attention default when --attn is not given."""
    import torch

    from ..device import default_device
    from ..generation.cli import load
    from .llm import engine_attention

    if args.skip_tokenizer_init and (args.model is None or args.model.endswith(".gguf") or args.gguf_file):
        raise CudaformersError("--skip-tokenizer-init needs a safetensors model folder or Hub id "
                               "(a GGUF file carries its tokenizer: serve it with one)")
    if args.attn is None and args.device_map != "auto":
        args.attn = engine_attention(torch.device(args.device_map or str(default_device())))
    return load(args.model, args, with_tokenizer=not args.skip_tokenizer_init)


def run(args) -> int:
    require_web_stack()
    level = logging.INFO if args.verbose else getattr(logging, args.log_level.upper())
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("cudaformers").setLevel(level)  # automatic choices are logged at INFO
    if args.port < 0 or args.port > 65535:
        raise CudaformersError(f"--port {args.port} is not a port; use 0-65535")
    if not _is_loopback(args.host) and not args.api_key:
        logger.warning("binding to %s without --api-key: anyone who can reach this address can use the model",
                       args.host)
    model, tokenizer = _load(args)
    name = args.served_model_name or args.model or "SmolLM2-135M-Instruct"
    state = make_state(model, tokenizer, served_model_name=name, api_key=args.api_key, max_queue=args.max_queue,
                       max_batch_tokens=args.max_batch_tokens, max_num_seqs=args.max_num_seqs,
                       num_blocks=args.num_blocks, block_size=args.block_size, max_model_len=args.max_model_len,
                       max_memory_percent=args.max_memory_percent, enable_prefix_caching=not args.no_prefix_caching,
                       use_cuda_graph=False if args.no_cuda_graph else None)
    server = make_server(state, args.host, args.port, args.log_level)
    # The engine thread and the event loop share the GIL; Python's default 5 ms switch interval
    # can hold a step back by that much whenever the loop is busy writing streams.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    logger.info("cudaformers serve: %s on http://%s:%d (Ctrl-C drains and stops)", name, args.host, args.port)
    server.run()
    return 0 if not server.force_exit else 128 + signal.SIGINT


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
