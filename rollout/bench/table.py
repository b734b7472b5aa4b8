"""The `rollout bench` table: a report (`rollout.bench.run.run_bench`) as text.

Owns the layout: the figure that matters first (the median over rounds of this engine / raw
vLLM, with its interval, how many rounds and how wide), then every round, then the figures over
all rounds, then speculative decoding when on. Reads only the JSON report, so a saved report
prints the same table.
"""

from __future__ import annotations

from typing import Any


def format_table(report: dict[str, Any]) -> str:
    """The report as text: the median ratio and its interval first, then each round, then the
    figures over every round (latency and time to first token pooled over all of them)."""
    ours, raw = report["engine"], report.get("raw_vllm")
    cfg = report["resolved_config"]
    n = cfg["sampling"]["n"]
    lines = [
        (f"rollout bench {report['config']}: {cfg['engines']['count']} engine(s), {report['prompts']} prompts x n={n}, "
         f"max_tokens={cfg['sampling']['max_tokens']}, model={cfg['model']['path']}")
    ]  # fmt: skip
    if "rounds" in report:
        rounds, ci = report["rounds"], report["ratio_interval"]
        lines += [
            (f"this engine / raw vLLM, generated tokens/s: {report['ratio_tokens_per_s']:.3f}, "
             f"median of {len(rounds)} rounds (order alternating)"),
            (f"  {ci['coverage']:.1%} interval {ci['low']:.3f}-{ci['high']:.3f}, width {ci['width']:.3f} "
             f"(sign test; more rounds narrow it: --rounds 12)"),
            "",
            f"{'round':>5}  {'first':<12}{'this engine tok/s':>19}{'raw vLLM tok/s':>16}{'ratio':>8}"
            f"{'batch (ours/raw)':>18}",
        ]  # fmt: skip

        def batch(r: dict[str, Any], a: str, b: str) -> str:  # reports written before the running batch have none
            return f"{r[a]:>9.1f}/{r[b]:<8.1f}" if a in r and b in r else f"{'-':>18}"

        for r in rounds:
            first = "this engine" if r["order"] == "engine first" else "raw vLLM"
            lines.append(f"{r['round']:>5}  {first:<12}{r['engine']:>19.1f}{r['raw_vllm']:>16.1f}{r['ratio']:>8.3f}"
                         f"{batch(r, 'engine_batch', 'raw_vllm_batch')}")  # fmt: skip
        lines.append(f"{'median':>5}  {'':<12}{ours['tokens_per_s']:>19.1f}{raw['tokens_per_s']:>16.1f}"
                     f"{report['ratio_tokens_per_s']:>8.3f}"
                     + batch({"a": ours.get("mean_running"), "b": raw.get("mean_running")}
                             if "mean_running" in ours else {}, "a", "b"))  # fmt: skip
    runs = ours["runs"]
    lines += ["", f"{f'over {runs} run(s), median':<38}{'this engine':>14}{'raw vLLM' if raw else '':>14}"]

    def row(name: str, key: str, fmt: str) -> None:
        other = f"{fmt.format(raw[key]):>14}" if raw else ""
        lines.append(f"{name:<38}{fmt.format(ours[key]):>14}{other}")

    row("generated tokens/s", "tokens_per_s", "{:.1f}")
    row("trajectories/s", "trajectories_per_s", "{:.2f}")
    row("generated tokens per run", "generated_tokens", "{:.0f}")
    row("wall time per run (s)", "elapsed_s", "{:.2f}")
    if "mean_running" in ours:
        row("mean running batch per engine", "mean_running", "{:.1f}")
        row("mean waiting in vLLM per engine", "mean_waiting", "{:.1f}")
    lines.append(f"this engine, every trajectory of the {runs} run(s):")
    for key, label in (("latency_s", "latency"), ("ttft_s", "time to first token")):
        p = ours[key]
        lines.append(f"{'  ' + label + ' p50/p90/p99 (s)':<38}{p['p50']:.2f} / {p['p90']:.2f} / {p['p99']:.2f}")
    lines.append(
        f"{'  per-engine token share':<38}" + "  ".join(f"e{i} {s:.1%}" for i, s in enumerate(ours["engine_share"]))
    )
    if ours["failed"] or ours["failed_groups"]:
        lines.append(f"{'failed, all runs':<38}{ours['failed']} trajectories, {ours['failed_groups']} groups")
    if "spec_decode" in ours:
        lines.extend(spec_decode_rows(cfg["speculative"], ours["spec_decode"], raw.get("spec_decode") if raw else None))
    return "\n".join(lines)


def spec_decode_rows(spec_cfg: dict[str, Any], ours: dict[str, Any], raw: dict[str, Any] | None) -> list[str]:
    """Table rows of speculative decoding figures (`SpecDecodeReport`s as builtins): summed over
    engines (this engine, and raw vLLM when given), then each engine of this engine's run."""
    lines = [f"speculative decoding: {spec_cfg['method']}, {ours['num_speculative_tokens']} draft tokens per step"]

    def cell(x: float | None, fmt: str) -> str:
        return fmt.format(x) if x is not None else "-"

    for name, key, fmt in (
        ("mean acceptance length", "mean_acceptance_length", "{:.3f}"),
        ("acceptance rate", "acceptance_rate", "{:.1%}"),
        ("drafts", "drafts", "{:d}"),
        ("draft tokens", "draft_tokens", "{:d}"),
        ("accepted tokens", "accepted_tokens", "{:d}"),
    ):
        other = f"{cell(raw['total'][key], fmt):>14}" if raw else ""
        lines.append(f"{'  ' + name:<28}{cell(ours['total'][key], fmt):>14}{other}")
    lines.append(
        f"{'  per-position rate':<28}{_positions(ours['total'])}"
        + (f"   (raw vLLM {_positions(raw['total'])})" if raw else "")
    )
    for m in ours["engines"]:
        label = f"  e{m['engine_id']} length/rate/pos"
        lines.append(
            f"{label:<28}{cell(m['mean_acceptance_length'], '{:.3f}')} / {cell(m['acceptance_rate'], '{:.1%}')} / "
            f"{_positions(m)}  ({m['drafts']} drafts)"
        )
    return lines


def _positions(m: dict[str, Any]) -> str:
    rates = m["per_position_rate"]
    return " ".join(f"{r:.3f}" for r in rates) if rates else "-"
