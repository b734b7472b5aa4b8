"""Tokens/s served over HTTP (`rollout serve`, loopback) against the same requests through the
in-process API (`engine.submit`), on the same engines, in one run.

Each round sends `--requests` chat requests at once, every one its own conversation, `--max-tokens`
generated each (min_tokens the same, so both sides do the same work): once through the server
(rendering, HTTP, JSON and the response's per-token fields included), once as the very prompt ids
the server rendered, submitted in process. The client runs in a process of its own, as agents do:
by default aiohttp posting JSON (as vLLM's serving benchmark does), or `--client openai`, the
OpenAI SDK, whose own CPU per request (httpx's connection pool at 512 connections) is then most of
what the machine spends on the HTTP side. Rounds alternate which side goes first; the figure is
the median over rounds of HTTP / in-process generated tokens/s. A third side, `paced`, submits
the same prompts in process one by one at the offsets the last HTTP round's requests reached the
engine (`ratio_paced`): what is left once the arrival spread is taken out. CPU seconds of the
server, client and engine processes per side are reported too. `--size 60M` (or 250M, 0.5B, 1B)
serves a random bf16 Llama of that size, built locally, instead of the config's model: a model
whose forward pass costs more than the front end's parsing, as every real one does.
`-o serve.api_servers=K` serves through K front-end processes (`rollout.serve.frontends`): the
server's CPU is then theirs plus the driver's, and the driver's share per request is reported
apart (how many front ends one driver feeds).

    python benchmarks/serve.py [CONFIG] [--requests 512] [--max-tokens 64] [--rounds 4] [--client aiohttp|openai]
        [--size 60M] [-o k=v] [--report FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rounds import alternating  # noqa: E402
from benchmarks.weight_plane import SIZES, build_model  # noqa: E402
from rollout.config import load_config  # noqa: E402
from rollout.driver_process import freeze_heap  # noqa: E402
from rollout.engine import RolloutEngine  # noqa: E402
from rollout.tiny import cache_root  # noqa: E402
from rollout.types import Prompt  # noqa: E402


async def run(
    cfg: Any, requests: int, max_tokens: int, rounds: int, client: str = "aiohttp", sim: int = 0
) -> dict[str, Any]:
    pool = _sim_pool(cfg, sim, max_tokens) if sim else None
    if pool is not None:
        await pool.ready()
    async with RolloutEngine(cfg, pool=pool) as engine:
        server = await engine.serve(port=0)
        freeze_heap()
        sampling = {"max_tokens": max_tokens, "min_tokens": max_tokens}
        messages = [[{"role": "user", "content": f"request {i}: " + "w" * (i % 97)}] for i in range(requests)]
        ids = [server.chat.render(m) for m in messages]
        client_cpu: list[float] = []
        arrivals: list[float] = []  # when the server submitted each request of the last HTTP round
        async with _client(client, server.url, server.model, client_cpu) as http_round:

            async def http() -> int:
                submit = engine.submit
                arrivals.clear()

                def recorded(prompts: Any, **kwargs: Any) -> Any:
                    arrivals.append(time.perf_counter())
                    return submit(prompts, **kwargs)

                engine.submit = recorded  # type: ignore[method-assign]
                try:
                    return await http_round(messages, sampling)
                finally:
                    del engine.submit

            def prompt(i: int) -> Prompt:
                return Prompt(token_ids=ids[i], sampling={**sampling, "n": 1}, id=f"q{i}")

            async def in_process() -> int:
                groups = await engine.submit([prompt(i) for i in range(requests)], train=False).result()
                return sum(len(t.token_ids) for g in groups for t in g.trajectories)

            async def paced() -> int:  # one by one, at the offsets the last HTTP round's requests reached the engine
                start = time.perf_counter()

                async def one(i: int, offset: float) -> int:
                    await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
                    groups = await engine.submit([prompt(i)], train=False).result()
                    return sum(len(t.token_ids) for g in groups for t in g.trajectories)

                offsets = [a - arrivals[0] for a in arrivals]
                return sum(await asyncio.gather(*(one(i, o) for i, o in enumerate(offsets))))

            await in_process()  # warm-up: every batch shape compiled once
            await http()
            sides = {"http": http, "in_process": in_process, "paced": paced}
            table = []
            for r, order in alternating(rounds, sides):
                row: dict[str, Any] = {}
                for name in order:
                    for e in engine.pool.engines:  # type: ignore[union-attr]
                        await e.reset_prefix_cache()
                    if name == "paced":
                        row["http_arrival_spread_s"] = arrivals[-1] - arrivals[0]
                    cpu, engines_cpu, start = time.process_time(), await _engines_cpu(pool), time.perf_counter()
                    front_cpu = _front_ends_cpu(server)
                    tokens = await sides[name]()
                    wall = time.perf_counter() - start
                    row[name] = tokens / wall
                    row[f"{name}_requests_s"] = requests / wall
                    row[f"{name}_front_ends_cpu_s"] = _front_ends_cpu(server) - front_cpu
                    row[f"{name}_server_cpu_s"] = time.process_time() - cpu + row[f"{name}_front_ends_cpu_s"]
                    row[f"{name}_engines_cpu_s"] = await _engines_cpu(pool) - engines_cpu
                row["ratio"] = row["http"] / row["in_process"]
                row["ratio_paced"] = row["http"] / row["paced"]
                row["http_client_cpu_s"] = client_cpu[-1]
                table.append(row)
                print(f"round {r + 1}: http {row['http']:.1f} tokens/s, in-process {row['in_process']:.1f} "
                      f"(ratio {row['ratio']:.3f}), "
                      f"in-process paced as HTTP arrived over {row['http_arrival_spread_s']:.2f} s {row['paced']:.1f} "
                      f"(ratio {row['ratio_paced']:.3f}); CPU s: server process {row['http_server_cpu_s']:.2f} "
                      f"(in-process {row['in_process_server_cpu_s']:.2f}), "
                      f"client process {row['http_client_cpu_s']:.2f}; "
                      f"HTTP requests/s {row['http_requests_s']:.0f}, server CPU per request "
                      f"{1e6 * row['http_server_cpu_s'] / requests:.0f} us (front-end processes "
                      f"{1e6 * row['http_front_ends_cpu_s'] / requests:.0f}; "
                      f"in-process {1e6 * row['in_process_server_cpu_s'] / requests:.0f})",
                      flush=True)  # fmt: skip
    us = {
        side: statistics.median(1e6 * r[f"{side}_server_cpu_s"] / requests for r in table)
        for side in ("http", "in_process")
    }
    driver_us = statistics.median(1e6 * (r["http_server_cpu_s"] - r["http_front_ends_cpu_s"]) / requests for r in table)
    return {"requests": requests, "max_tokens": max_tokens, "client": client, "model": cfg.model.path,
            "sim_engines": sim,
            "api_servers": cfg.serve.api_servers, "rounds": table, "driver_us_per_request": driver_us,
            "ratio": statistics.median(r["ratio"] for r in table),
            "ratio_paced": statistics.median(r["ratio_paced"] for r in table),
            "http_requests_s": statistics.median(r["http_requests_s"] for r in table),
            "server_us_per_request": us["http"], "in_process_us_per_request": us["in_process"]}  # fmt: skip


def _sim_pool(cfg: Any, engines: int, max_tokens: int) -> Any:
    """`engines` simulated GPU engines (`benchmarks.sim_pool`: 4 Ray actors, each answering every
    request with exactly `max_tokens` tokens at 20k tokens/s per engine, 256 at once) in place of
    vLLM: what is then measured is the front end's own cost per request, the driver's included."""
    import json

    from actors.cluster import connect
    from benchmarks.sim_engine import SimSpec
    from benchmarks.sim_pool import SimPool
    from rollout.tiny import resolve_model_path

    connect(cfg)
    vocab = json.loads((resolve_model_path(cfg.model.path, cfg.model.seed) / "config.json").read_text())["vocab_size"]
    spec = SimSpec(
        tokens_per_s=20_000.0, ttft_s=0.02, capacity=256, length=f"fixed:{max_tokens}", preempt=0.0, vocab=vocab
    )
    return SimPool.start(spec, engines, hosts=min(4, engines))


def _front_ends_cpu(server: Any) -> float:
    """CPU seconds so far of the server's front-end processes (`serve.api_servers` > 1; else none)."""
    import psutil

    total = 0.0
    for pid in getattr(server, "pids", {}).values():
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


