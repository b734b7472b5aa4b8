"""The `rollout` command: bench, run, validate, serve. Every subcommand takes CONFIG and `-o key=value`.

    rollout bench tiny -o engines.count=1 -o sampling.n=8
    rollout bench tiny --rounds 12 --plot bench.png
    rollout run tiny --out trajectories.jsonl
    rollout validate my_experiment.yaml
    rollout bench                         (no CONFIG: the packaged tiny)
    rollout serve tiny --port 8000 [--api-key KEY] [--api-servers 4]
CONFIG is a packaged config's name (tiny, gpu, multiturn, ...: the files of the repository's
configs/, shipped in the package) or a YAML file's path.
The console shows the engine's own progress and results; vLLM's, Ray's and torch's output goes to
files under logging.dir (./rollout-logs), whose path is printed once; -v shows it all here too.
Exit codes: 0 ok, 2 bad config or input, 1 anything else.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
from pathlib import Path
from typing import BinaryIO

import anyio
import msgspec

from rollout.config import Config, dump_config, load_config
from rollout.errors import InvalidConfigError, InvalidPromptError, RolloutError
from rollout.packed import json_hook


def build_parser() -> argparse.ArgumentParser:
    """The `rollout` command's parser, one subparser per subcommand (the CLI reference is generated
    from it: docs/gen_reference.py)."""
    parser = argparse.ArgumentParser(
        prog="rollout", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("bench", "measure throughput and latency against raw vLLM; prints a table, writes a JSON report"),
        ("run", "generate the configured prompts and write trajectories as JSONL"),
        ("validate", "check a config (and its vLLM engine args) without starting engines"),
        ("serve", "serve the engines over an OpenAI-compatible HTTP API (chat, completions, token in/out)"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument(
            "config",
            nargs="?",
            help="a packaged config's name or a YAML file's path (default: tiny, the embedded model)",
        )
        p.add_argument(
            "-o", "--override", action="append", default=[], metavar="KEY=VALUE", help="dotted override, repeatable"
        )
        p.add_argument("--log-json", action="store_true", help="log JSON lines instead of console text")
        if name != "validate":
            p.add_argument(
                "-v",
                "--verbose",
                action="store_true",
                help="show vLLM's, Ray's and torch's output on the console too (default: in files under logging.dir)",
            )
        if name == "bench":
            p.add_argument("--report", help="JSON report path (default: bench.report from the config)")
            p.add_argument(
                "--rounds",
                type=int,
                metavar="N",
                help="rounds of both sides (default: bench.rounds, 4); 12 for a tight interval",
            )
            p.add_argument(
                "--plot", metavar="FILE.png", help="also draw throughput per round, latency and time to first token"
            )
            p.add_argument("--no-progress", action="store_true", help="print no progress on stderr")
        if name == "run":
            p.add_argument("--out", required=True, help="output JSONL, one trajectory per line")
            p.add_argument("--no-progress", action="store_true", help="print no progress on stderr")
        if name == "serve":
            p.add_argument("--host", help="address to listen on (default: serve.host, 127.0.0.1)")
            p.add_argument("--port", type=int, help="port (default: serve.port, 8000; 0: a free one)")
            p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every request")
            p.add_argument(
                "--api-servers",
                type=int,
                metavar="N",
                help="HTTP front-end processes sharing the port (default: serve.api_servers, 1)",
            )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.config = args.config or "tiny"
    try:
        overrides = list(args.override) + (["logging.json=true"] if args.log_json else [])
        overrides += ["logging.verbose=true"] if getattr(args, "verbose", False) else []
        if getattr(args, "rounds", None) is not None:
            overrides += [f"bench.rounds={args.rounds}", "bench.repeats=null"]  # the flag wins over the old key
        if getattr(args, "api_servers", None) is not None:
            overrides.append(f"serve.api_servers={args.api_servers}")
        cfg = load_config(args.config, overrides)
        return {"bench": _bench, "run": _run, "validate": _validate, "serve": _serve}[args.command](cfg, args)
    except (InvalidConfigError, InvalidPromptError, FileNotFoundError) as e:
        print(f"rollout: error: {e}", file=sys.stderr)
        return 2
    except RolloutError as e:
        print(f"rollout: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("rollout: interrupted", file=sys.stderr)
        return 130
    finally:
        gc.unfreeze()  # bench and run freeze their heap once started; frozen objects at exit are reported as leaks


def _serve(cfg: Config, args: argparse.Namespace) -> int:
    """Start the engines and the server; print the URL once they serve; run until Ctrl-C or SIGTERM."""
    from rollout.driver_process import freeze_heap
    from rollout.engine import RolloutEngine
    from rollout.serve.auth import check_api_key

    check_api_key(args.api_key if args.api_key is not None else cfg.serve.api_key)  # before any engine starts

    async def go() -> None:
        async with RolloutEngine(cfg) as engine:
            freeze_heap()
            server = await engine.serve(args.host, args.port, args.api_key)
            print(f"rollout: serving {server.model} at {server.url}/v1", flush=True)
            await anyio.sleep_forever()

    anyio.run(go)
    return 0


def _bench(cfg: Config, args: argparse.Namespace) -> int:
    from rollout.bench.run import format_table, run_bench

    if args.plot:
        from rollout.bench.plots import require_matplotlib

        require_matplotlib()  # now, not after the run
    report = anyio.run(lambda: run_bench(cfg, args.config, progress=not args.no_progress, freeze_gc=True))
    path = Path(args.report or cfg.bench.report)
    path.write_text(json.dumps(report, indent=2))
    if "multiturn" in report:
        from rollout.bench.multiturn import format_table as multiturn_table

        print(multiturn_table(report["multiturn"]))
        print(f"report: {path}")
        return 0
    print(format_table(report))
    print(f"report: {path}")
    if args.plot:
        from rollout.bench.plots import bench_figure

        bench_figure(report, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _run(cfg: Config, args: argparse.Namespace) -> int:
    from rollout.bench.progress import Progress
    from rollout.driver_process import freeze_heap
    from rollout.engine import RolloutEngine
    from rollout.inputs.prompts import configured_prompts

    out = _open_output(args.out)  # before any engine starts: a path that cannot be written fails now
    writer = _Writer(out, args.out)

    async def go() -> int:
        total = cfg.prompts.count * cfg.sampling.n if cfg.prompts.source == "synthetic" else None
        bar = Progress("run", enabled=not args.no_progress)
        failed = 0
        async with RolloutEngine(cfg, on_trajectory=lambda t: bar.update(1)) as engine:
            freeze_heap()
            bar.start("", total)
            engine.feed(configured_prompts(cfg.prompts, engine.limits.vocab_size))
            async for group in engine.groups():
                if group.error:
                    failed += 1
                    print(f"rollout: prompt {group.prompt_id!r} failed: {group.error}", file=sys.stderr)
                writer.write(group.trajectories)  # flushed as each group finishes: a crash keeps them
        bar.close()
        return failed

    try:
        failed = anyio.run(go)
    except BaseException:
        if writer.written:  # what a crash, a signal or a full disk kept
            print(
                f"rollout: {writer.written} trajectories were written to {args.out} before the run stopped",
                file=sys.stderr,
            )
        raise
    finally:
        with contextlib.suppress(OSError):  # a full disk refuses the close's flush too: already reported
            out.close()
    print(f"wrote {writer.written} trajectories to {args.out}" + (f" ({failed} prompts failed)" if failed else ""))
    return 0


def _open_output(path: str) -> BinaryIO:
    try:
        return open(path, "wb")
    except OSError as e:
        raise InvalidConfigError(f"--out {path}: cannot write it: {e.strerror or e}") from e


class _Writer:
    """Trajectories as JSON lines, flushed per group; `written` counts those the file holds."""

    def __init__(self, out: BinaryIO, path: str):
        self.out, self.path, self.written = out, path, 0
        self.encoder = msgspec.json.Encoder(enc_hook=json_hook)  # an engine's packed ids and logprobs as lists

    def write(self, trajectories: list) -> None:
        try:
            for t in trajectories:
                self.out.write(self.encoder.encode(t) + b"\n")
            self.out.flush()
        except OSError as e:
            raise RolloutError(
                f"--out {self.path}: writing failed after {self.written} trajectories: {e.strerror or e}"
            ) from e
        self.written += len(trajectories)


def _validate(cfg: Config, args: argparse.Namespace) -> int:
    """Everything that can be checked without starting an engine: the config, the prompts file, the
    model and vLLM's view of the engine args, the reward function and the environment (imported)."""
    from rollout.engine import check_engine_args
    from rollout.episodes.env import load_env
    from rollout.inputs.prompts import ModelLimits, sampling_problem
    from rollout.inputs.rewards import load_reward
    from rollout.tiny import resolve_model_path

    if cfg.prompts.source == "jsonl" and not Path(cfg.prompts.path or "").is_file():
        raise InvalidConfigError(f"prompts.path: no such file {cfg.prompts.path!r}")
    load_reward(cfg.reward)
    load_env(cfg.env, cfg.env_args)
    model_path = str(resolve_model_path(cfg.model.path, cfg.model.seed))
    limits = ModelLimits.from_model_dir(model_path, cfg.model.max_model_len, cfg.engines.max_inflight_per_engine)
    if (bad := sampling_problem(cfg.sampling, limits.vocab_size)) is not None:
        raise InvalidConfigError(f"sampling.{bad}")
    check_engine_args(cfg, model_path)
    print(dump_config(cfg), end="")
    print(f"{args.config}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
