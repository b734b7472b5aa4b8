"""The `rollout` command: bench, run, validate. Every subcommand takes CONFIG and `-o key=value`.

    rollout bench configs/tiny.yaml -o engines.count=1 -o sampling.n=8
    rollout run configs/tiny.yaml --out trajectories.jsonl
    rollout validate configs/tiny.yaml
Exit codes: 0 ok, 2 bad config or input, 1 anything else.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import anyio
import msgspec

from rollout.config import Config, dump_config, load_config
from rollout.errors import InvalidConfigError, InvalidPromptError, RolloutError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollout", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("bench", "measure throughput and latency against raw vLLM; prints a table, writes a JSON report"),
        ("run", "generate the configured prompts and write trajectories as JSONL"),
        ("validate", "check a config (and its vLLM engine args) without starting engines"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("config", help="YAML experiment file")
        p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE", help="dotted override, repeatable")
        p.add_argument("--log-json", action="store_true", help="log JSON lines instead of console text")
        if name == "bench":
            p.add_argument("--report", help="JSON report path (default: bench.report from the config)")
            p.add_argument("--no-progress", action="store_true")
        if name == "run":
            p.add_argument("--out", required=True, help="output JSONL, one trajectory per line")
            p.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        overrides = list(args.override) + (["logging.json=true"] if args.log_json else [])
        cfg = load_config(args.config, overrides)
        return {"bench": _bench, "run": _run, "validate": _validate}[args.command](cfg, args)
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


def _bench(cfg: Config, args: argparse.Namespace) -> int:
    from rollout.bench import format_table, run_bench

    report = anyio.run(lambda: run_bench(cfg, args.config, progress=not args.no_progress, freeze_gc=True))
    path = Path(args.report or cfg.bench.report)
    path.write_text(json.dumps(report, indent=2))
    print(format_table(report))
    print(f"report: {path}")
    return 0


def _run(cfg: Config, args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from rollout.engine import RolloutEngine, freeze_heap
    from rollout.prompts import configured_prompts

    async def go() -> tuple[int, int]:
        total = cfg.prompts.count * cfg.sampling.n if cfg.prompts.source == "synthetic" else None
        bar = tqdm(total=total, unit="traj", file=sys.stderr, disable=args.no_progress, leave=False)
        written = failed = 0
        encoder = msgspec.json.Encoder()
        async with RolloutEngine(cfg, on_trajectory=lambda t: bar.update(1)) as engine:
            freeze_heap()
            engine.feed(configured_prompts(cfg.prompts, engine.limits.vocab_size))
            with open(args.out, "wb") as out:
                async for group in engine.groups():
                    if group.error:
                        failed += 1
                        print(f"rollout: prompt {group.prompt_id!r} failed: {group.error}", file=sys.stderr)
                    for t in group.trajectories:
                        out.write(encoder.encode(t) + b"\n")
                        written += 1
        bar.close()
        return written, failed

    written, failed = anyio.run(go)
    print(f"wrote {written} trajectories to {args.out}" + (f" ({failed} prompts failed)" if failed else ""))
    return 0


def _validate(cfg: Config, args: argparse.Namespace) -> int:
    from policies.tiny import resolve_model_path
    from policies.vllm_args import engine_args

    if cfg.prompts.source == "jsonl" and not Path(cfg.prompts.path or "").is_file():
        raise InvalidConfigError(f"prompts.path: no such file {cfg.prompts.path!r}")
    if cfg.model.path != "tiny":
        resolve_model_path(cfg.model.path)
    engine_args(cfg, cfg.model.path)
    if cfg.reward is not None and ":" not in cfg.reward:
        raise InvalidConfigError(f"reward: expected 'package.module:function', got {cfg.reward!r}")
    print(dump_config(cfg), end="")
    print(f"{args.config}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
