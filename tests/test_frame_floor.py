"""The receive-floor benchmark (`benchmarks/frame_floor.py`): a sender process's results frames reach
the driver's real data path and decode into every sample sent, none lost, and bad inputs are refused
naming the flag."""

from __future__ import annotations

import asyncio
import multiprocessing

import msgspec
import pytest

from benchmarks.frame_floor import Options, _until_the_end, main, parse, payload, receive
from rollout.types import GroupResult


def test_a_payload_decodes_as_an_engine_s_results_frame():
    [result] = msgspec.msgpack.decode(payload(3, tokens=7, prompt_len=5), type=list[GroupResult])
    assert [len(t.token_ids) for t in result.trajectories] == [7, 7, 7]
    assert [len(t.prompt_token_ids) for t in result.trajectories] == [5, 5, 5]
    assert [t.sample_index for t in result.trajectories] == [0, 1, 2]
    assert result.trajectories[0].policy_epochs == [(0, 6), (3, 7)]


@pytest.mark.parametrize("raw", [False, True])
async def test_every_frame_sent_arrives_and_its_samples_decode(raw):
    o = Options(per_frame=[4], traj_per_s=2000, duration=0.1, tokens=16, prompt_len=8, raw=raw)
    row = await receive(o, 4)
    assert (row["frames"], row["lost"]) == (50, 0)
    assert row["samples_decoded"] == (0 if raw else 200)
    assert row["us_per_frame"] > 0 and row["us_per_traj"] == pytest.approx(row["us_per_frame"] / 4)


def _dies() -> None:
    raise SystemExit(3)


async def test_a_sender_that_dies_is_named_not_waited_for():
    sender = multiprocessing.get_context("spawn").Process(target=_dies)
    sender.start()
    with pytest.raises(RuntimeError, match=r"exit code 3"):
        await _until_the_end(asyncio.get_running_loop().create_future(), sender)
    sender.join()


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--per-frame", "0,4"], "--per-frame"),
        (["--per-frame", "four"], "--per-frame"),
        (["--traj-per-s", "nan"], "--traj-per-s"),
        (["--traj-per-s", "-5"], "--traj-per-s"),
        (["--duration", "0"], "--duration"),
        (["--duration", "0.01", "--per-frame", "64"], "--duration"),
        (["--tokens", "0"], "--tokens"),
        (["--prompt-len", "0"], "--prompt-len"),
    ],
)
def test_bad_inputs_name_their_flag(argv, flag, capsys):
    with pytest.raises(ValueError, match=f"^{flag}:"):
        parse(argv)
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(f"frame_floor: {flag}:")
