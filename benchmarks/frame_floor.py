"""The floor under one driver's CPU per trajectory: what receiving engines' results costs its process
and nothing else, by how many samples one results frame carries.

The receiver is the driver's own data path (`actors.channel.Channel`: the ROUTER socket, read by
`rollout.wire.FrameSocket`'s callback on an asyncio loop) with each frame decoded as
`RayEngine` decodes it (`list[GroupResult]`, packed token ids and logprobs unpacked into their
`Trajectory`s), and nothing else: no scheduling, no hand-out. A sender in a process of its own sends
results frames of `--per-frame` samples each (`--prompt-len` prompt and `--tokens` generated tokens,
epoch runs, times: what a `SimEngine` sends), paced so that `--traj-per-s` samples arrive a second,
spread out as engines' finishes are. `--raw` only reads the frames (a driver that forwards bytes).

Printed per row: frames and samples a second, the receiver's process CPU (all its threads, zmq's
IO thread included) per frame and per sample, the event loop's share of it (the rest: zmq's IO
thread) and the kernel's (system time). One engine's results frame carries what it finished
in one turn of its loop: 1-4 samples at 256 engines (`cluster_sim --profile`: ~3); a frame per node
per tick (README, "Past one driver") would carry tens.

    .venv/bin/python benchmarks/frame_floor.py [--per-frame 1,4,16,64] [--traj-per-s 4000] [--duration 4]
        [--report floor.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path

import msgspec
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.channel import Channel  # noqa: E402
from benchmarks.sim_measure import thread_cpu  # noqa: E402
from rollout.packed import Logprobs, TokenIds, encode  # noqa: E402
from rollout.types import GroupResult, Trajectory  # noqa: E402
from rollout.wire import RESULTS  # noqa: E402


class Options(msgspec.Struct, frozen=True):
    per_frame: list[int] = msgspec.field(default_factory=lambda: [1, 4, 16, 64])
    traj_per_s: float = 4000.0
    duration: float = 4.0
    tokens: int = 210
    prompt_len: int = 128
    raw: bool = False


def check(o: Options) -> None:
    """Raises ValueError naming the flag of the first bad input."""
    if not o.per_frame or any(k < 1 for k in o.per_frame):
        raise ValueError(f"--per-frame: every count must be >= 1, got {o.per_frame}")
    for flag, value in (("--traj-per-s", o.traj_per_s), ("--duration", o.duration)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{flag}: expected a finite number > 0, got {value}")
    for flag, value in (("--tokens", o.tokens), ("--prompt-len", o.prompt_len)):
        if value < 1:
            raise ValueError(f"{flag}: expected >= 1, got {value}")
    if o.traj_per_s / max(o.per_frame) * o.duration < 2:
        raise ValueError(
            f"--duration: {o.duration} s at --traj-per-s {o.traj_per_s} sends under 2 frames of {max(o.per_frame)}"
        )


def payload(k: int, tokens: int, prompt_len: int) -> bytes:
    """A results frame's payload: one group's `k` finished samples, as an engine encodes them."""
    now = time.time()
    trajs = [
        Trajectory(
            request_id=f"g123456-{i}", prompt_id="q123456", sample_index=i,
            prompt_token_ids=TokenIds(range(prompt_len)),
            token_ids=TokenIds(range(tokens)), logprobs=Logprobs([-0.5] * tokens), finish_reason="stop",
            policy_epochs=[(0, 6), (tokens // 2, 7)], kv_epochs=[(0, 6), (prompt_len + tokens // 2, 7)],
            engine_id=17, submitted_at=now, first_token_at=now, finished_at=now,
        )
        for i in range(k)
    ]  # fmt: skip
    return encode([GroupResult(key="123456", trajectories=trajs)])


def send(address: str, identity: bytes, body: bytes, frames: int, rate: float) -> None:
    """The sender's process: `frames` results frames at `rate` a second, then an empty one (the end)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    start = time.perf_counter()
    for i in range(frames):
        if (wait := start + i / rate - time.perf_counter()) > 0:
            time.sleep(wait)
        sock.send_multipart([RESULTS, body])
    sock.send_multipart([RESULTS, b""])
    sock.close()


