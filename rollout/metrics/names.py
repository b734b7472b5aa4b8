"""What each figure of `engine.metrics()` means: the one place its meaning is written.

Owns: the meaning of every name `rollout.metrics.live.figures` returns (a per-engine name is
written with `{i}` for the engine's index). docs/gen_reference.py renders them into the metrics
reference and fails when `figures` returns a name missing here, or this names one it never
returns. The Prometheus metrics carry their own help text where the exporter's `Collector`
yields them. Does not own computing any figure (`figures`).
"""

from __future__ import annotations

WINDOW_FIGURES: dict[str, str] = {
    "rollout/window_s": "Seconds the window spans: since the previous call (the first: since the engine started).",
    "rollout/tokens": "Generated tokens of ok trajectories finished in the window.",
    "rollout/tokens_per_s": "`rollout/tokens` per second of wall time.",
    "rollout/trajectories": "Ok trajectories finished in the window.",
    "rollout/trajectories_per_s": "`rollout/trajectories` per second of wall time.",
    "rollout/failed_trajectories": "Trajectories that failed in the window.",
    "rollout/groups": "Groups handed out to the learner.",
    "rollout/stale_dropped": "Trajectories dropped at hand-out by `staleness.max_lag`.",
    "rollout/stale_dropped_groups": "Groups not handed out: every trajectory in them was too stale.",
    "rollout/stale_masked_tokens": "Tokens masked out of the loss by `staleness.max_lag` (`staleness.stale: mask`).",
    "rollout/epoch": "The policy epoch the engines serve, now.",
    "rollout/weight_updates": "Weight updates in the window.",
    "rollout/update_stall_ms_max": "The longest stall of an engine in the window's updates, in ms (0 without updates).",
    "rollout/queue_depth": "Groups running or waiting for the learner, now.",
    "rollout/queue_ready": "Finished groups waiting for the learner, now.",
    "rollout/preemptions": "vLLM preemptions (KV dropped and recomputed), summed over engines and across restarts.",
    "rollout/durable_torn_records": (
        "With `queue.durable_dir`: a crash's torn (or zero-filled) last record cut off the log when "
        "this run opened it (in the first window only)."
    ),
    "rollout/durable_torn_bytes": "The bytes of `rollout/durable_torn_records`.",
    "rollout/lag_mean": "Mean lag in epochs of the tokens handed out (absent when none were).",
    "rollout/lag_p99": "99th percentile of that lag (absent when no tokens were handed out).",
    "rollout/lag_max": "Largest lag of a handed-out token (absent when none were).",
    "rollout/engine_busy_fraction/e{i}": "Share of the window engine `i` had at least one request in flight.",
    "rollout/spec_decode/drafts": "With `speculative:` on: verification steps that had drafts.",
    "rollout/spec_decode/draft_tokens": "With `speculative:` on: draft tokens proposed.",
    "rollout/spec_decode/accepted_tokens": "With `speculative:` on: draft tokens accepted.",
    "rollout/spec_decode/mean_acceptance_length": (
        "With `speculative:` on: `1 + accepted_tokens / drafts` (absent when nothing was drafted)."
    ),
    "rollout/spec_decode/acceptance_rate": (
        "With `speculative:` on: `accepted_tokens / draft_tokens` (absent when nothing was drafted)."
    ),
}
