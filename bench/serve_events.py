"""Server CPU per streamed token: our ``EventStream`` pushing events through uvicorn to many clients.

    python bench/serve_events.py [--clients 128] [--events 200] [--http h11|httptools] [--loop asyncio|uvloop]

The server runs in its own process and yields one OpenAI-style completion chunk per "step" (a 4 ms
sleep stands for the decode step); each client streams its response with httpx. The figure is the
server process's CPU time (user + system) per event: what the serving process's event loop spends
per token it streams, the work that shares the interpreter with the engine thread in `cudaformers
serve`. No GPU and no model needed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

STEP_S = 0.004
SERVER = r'''
import asyncio, sys, uvicorn
from starlette.applications import Starlette
from starlette.routing import Route
from cudaformers.engine.server_app import EventStream
port, events, http, loop = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
async def chunks():
    for i in range(events):
        yield {"id": "cmpl-0", "object": "text_completion", "created": 1, "model": "m",
               "choices": [{"index": 0, "text": "", "token_ids": [i], "logprobs": None, "finish_reason": None}]}
        await asyncio.sleep(%r)
async def stream(request):
    return EventStream(chunks(), lambda: None)
app = Starlette(routes=[Route("/stream", stream)])
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", http=http, loop=loop)
''' % STEP_S


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def clients(port: int, n: int) -> int:
    import httpx

    async def one(c) -> int:
        got = 0
        async with c.stream("GET", f"http://127.0.0.1:{port}/stream") as r:
            async for line in r.aiter_lines():
                got += line.startswith("data: {")
        return got

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=n)) as c:
        return sum(await asyncio.gather(*(one(c) for _ in range(n))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=128)
    ap.add_argument("--events", type=int, default=200, help="events per client")
    ap.add_argument("--http", default="h11", choices=("h11", "httptools"))
    ap.add_argument("--loop", default="asyncio", choices=("asyncio", "uvloop"))
    args = ap.parse_args(argv)
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(args.events), args.http, args.loop], env=env)
    try:
        for _ in range(300):
            try:
                httpx.get(f"http://127.0.0.1:{port}/", timeout=0.5)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        cpu0, t0 = cpu_seconds(proc.pid), time.perf_counter()
        events = asyncio.run(clients(port, args.clients))
        seconds, cpu = time.perf_counter() - t0, cpu_seconds(proc.pid) - cpu0
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"http={args.http} loop={args.loop}: {events} events to {args.clients} clients in {seconds:.2f} s "
          f"(paced {args.events * STEP_S:.2f} s); server CPU {cpu:.2f} s = {1e6 * cpu / max(events, 1):.1f} us per event")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
