"""The `rollout` command on fake engines: what it checks before starting any, and an output file
that survives whatever stops the run (`rollout.engine.start_pool` replaced by a `FakePool`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import structlog

import rollout.engine
from rollout.cli import main
from tests.support.fake_engine_runs import settled
from tests.support.fakes import FakeEngine, FakePool

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _logs_outlive_capsys():
    """The command configures logging to the stderr of the moment, `capsys`'s, closed after the test:
    later tests' log lines must not go there."""
    stderr = sys.stderr
    yield
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=stderr))


@pytest.fixture
def run_args(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"vocab_size": 260}')
    overrides = ["engines.count=1", "prompts.count=3", "prompts.min_len=4", "prompts.max_len=8", "sampling.n=2",
                 "sampling.max_tokens=4", "engines.max_inflight_per_engine=2", "engines.queued_per_engine=1",
                 "logging.level=error", f"model.path={tmp_path / 'model'}"]  # fmt: skip
    return ["configs/tiny.yaml", "--no-progress", *sum((["-o", o] for o in overrides), [])]


@pytest.fixture
def pools(monkeypatch):
    """Every pool the command starts (a FakePool of `FakeEngine`s, or of `engine_cls`)."""
    started: list[FakePool] = []
    state = {"engine_cls": FakeEngine}

    async def start_pool(cfg, model_path):
        started.append(FakePool([state["engine_cls"](i) for i in range(cfg.engines.count)]))
        return started[-1]

    monkeypatch.setattr(rollout.engine, "start_pool", start_pool)
    return started, state


def test_run_writes_every_trajectory(tmp_path, run_args, pools, capsys):
    out = tmp_path / "t.jsonl"
    assert main(["run", *run_args, "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 6 and "wrote 6 trajectories" in capsys.readouterr().out


@pytest.mark.parametrize("flags, verbose", [([], False), (["-v"], True), (["--verbose"], True)])
def test_verbose_shows_the_libraries_output(tmp_path, run_args, monkeypatch, capsys, flags, verbose):
    configs = []

    async def start_pool(cfg, model_path):
        configs.append(cfg)
        return FakePool([FakeEngine(i) for i in range(cfg.engines.count)])

    monkeypatch.setattr(rollout.engine, "start_pool", start_pool)
    assert main(["run", *run_args, *flags, "--out", str(tmp_path / "t.jsonl")]) == 0
    assert [c.logging.verbose for c in configs] == [verbose]


@pytest.mark.parametrize("where", ["missing/dir/t.jsonl", "."])
def test_run_refuses_an_output_it_cannot_write_before_starting_engines(tmp_path, run_args, pools, capsys, where):
    target = str(tmp_path / where)
    assert main(["run", *run_args, "--out", target]) == 2  # before: 1, after the engines had run
    assert f"--out {target}: cannot write it" in capsys.readouterr().err
    assert pools[0] == [], "no engine may start for a run whose output cannot be written"


def test_run_on_a_full_disk_says_how_many_trajectories_the_file_holds(run_args, pools, capsys):
    code = main(["run", *run_args, "--out", "/dev/full"])  # every write: ENOSPC, as a full disk
    err = capsys.readouterr().err
    assert code == 1 and "--out /dev/full: writing failed after 0 trajectories: No space left on device" in err, err


def test_run_streams_each_group_to_the_file_as_it_finishes(tmp_path, run_args, pools, capsys):
    out = tmp_path / "t.jsonl"
    seen: list[int] = []

    class Watching(FakeEngine):
        async def generate(self, request):
            if request.sample_index == 0:
                await settled()  # the learner took every finished group and waits
                seen.append(len(out.read_text().splitlines()))
            return await super().generate(request)

    pools[1]["engine_cls"] = Watching
    assert main(["run", *run_args, "--out", str(out)]) == 0
    assert seen == [0, 2, 4], seen  # before: [0, 0, 0], nothing reached the file until the run ended


def test_run_stopped_midway_keeps_what_was_written_and_says_so(tmp_path, run_args, pools, capsys):
    out = tmp_path / "t.jsonl"

    class Stopping(FakeEngine):
        async def generate(self, request):
            if request.prompt_id == "syn-2":
                await settled()  # the groups before it are handed out
                raise KeyboardInterrupt  # Ctrl-C (or SIGTERM, which unwinds the same way) mid-run
            return await super().generate(request)

    pools[1]["engine_cls"] = Stopping
    assert main(["run", *run_args, "--out", str(out)]) == 130
    lines = out.read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(line)["token_ids"] for line in lines)
    assert f"4 trajectories were written to {out} before the run stopped" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, key",
    [
        ("reward=no_such_module:score", "reward: cannot import module 'no_such_module'"),
        ("reward=json:no_such_function", "reward: module 'json' has no attribute"),
        ("env=no_such_module:Env", "env: cannot import module 'no_such_module'"),
    ],
)
def test_validate_imports_the_reward_and_the_environment(override, key, capsys):
    assert main(["validate", "configs/tiny.yaml", "-o", override]) == 2  # before: "ok"
    assert key in capsys.readouterr().err


def test_validate_asks_vllm_about_the_model_config(capsys):
    pytest.importorskip("vllm")
    assert main(["validate", "configs/tiny.yaml", "-o", "model.max_model_len=100000"]) == 2  # before: "ok"
    err = capsys.readouterr().err
    assert "model.max_model_len: vLLM refuses it: User-specified max_model_len (100000) is greater" in err, err


def test_bench_without_a_config_writes_its_report_naming_the_packaged_one(tmp_path, run_args, pools, capsys):
    # `rollout bench` with no CONFIG runs the packaged tiny; its report names it, as JSON can.
    report = tmp_path / "bench.json"
    overrides = run_args[1:]  # no config file: the packaged one
    assert main(["bench", *overrides, "--rounds", "1", "-o", "bench.warmup_prompts=2", "--report", str(report)]) == 0
    written = json.loads(report.read_text())
    assert written["config"] == "tiny" and written["engine"]["trajectories"] == 6
    assert "tokens/s" in capsys.readouterr().out


def test_an_unknown_config_name_exits_2_naming_the_packaged_ones(capsys):
    assert main(["validate", "tinyy"]) == 2
    err = capsys.readouterr().err
    assert "no packaged config named 'tinyy' (packaged: gpu, jsonl_prompts," in err, err


def test_cli_rejects_bad_config_naming_the_key():
    result = subprocess.run(
        [sys.executable, "-m", "rollout.cli", "validate", "configs/tiny.yaml", "-o", "engines.vllm.not_an_arg=1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "engines.vllm.not_an_arg: unknown vLLM engine argument" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "rollout.cli", "validate", "configs/tiny.yaml", "-o", "engines.cpus_per_engine=zero"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "engines.cpus_per_engine: expected `int`" in result.stderr
