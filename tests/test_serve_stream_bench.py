"""benchmarks/serve_stream.py's arithmetic on canned streams: SSE parsing, the token-counting rule,
TTFT / ITL / TPOT and percentiles; and its placement of a server's engine processes. No servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

from benchmarks.serve_stream import (
    Chunk,
    SseParser,
    level_summary,
    percentile,
    place_engine,
    placement,
    request_stats,
    token_chunks,
)


def chat_chunk(t: float, content: str | None, usage: int | None = None, role: bool = False) -> Chunk:
    delta = {"role": "assistant", "content": ""} if role else {"content": content}
    event: dict = {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    if usage is not None:
        event["usage"] = {"prompt_tokens": 5, "completion_tokens": usage, "total_tokens": 5 + usage}
    return Chunk.of(t, event)


def final_usage(t: float, tokens: int) -> Chunk:
    return Chunk.of(t, {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": tokens}})


def test_sse_parser_joins_events_split_across_reads() -> None:
    p = SseParser()
    assert p.feed(b'data: {"a": ') == []
    assert p.feed(b"1}\r\n\r\ndata: [DO") == ['{"a": 1}']
    assert p.feed(b"NE]\n") == []
    assert p.feed(b"\n: a comment\n\ndata:x\ndata: y\n\n") == ["[DONE]", "x\ny"]


def test_chunk_reads_chat_and_completion_events() -> None:
    c = Chunk.of(1.0, {"choices": [{"delta": {"content": "héllo"}, "token_ids": [1, 2, 3]}], "usage": None})
    assert (c.choice, c.text, c.token_ids, c.usage) == (True, 5, 3, None)
    c = Chunk.of(2.0, {"choices": [{"index": 0, "text": "ab", "finish_reason": None}]})
    assert (c.choice, c.text, c.token_ids) == (True, 2, None)
    assert Chunk.of(3.0, json.loads('{"choices": [], "usage": {"completion_tokens": 7}}')).usage == 7


def test_tokens_counted_from_continuous_usage() -> None:
    """vLLM with continuous usage: the role chunk carries nothing; an empty-text chunk still carries
    its token (a byte the detokenizer holds back); a chunk with 2 tokens halves its gap."""
    chunks = [
        chat_chunk(0.10, None, usage=0, role=True),
        chat_chunk(0.20, "a", usage=1),
        chat_chunk(0.23, "", usage=2),
        chat_chunk(0.27, "bc", usage=4),
        final_usage(0.27, 4),
    ]
    assert token_chunks(chunks) == [(0.20, 1.0), (0.23, 1.0), (0.27, 2.0)]
    s = request_stats(0.0, chunks, 0.30)
    assert s.ttft == pytest.approx(0.20)
    assert s.itl == pytest.approx([0.03, 0.02])
    assert s.tpot == pytest.approx(0.07 / 3)
    assert (s.tokens, s.chunks, s.latency) == (4.0, 3, pytest.approx(0.30))


def test_tokens_spread_over_text_chunks_without_per_chunk_counts() -> None:
    """A server without continuous usage: the final usage is spread over the chunks with text."""
    chunks = [
        chat_chunk(0.5, None, role=True),
        chat_chunk(1.0, "xx"),
        chat_chunk(1.5, "yy"),
        chat_chunk(1.5, None),  # the finish-reason chunk: no text
        final_usage(1.5, 8),
    ]
    assert token_chunks(chunks) == [(1.0, 4.0), (1.5, 4.0)]
    s = request_stats(0.0, chunks, 1.6)
    assert s.ttft == pytest.approx(1.0)
    assert s.itl == pytest.approx([0.125])
    assert s.tpot == pytest.approx(0.5 / 4)


def test_one_chunk_stream_has_ttft_and_no_itl() -> None:
    chunks = [chat_chunk(2.0, "x" * 128), chat_chunk(2.0, None), final_usage(2.0, 128)]
    s = request_stats(0.5, chunks, 2.0)
    assert (s.ttft, s.itl, s.tpot, s.tokens, s.chunks) == (pytest.approx(1.5), [], None, 128.0, 1)
    summary = level_summary([s, s], wall=4.0)
    assert summary["itl_ms_p50"] is None and summary["tpot_ms_p50"] is None
    assert summary["output_tokens_s"] == pytest.approx(64.0)
    assert summary["chunks_per_request"] == 1.0
    assert summary["ttft_ms_p99"] == pytest.approx(1500.0)


def test_token_ids_win_over_usage() -> None:
    event = {"choices": [{"delta": {"content": "ab"}, "token_ids": [5, 6]}], "usage": {"completion_tokens": 9}}
    assert token_chunks([Chunk.of(1.0, event)]) == [(1.0, 2.0)]


def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0, 10.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0
    assert percentile(values, 99) == pytest.approx(9.76)  # numpy.percentile(values, 99)
    assert percentile(values, 25) == 2.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([], 50) is None


def test_level_summary_pools_every_request() -> None:
    a = request_stats(0.0, [chat_chunk(0.1, "a", 1), chat_chunk(0.2, "b", 2), final_usage(0.2, 2)], 0.2)
    b = request_stats(0.0, [chat_chunk(0.3, "a", 1), chat_chunk(0.7, "b", 2), final_usage(0.7, 2)], 0.7)
    s = level_summary([a, b], wall=0.8)
    assert s["ttft_ms_p50"] == pytest.approx(200.0)
    assert s["itl_ms_p50"] == pytest.approx(250.0)
    assert s["itl_ms_p99"] == pytest.approx(100 + 300 * 0.99)
    assert s["output_tokens_s"] == pytest.approx(4 / 0.8)
    assert s["latency_ms_p50"] == pytest.approx(450.0)


def test_place_engine_pins_and_nices_every_thread_below_the_server_and_leaves_the_server_alone():
    child = (
        "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); "
        "print('ready', flush=True); time.sleep(60)"
    )
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    server = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "ready\n"  # its engine's threads run
        (engine,) = psutil.Process(server.pid).children()
        place_engine(server.pid, {0}, 15)
        for t in engine.threads():
            assert os.sched_getaffinity(t.id) == {0}
            assert os.getpriority(os.PRIO_PROCESS, t.id) == 15
        assert os.getpriority(os.PRIO_PROCESS, server.pid) == os.getpriority(os.PRIO_PROCESS, 0)
        assert placement(server.pid)[1].endswith("cores 0, nice 15")
    finally:
        for p in psutil.Process(server.pid).children(recursive=True):
            p.kill()
        server.kill()
        server.wait()
