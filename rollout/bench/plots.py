"""Figures of benchmark reports, for people who would rather look than read a table.

Owns: `bench_figure` (`rollout bench --plot FILE.png`: tokens/s of both sides per round, the
per-round ratios with their median and its interval, and the latency and time-to-first-token
distributions over every round) and `weight_sync_figure` (`benchmarks/weight_sync.py --plot`).
Both read only the JSON report a benchmark writes, so a saved report can be drawn again.
matplotlib (the `dev` extra) is imported when a figure is drawn, with the Agg backend (no
display needed); `require_matplotlib` says clearly when it is missing.
"""

from __future__ import annotations

from typing import Any

from rollout.errors import InvalidConfigError

ENGINE, RAW = "#1f77b4", "#ff7f0e"  # this engine, raw vLLM: the same colours in every panel


def require_matplotlib() -> Any:
    """matplotlib.pyplot with the Agg backend. Raises InvalidConfigError naming the fix when missing."""
    try:
        import matplotlib
    except ImportError as e:
        raise InvalidConfigError(
            "--plot: needs matplotlib (the `dev` extra: pip install -e '.[dev]', or pip install matplotlib)"
        ) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bench_figure(report: dict[str, Any], path: str) -> None:
    """Draw a `rollout bench` report (`rollout.bench.run.run_bench`) into `path` (PNG, or any format by suffix)."""
    plt = require_matplotlib()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), layout="constrained")
    ours, raw, rounds = report["engine"], report.get("raw_vllm"), report.get("rounds", [])
    cfg = report["resolved_config"]
    fig.suptitle(
        f"rollout bench {report['config']}: {cfg['engines']['count']} engine(s), {report['prompts']} prompts x "
        f"n={cfg['sampling']['n']}, max_tokens={cfg['sampling']['max_tokens']}, model={cfg['model']['path']}"
    )

    ax = axes[0][0]
    xs = list(range(1, ours["runs"] + 1))
    ax.plot(xs, [r["tokens_per_s"] for r in ours["per_run"]], "o-", color=ENGINE, label="this engine")
    ax.axhline(ours["tokens_per_s"], color=ENGINE, ls=":", lw=1)
    if raw:
        ax.plot(xs, [r["tokens_per_s"] for r in raw["per_run"]], "s-", color=RAW, label="raw vLLM")
        ax.axhline(raw["tokens_per_s"], color=RAW, ls=":", lw=1)
    ax.set(title="generated tokens/s per round (dotted: medians)", xlabel="round", ylabel="tokens/s", xticks=xs)
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right")

    ax = axes[0][1]
    if rounds:
        ratios, ci = [r["ratio"] for r in rounds], report["ratio_interval"]
        median = report["ratio_tokens_per_s"]
        ax.axhspan(
            ci["low"], ci["high"], color=ENGINE, alpha=0.15, label=f"{ci['coverage']:.1%} interval of the median"
        )
        ax.axhline(median, color=ENGINE, lw=2, label=f"median {median:.3f}")
        ax.axhline(1.0, color="grey", ls="--", lw=1, label="parity with raw vLLM")
        first = ["o" if r["order"] == "engine first" else "s" for r in rounds]
        for x, y, m in zip(xs, ratios, first):
            ax.plot(x, y, m, color="black", ms=7)
        ax.plot([], [], "o", color="black", label="round: this engine first")
        ax.plot([], [], "s", color="black", label="round: raw vLLM first")
        low, high = min(*ratios, ci["low"], 1.0), max(*ratios, ci["high"], 1.0)
        span = max(high - low, 0.02)
        ax.set_ylim(low - 0.1 * span, high + 0.6 * span)  # room above the data for the legend
        ax.set(xlabel="round", ylabel="this engine / raw vLLM", xticks=xs)
        ax.set_title(
            f"tokens/s ratio: median {median:.3f} of {len(rounds)} rounds, interval {ci['low']:.3f}-{ci['high']:.3f}"
        )
        ax.legend(loc="upper left", ncol=2, fontsize="small")
    else:
        ax.axis("off")
        ax.text(0.5, 0.5, "no raw vLLM baseline (bench.baseline: false)", ha="center", va="center")

    for ax, key, label in ((axes[1][0], "latency_s", "latency"), (axes[1][1], "ttft_s", "time to first token")):
        values, p = ours["samples"][key], ours[key]
        ax.hist(values, bins=50, color=ENGINE, alpha=0.8)
        for q, ls in (("p50", "-"), ("p90", "--"), ("p99", ":")):
            ax.axvline(p[q], color="black", ls=ls, lw=1, label=f"{q} {p[q]:.2f} s")
        ax.set(title=f"this engine: {label}, {len(values)} trajectories over {ours['runs']} round(s)",
               xlabel=f"{label} (s), queued to {'finished' if key == 'latency_s' else 'first token'}",
               ylabel="trajectories")  # fmt: skip
        ax.legend(loc="upper right")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def weight_sync_figure(report: dict[str, Any], path: str) -> None:
    """Draw a `benchmarks/weight_sync.py` report into `path`: per mode, the throughput cost of
    updating (per-round ratios and their median) and each engine's stall per update."""
    plt = require_matplotlib()
    results = report["results"]
    modes = [r["mode"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    fig.suptitle(f"weight sync: an update every {report['interval_s']:g} s while generating ({report['config']})")
    for i, r in enumerate(results):
        left.bar(i, r["ratio"], color=ENGINE, alpha=0.5)
        left.plot(_spread(i, len(r["ratios"])), r["ratios"], "o", color="black", alpha=0.6)
        left.text(i, r["ratio"] / 2, f"median\n{r['ratio']:.3f}", ha="center", va="center")
        stalls = [s * 1e3 for s in r.get("stalls_s", []) if s > 0]
        right.plot(_spread(i, len(stalls)), stalls, "o", color=RAW, alpha=0.6)
        median = r["stall_s"]["median"] * 1e3
        right.plot([i - 0.3, i + 0.3], [median] * 2, color="black", lw=2)
        right.text(i + 0.32, median, f"{median:.0f} ms", va="center", fontsize="small")
    left.axhline(1.0, color="grey", ls="--", lw=1)
    left.set(xticks=range(len(modes)), xticklabels=modes, ylabel="tokens/s updating / not",
             title="throughput while updating (bar: median; dots: rounds)")  # fmt: skip
    right.set_yscale("log")  # drain's stalls are 10-100x the others'
    right.set(xticks=range(len(modes)), xticklabels=modes, ylabel="stall (ms, log scale)",
              xlim=(-0.5, len(modes) - 0.2),
              title="each engine's stall per update, pause to resume (line: median)")  # fmt: skip
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _spread(x: float, count: int, width: float = 0.3) -> list[float]:
    """`count` positions around `x`, so that equal values do not hide each other."""
    return [x + width * (k / (count - 1) - 0.5) for k in range(count)] if count > 1 else [x] * count