async def receive(o: Options, k: int) -> dict[str, float]:
    """One row: the receiver's process CPU from the first frame to the last, per frame and per sample."""
    frames = max(2, round(o.traj_per_s / k * o.duration))
    channel = Channel()
    address = channel.open()
    done = asyncio.get_running_loop().create_future()
    seen: dict = {"frames": 0, "samples": 0, "cpu0": 0.0, "t0": 0.0, "threads0": {}, "times0": None}

    def on_frame(kind: bytes, body: bytes) -> None:
        if not body:  # the end
            done.set_result((time.process_time(), time.perf_counter(), thread_cpu(), os.times()))
            return
        if seen["frames"] == 0:
            seen["cpu0"], seen["t0"], seen["threads0"], seen["times0"] = (
                time.process_time(),
                time.perf_counter(),
                thread_cpu(),
                os.times(),
            )
        seen["frames"] += 1
        if not o.raw:
            for r in msgspec.msgpack.decode(body, type=list[GroupResult]):
                seen["samples"] += len(r.trajectories)

    identity = channel.register(0, on_frame)
    sender = multiprocessing.get_context("spawn").Process(
        target=send, args=(address, identity, payload(k, o.tokens, o.prompt_len), frames, o.traj_per_s / k)
    )
    sender.start()
    try:
        cpu1, t1, threads1, times1 = await _until_the_end(done, sender)
    finally:
        sender.join()
        channel.close()
    counted = frames - 1  # CPU from the first frame's arrival to the end's: the frames after the first
    cpu = cpu1 - seen["cpu0"]
    threads = {name: threads1[name] - seen["threads0"].get(name, 0.0) for name in threads1}
    t0 = seen["times0"]
    return {
        "per_frame": k, "frames": seen["frames"], "frames_per_s": counted / (t1 - seen["t0"]),
        "traj_per_s": counted * k / (t1 - seen["t0"]),
        "us_per_frame": 1e6 * cpu / counted, "us_per_traj": 1e6 * cpu / (counted * k),
        "samples_decoded": seen["samples"], "lost": frames - seen["frames"],
        "loop_share": threads.get("main", 0.0) / cpu if cpu else 0.0,
        "sys_share": (times1.system - t0.system) / cpu if cpu else 0.0,
    }  # fmt: skip


async def _until_the_end(done: asyncio.Future, sender: multiprocessing.process.BaseProcess) -> tuple:
    """The end frame's arrival; raises if the sender died first, or ended and its end never came."""
    ended_at = None
    while True:
        await asyncio.wait([done], timeout=0.5)
        if done.done():
            return done.result()
        if sender.exitcode not in (None, 0):
            raise RuntimeError(f"the sender process failed (exit code {sender.exitcode})")
        if sender.exitcode == 0:
            ended_at = ended_at or time.monotonic()
            if time.monotonic() - ended_at > 10:  # its socket lingers 2 s: the frames are gone
                raise RuntimeError("the sender ended and its last frames never arrived")


def parse(argv: list[str] | None) -> tuple[Options, str | None]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--per-frame", default="1,4,16,64", help="samples per results frame, one row each (comma-separated)")
    p.add_argument("--traj-per-s", type=float, default=4000.0, help="samples arriving per second")
    p.add_argument("--duration", type=float, default=4.0, help="seconds of frames per row")
    p.add_argument("--tokens", type=int, default=210, help="generated tokens per sample")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sample")
    p.add_argument("--raw", action="store_true", help="read the frames without decoding them")
    p.add_argument("--report", help="write the rows as JSON here")
    a = p.parse_args(argv)
    try:
        per_frame = [int(x) for x in a.per_frame.split(",")]
    except ValueError:
        raise ValueError(f"--per-frame: expected comma-separated integers, got {a.per_frame!r}") from None
    o = Options(
        per_frame=per_frame,
        traj_per_s=a.traj_per_s,
        duration=a.duration,
        tokens=a.tokens,
        prompt_len=a.prompt_len,
        raw=a.raw,
    )
    check(o)
    return o, a.report


def main(argv: list[str] | None = None) -> int:
    try:
        o, report = parse(argv)
    except ValueError as e:
        print(f"frame_floor: {e}", file=sys.stderr)
        return 2
    rows = []
    print(
        f"{'per frame':>9} {'frames/s':>9} {'traj/s':>8} {'us/frame':>9} {'us/traj':>8} "
        f"{'loop':>5} {'sys':>5} {'lost':>5}"
    )
    for k in o.per_frame:
        r = asyncio.run(receive(o, k))
        rows.append(r)
        print(
            f"{k:>9} {r['frames_per_s']:>9,.0f} {r['traj_per_s']:>8,.0f} {r['us_per_frame']:>9.1f} "
            f"{r['us_per_traj']:>8.1f} {r['loop_share']:>5.0%} {r['sys_share']:>5.0%} {r['lost']:>5}",
            flush=True,
        )
    if report:
        Path(report).write_text(json.dumps({"options": msgspec.to_builtins(o), "rows": rows}, indent=1))
    return 0 if all(r["lost"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