async def _engines_cpu(pool: Any = None) -> float:
    """CPU seconds so far of the engines' processes on this machine (Ray actors, vLLM engine cores
    and workers; the simulator's hosts with `pool`)."""
    if pool is not None:
        return (await pool.counts())["cpu_s"]
    import psutil

    total = 0.0
    for proc in psutil.process_iter(["name", "cpu_times"]):
        if (proc.info["name"] or "").startswith(("ray::VLLMPolicy", "VLLM::")) and proc.info["cpu_times"] is not None:
            total += proc.info["cpu_times"].user + proc.info["cpu_times"].system
    return total


@contextlib.asynccontextmanager
async def _client(
    kind: str, url: str, model: str, client_cpu: list[float]
) -> AsyncIterator[Callable[[list, dict], Awaitable[int]]]:
    """A client process of `kind`; yields a function sending one round of chat requests at once
    and returning the tokens generated (its CPU seconds appended to `client_cpu`)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, __file__, "--client-of", url, "--model", model,
                                                "--client", kind, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE)  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout
    try:
        if (await stdout.readline()).strip() != b"ready":
            raise RuntimeError("the client process did not start")

        async def round_(messages: list, sampling: dict) -> int:
            stdin.write(msgspec.json.encode({"messages": messages, "sampling": sampling}) + b"\n")
            await stdin.drain()
            line = await stdout.readline()
            if not line:
                raise RuntimeError("the client process exited")
            tokens, cpu = line.split()
            client_cpu.append(float(cpu))
            return int(tokens)

        yield round_
    finally:
        stdin.close()
        await proc.wait()


@contextlib.asynccontextmanager
async def _sender(kind: str, url: str, model: str) -> AsyncIterator[Callable[[list, dict], Awaitable[int]]]:
    """`send(messages, sampling) -> tokens generated` over a fresh connection pool: one per round,
    since uvicorn closes connections idle for 5 s (as between rounds)."""
    if kind == "openai":
        import openai

        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=900) as client:

            async def send(messages: list, sampling: dict) -> int:
                r = await client.chat.completions.create(model=model, messages=messages, extra_body=sampling)
                return r.usage.completion_tokens

            yield send
    else:
        import aiohttp

        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=900), connector=aiohttp.TCPConnector(limit=0)
        ) as session:

            async def send(messages: list, sampling: dict) -> int:
                body = msgspec.json.encode({"model": model, "messages": messages, **sampling})
                async with session.post(
                    f"{url}/v1/chat/completions", data=body, headers={"content-type": "application/json"}
                ) as r:
                    r.raise_for_status()
                    return msgspec.json.decode(await r.read())["usage"]["completion_tokens"]

            yield send


async def _client_process(kind: str, url: str, model: str) -> None:
    """The client side, in a process of its own: a round per line of stdin, its tokens and CPU
    seconds on stdout."""
    __import__("openai" if kind == "openai" else "aiohttp")  # imported before "ready", not inside a round
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        job = msgspec.json.decode(line)
        cpu = time.process_time()
        async with _sender(kind, url, model) as send:
            tokens = sum(await asyncio.gather(*(send(m, job["sampling"]) for m in job["messages"])))
        print(tokens, time.process_time() - cpu, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default=str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"))
    ap.add_argument("-o", "--override", action="append", default=[])
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--client", choices=["aiohttp", "openai"], default="aiohttp",
                    help="the client process's HTTP client: aiohttp (as vLLM's serving benchmark) "
                         "or the OpenAI SDK")  # fmt: skip
    ap.add_argument(
        "--size",
        choices=list(SIZES),
        help="serve a random bf16 Llama of this size (built once, cached) instead of the config's model",
    )
    ap.add_argument("--cache", default=str(cache_root()), help="where --size models are built")
    ap.add_argument("--sim", type=int, default=0, metavar="N",
                    help="N simulated GPU engines (benchmarks/sim_pool.py) instead of vLLM: "
                         "the front end's own requests/s and CPU per request")  # fmt: skip
    ap.add_argument("--report", default="serve_report.json")
    ap.add_argument("--client-of", help=argparse.SUPPRESS)  # internal: run as the client process of this URL
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client_of:
        asyncio.run(_client_process(args.client, args.client_of, args.model))
        return 0
    model = [f"model.path={build_model(args.size, Path(args.cache))}", "model.dtype=bfloat16"] if args.size else []
    cfg = load_config(args.config, ["logging.level=warning", *model, *args.override])
    if args.sim < 0:
        ap.error(f"--sim: expected a number of engines >= 0, got {args.sim}")
    report = asyncio.run(run(cfg, args.requests, args.max_tokens, args.rounds, args.client, args.sim))
    print(f"HTTP / in-process generated tokens/s, median of {args.rounds} rounds: {report['ratio']:.3f} "
          f"(against in-process paced as the HTTP requests arrived: {report['ratio_paced']:.3f})")  # fmt: skip
    print(f"HTTP requests/s {report['http_requests_s']:.0f} with {report['api_servers']} front-end process(es); "
          f"the server's CPU per request {report['server_us_per_request']:.0f} us, "
          f"the driver's share {report['driver_us_per_request']:.0f} us "
          f"(in-process {report['in_process_us_per_request']:.0f} us)")  # fmt: skip
    Path(args.report).write_text(msgspec.json.encode(report).decode())
    print(f"report: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
