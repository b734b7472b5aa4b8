"""Where output goes (`rollout.log`): the libraries' (vLLM's, Ray's, torch's) to the run's files, the
engine's own lines and every error to the console, everything to the console with `-v` or debug.

Each case runs in a fresh interpreter: it replaces file descriptors and logging handlers, which
pytest's own capture holds in this one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from policies.vllm_args import engine_env
from rollout.config import load_config
from rollout.log import ENGINE_LOG_ENV, open_run_logs, quiet

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    """`code` in a new interpreter in the checkout; its stdout and stderr, as the console shows them."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**{k: v for k, v in os.environ.items() if k != ENGINE_LOG_ENV}, "PYTHONPATH": str(ROOT), **env},
    )


def test_an_engines_output_goes_to_its_file_and_its_own_lines_to_the_console(tmp_path):
    log = tmp_path / "run" / "engine-0.log"
    result = _run(
        f"""
        import os, subprocess, sys, warnings
        from rollout.log import configure, get_logger, output_to_file
        configure("info", stream=output_to_file({str(log)!r}))
        print("vllm says WARNING on stdout")
        warnings.warn("torch.distributed.reduce_op is deprecated", FutureWarning)
        os.write(2, b"[W utils.cpp:68] Warning: NUMA binding\\n")  # C++ code writes to the descriptor
        subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('engine core chatter\\\\n')"])
        get_logger("policies").warning("KV cache holds fewer requests", engine=0)
        """
    )
    assert result.returncode == 0, result.stderr
    console = result.stdout + result.stderr
    assert "KV cache holds fewer requests" in console and "engine=0" in console  # the project's own line
    for chatter in ("vllm says WARNING", "reduce_op", "NUMA binding", "engine core chatter"):
        assert chatter not in console, console
        assert chatter in log.read_text()
    assert "KV cache holds fewer" not in log.read_text()


def test_a_start_that_fails_names_its_cause_and_its_log(tmp_path):
    log = tmp_path / "engine-0.log"
    result = _run(
        """
        import os, subprocess, sys
        from rollout.log import output_to_file
        from policies.startup import shm_names, start_failure
        console = output_to_file(os.environ["ROLLOUT_ENGINE_LOG"])
        before = shm_names()  # what other engines on this machine hold stays theirs
        # the engine core's traceback, on the stderr it inherited
        subprocess.run([sys.executable, "-c", "raise ValueError('the KV cache is too small for one request')"])
        error = RuntimeError("Engine core initialization failed. See root cause above.")
        print(start_failure(error, before, 0), file=console)
        """,
        **{ENGINE_LOG_ENV: str(log)},
    )
    assert result.stderr.strip() == (
        f"engine 0 failed to start: ValueError: the KV cache is too small for one request (its log: {log})"
    ), result.stderr
    assert "Traceback" in log.read_text()


def test_the_libraries_log_to_the_run_file_and_their_errors_still_show(tmp_path):
    result = _run(
        f"""
        import logging, os
        from rollout.log import configure, get_logger, open_run_logs
        configure("info")
        run = open_run_logs({str(tmp_path)!r}, "info", False)
        logging.getLogger("ray._private.authentication").warning("Token authentication is enabled")
        logging.getLogger("vllm.triton_utils").warning("Triton is installed, but disabled")
        logging.getLogger("ray").error("the raylet died: out of memory")
        get_logger("rollout.engine").warning("a warning of ours")
        print("RUN", run, os.environ["VLLM_CONFIGURE_LOGGING"])
        """
    )
    assert result.returncode == 0, result.stderr
    (run,) = tmp_path.iterdir()
    assert f"RUN {run} 0" in result.stdout  # vLLM, imported later, keeps these handlers
    assert str(run) in result.stderr  # its path, said once
    assert result.stderr.count(str(run)) == 1
    assert "a warning of ours" in result.stderr and "the raylet died: out of memory" in result.stderr
    assert "Token authentication" not in result.stderr and "Triton" not in result.stderr
    driver = (run / "driver.log").read_text()
    assert "Token authentication" in driver and "Triton is installed" in driver and "raylet died" in driver


def test_verbose_or_debug_leaves_every_stream_on_the_console(tmp_path):
    assert quiet("info", False) and quiet("warning", False)
    assert not quiet("debug", False) and not quiet("info", True)
    assert open_run_logs(str(tmp_path), "debug", False) is None
    assert open_run_logs(str(tmp_path), "info", True) is None
    assert not list(tmp_path.iterdir())
    assert ENGINE_LOG_ENV not in engine_env(0, 1, 0)  # Ray forwards the engine's output as it is
    env = engine_env(0, 1, 0, "info", str(tmp_path / "engine-0.log"))
    assert env[ENGINE_LOG_ENV] == str(tmp_path / "engine-0.log") and env["VLLM_CONFIGURE_LOGGING"] == "1"


def test_the_logs_folder_is_a_config_key():
    cfg = load_config("tiny")
    assert (cfg.logging.dir, cfg.logging.verbose) == ("rollout-logs", False)
    cfg = load_config("tiny", ["logging.dir=/tmp/elsewhere", "logging.verbose=true"])
    assert (cfg.logging.dir, cfg.logging.verbose) == ("/tmp/elsewhere", True)
