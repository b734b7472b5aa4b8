"""A real asynchronous GRPO run: a float32 learner trains the tiny Llama while the engines generate.

The task is verifiable and needs no data: after a prompt of random lowercase letters, every
generated token that is a digit byte ('0'..'9') scores, reward = digits / max_tokens in [0, 1].
The random-weight model starts near 10/260 and can only rise by learning.

Loop, per step: take `--groups` finished groups (`engine.batches(groups=k)`), compute the learner's
logprobs of the sampled tokens (plain torch, CPU, off the event loop), the decoupled PPO loss
against the engine's behaviour logprobs (`rollout.learner.offpolicy.decoupled_ppo_loss`), one Adam step,
then `await engine.update_weights(model.state_dict())` while the engines keep generating. Per step
it records the mean reward, the loss, each token's lag (engine epoch at hand-out minus the token's
policy epoch) and the time.

`--turns N` (N > 1) makes each sample a multi-turn episode (`rollout.episodes.examples.Digits`): N model turns,
each answered by a fixed "more" message, reward = digit tokens / tokens generated over the whole
episode; the learner trains on every model token of the conversation (observation tokens masked).

`--mode async` runs in flight (`weight_sync.mode=keep`, `staleness.max_lag=2`); `--mode sync` is
the synchronous baseline (`weight_sync.mode=drain`, `staleness.max_lag=0`: each step's groups start
only after the previous update); `--mode both` runs one then the other on fresh engines and
reports both curves, wall time and samples/s. Writes `OUT/async_grpo.json` and `OUT/async_grpo.png`.

    python benchmarks/async_grpo.py configs/tiny.yaml --steps 30 --mode both --out grpo_report
    python benchmarks/async_grpo.py configs/tiny.yaml --turns 3 --steps 30 --mode async --out grpo_multiturn
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout.config import Config, load_config  # noqa: E402
from rollout.engine import RolloutEngine  # noqa: E402
from rollout.types import Prompt, Trajectory  # noqa: E402

DIGIT_IDS = frozenset(range(4 + ord("0"), 4 + ord("9") + 1))  # byte b is token id 4 + b
LETTER_IDS = range(4 + ord("a"), 4 + ord("z") + 1)

# The learner needs the engines to compute in float32 too: behaviour and learner logprobs of the
# same weights then agree to ~1e-5, so every gap between them is staleness, not precision.
BASE = ["model.dtype=float32", "sampling.max_tokens=16", "sampling.n=8", "sampling.temperature=1.0",
        "logging.level=warning"]  # fmt: skip
MODES = {
    "async": ["weight_sync.mode=keep", "staleness.max_lag=2"],
    "sync": ["weight_sync.mode=drain", "staleness.max_lag=0"],
}


class DigitReward:
    """`(prompt, trajectory) -> digits generated / max_tokens`: stopping early never pays."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens

    def __call__(self, prompt: Prompt, traj: Trajectory) -> float:
        return sum(t in DIGIT_IDS for t in traj.token_ids) / self.max_tokens


def letter_prompts(seed: int) -> Iterator[Prompt]:
    """Endless prompts of 4..12 random lowercase letters; the engine reads them as capacity frees."""
    rng = random.Random(seed)
    i = 0
    while True:
        yield Prompt(token_ids=[rng.choice(LETTER_IDS) for _ in range(rng.randint(4, 12))], id=f"p{i}")
        i += 1


class Learner:
    """The policy being trained: HF Llama in float32 on CPU, Adam, decoupled PPO over one batch."""

    def __init__(self, model_path: str, lr: float, ppo_epochs: int = 1, behaviour_cap: float = 5.0, seed: int = 0):
        import torch
        from transformers import LlamaForCausalLM

        torch.manual_seed(seed)
        self.model = LlamaForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.ppo_epochs = ppo_epochs
        self.behaviour_cap = behaviour_cap

    def logprobs(self, input_ids: Any) -> Any:
        """Logprob of every token of `input_ids` under the model, aligned like the behaviour logprobs.

        Position t holds log p(input_ids[t] | input_ids[:t]), from the logits at t - 1; position 0 is 0.
        Right padding needs no attention mask: causal attention never looks ahead to it.
        """
        import torch

        logits = self.model(input_ids=input_ids).logits.float()
        picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        return torch.nn.functional.pad(picked, (1, 0))

    def step(self, tensors: dict[str, Any], epoch: int) -> dict[str, float]:
        """PPO epochs over one batch; `epoch` is the engine epoch of the learner's current weights."""
        import torch

        from rollout.learner.offpolicy import decoupled_ppo_loss

        mask, behaviour = tensors["loss_mask"], tensors["logprobs"]
        out: dict[str, float] = {}
        for i in range(self.ppo_epochs):
            current = self.logprobs(tensors["input_ids"])
            if i == 0:
                proximal = current.detach()  # the policy before this step: AReaL's proximal policy
                out["fresh_gap"] = fresh_gap(proximal, tensors, epoch)
            loss, metrics = decoupled_ppo_loss(
                current, proximal, behaviour, tensors["advantages"], mask, behaviour_cap=self.behaviour_cap
            )
            self.optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            if i == 0:
                out.update(loss=loss.item(), clip_frac=float(metrics["clip_frac"]),
                           behaviour_weight=float(metrics["behaviour_weight_mean"]))  # fmt: skip
        return out

    def gap(self, tensors: dict[str, Any], epoch: int) -> float:
        import torch

        with torch.no_grad():
            return fresh_gap(self.logprobs(tensors["input_ids"]), tensors, epoch)

    def state_dict(self) -> dict[str, Any]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def fresh_gap(learner_logprobs: Any, tensors: dict[str, Any], epoch: int) -> float:
    """Mean |learner - behaviour| logprob over the rows generated wholly by `epoch`; NaN without any.

    Those rows' every logit and KV entry came from the weights the learner holds as `epoch`, so
    the gap is float noise (~1e-6) unless the engine serves different weights than it was sent.
    """
    from rollout.learner.offpolicy import masked_mean

    mask = tensors["loss_mask"]
    fresh = mask * ((tensors["token_epochs"] == epoch) | (mask == 0)).all(dim=1, keepdim=True)
    if not fresh.any():
        return float("nan")
    return float(masked_mean((learner_logprobs - tensors["logprobs"]).abs(), fresh))


async def run(
    cfg: Config, steps: int, groups: int = 4, lr: float = 2e-3, ppo_epochs: int = 1, seed: int = 0,
    log: Any = None, record: bool = False, turns: int = 1, start: Callable[..., Any] = RolloutEngine,
) -> dict[str, Any]:  # fmt: skip
    """Train for `steps` learner steps of `groups` groups each; returns the per-step curve and totals.

    The engines stream from an endless prompt source throughout; after every step the new weights
    go to them in flight (`weight_sync.mode` and `staleness` in `cfg` decide how). `log(row)` sees
    each step's row as it is done. `record` adds `trajectories` (every one trained on) and
    `weights` (epoch -> the state dict the engines got) to the result, for an oracle replay.
    `start(cfg, **scoring)` opens the engine (`RolloutEngine`; the test suite passes its shared
    pools'); the epochs count on from the one it serves at the start (`start_epoch` in the result).
    """
    from rollout.episodes.examples import Digits
    from rollout.learner.offpolicy import lag

    t_start = time.perf_counter()
    scoring: dict[str, Any] = (
        {"env": lambda: Digits(turns)} if turns > 1 else {"reward": DigitReward(cfg.sampling.max_tokens)}
    )
    async with start(cfg, **scoring) as engine:
        learner = await asyncio.to_thread(Learner, engine.model_path, lr, ppo_epochs, seed=seed)
        engine.feed(letter_prompts(seed))
        start_epoch = engine.epoch
        weights = {start_epoch: learner.state_dict()} if record else {}
        trained_on: list[Trajectory] = []
        started = time.perf_counter()
        curve: list[dict[str, Any]] = []
        samples = tokens = straddling = 0
        ready = started
        for step in range(steps):
            batch = await engine.batches(groups=groups)
            assert batch is not None, "the prompt source is endless"
            got = time.perf_counter()
            tensors = batch.to_tensors()
            mask = tensors["loss_mask"] != 0
            lags = lag(tensors["token_epochs"], engine.epoch)[mask].float()
            trajectories = [t for t in batch.trajectories if t.ok]  # the rows of `tensors`
            if not trajectories:
                raise RuntimeError(f"step {step}: every trajectory failed: {[t.error for t in batch.trajectories][:3]}")
            # The learner step is plain blocking torch: run it in a thread so the scheduler keeps streaming.
            metrics = await asyncio.to_thread(learner.step, tensors, engine.epoch)
            trained = time.perf_counter()
            state = learner.state_dict()
            epoch = await engine.update_weights(state)
            if record:
                weights[epoch] = state
                trained_on.extend(trajectories)
            samples += len(trajectories)
            tokens += int(mask.sum())
            straddling += sum(1 for t in trajectories if len(t.policy_epochs) > 1)
            row = {
                "step": step,
                "reward": float(tensors["rewards"].mean()),
                **metrics,
                "lag_mean": float(lags.mean()) if lags.numel() else 0.0,
                "lag_max": int(lags.max()) if lags.numel() else 0,
                "stale_frac": float((lags > 0).float().mean()) if lags.numel() else 0.0,
                "epochs_in_batch": sorted({int(e) for e in tensors["token_epochs"][mask].unique()}),
                "wait_s": got - ready,  # the learner idle, waiting for groups
                "learn_s": trained - got,
                "update_s": engine.weight_updates[-1].seconds,
                "t": time.perf_counter() - started,
                "epoch": epoch,
            }
            curve.append(row)
            ready = time.perf_counter()
            if log:
                log(row)
        wall = time.perf_counter() - started
        staleness = msgspec.to_builtins(engine.staleness)  # cumulative: lag histogram, what was dropped
        # After `steps` in-flight updates the engines must serve exactly the learner's weights:
        # compare on the first groups generated wholly by the last epoch (not timed).
        final_gap = float("nan")
        for _ in range(10):  # with staleness.max_lag, a fresh group comes within max_lag + 1 batches
            if (batch := await engine.batches(groups=groups)) is None:
                break
            final_gap = await asyncio.to_thread(learner.gap, batch.to_tensors(), engine.epoch)
            if final_gap == final_gap:  # not NaN
                break
    return {
        "mode": cfg.weight_sync.mode,
        "max_lag": cfg.staleness.max_lag,
        "model_path": engine.model_path,
        "start_epoch": start_epoch,
        "steps": steps,
        "groups_per_step": groups,
        "samples": samples,
        "tokens": tokens,
        "wall_s": wall,
        "startup_s": started - t_start,
        "samples_per_s": samples / wall,
        "straddling_trajectories": straddling,
        "final_gap": final_gap,
        "staleness": staleness,
        "curve": curve,
        **({"trajectories": trained_on, "weights": weights} if record else {}),
    }


def window_means(curve: list[dict[str, Any]], k: int) -> tuple[float, float]:
    """Mean reward of the first `k` and of the last `k` steps."""
    rewards = [r["reward"] for r in curve]
    return statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])


def format_row(name: str, row: dict[str, Any]) -> str:
    return (
        f"{name:<5} step {row['step']:>3}  reward {row['reward']:.3f}  loss {row['loss']:+.4f}  "
        f"lag mean {row['lag_mean']:.2f} max {row['lag_max']}  epochs {row['epochs_in_batch']}  "
        f"gap {row['fresh_gap']:.1e}  t {row['t']:6.1f}s"
    )


def table(results: dict[str, dict[str, Any]], k: int) -> str:
    lines = [
        f"{'mode':<6} {'steps':>5} {'reward first':>12} {'reward last':>11} {'wall s':>7} {'samples/s':>9} "
        f"{'lag mean':>8} {'straddling':>10} {'final gap':>9}"
    ]
    for name, r in results.items():
        first, last = window_means(r["curve"], k)
        lag_mean = statistics.fmean(x["lag_mean"] for x in r["curve"])
        lines.append(
            f"{name:<6} {r['steps']:>5} {first:>12.3f} {last:>11.3f} {r['wall_s']:>7.1f} {r['samples_per_s']:>9.1f} "
            f"{lag_mean:>8.2f} {r['straddling_trajectories']:>10} {r['final_gap']:>9.1e}"
        )
    lines.append(f"reward first / last: mean over the first / last {k} steps; wall s excludes engine start")
    lines.append("straddling: trajectories generated across an update; final gap: mean |learner - engine| logprob")
    lines.append("of samples generated wholly after the last update (float noise when the weights arrived intact)")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: Path) -> bool:
    """Reward per step and per second of wall time; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        rewards = [x["reward"] for x in r["curve"]]
        by_step.plot([x["step"] for x in r["curve"]], rewards, marker=".", label=name)
        label = f"{name} ({r['samples_per_s']:.1f} samples/s)"
        by_time.plot([x["t"] for x in r["curve"]], rewards, marker=".", label=label)
    by_step.set(xlabel="learner step", ylabel="mean reward (digit fraction)", title="reward per step")
    by_time.set(xlabel="wall time since engines ready (s)", title="reward over time")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default=str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"))
    ap.add_argument("-o", "--override", action="append", default=[], help="dotted override, e.g. engines.count=1")
    ap.add_argument("--mode", choices=["async", "sync", "both"], default="both")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--groups", type=int, default=4, help="groups (prompts) per learner step")
    ap.add_argument("--turns", type=int, default=1, help="model turns per episode (1: single-turn samples)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ppo-epochs", type=int, default=1, help="optimizer steps per batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--window", type=int, default=5, help="steps averaged for the first / last reward")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the learner (engines pin their own cores)")
    ap.add_argument("--out", default=".", help="directory for async_grpo.json and async_grpo.png")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    modes = ["async", "sync"] if args.mode == "both" else [args.mode]
    results: dict[str, dict[str, Any]] = {}
    for name in modes:
        cfg = load_config(args.config, [*BASE, *MODES[name], *args.override])
        show = lambda row, n=name: print(format_row(n, row), flush=True)  # noqa: E731
        results[name] = asyncio.run(
            run(cfg, args.steps, args.groups, args.lr, args.ppo_epochs, args.seed, log=show, turns=args.turns)
        )
    print(table(results, args.window))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"config": args.config, "overrides": args.override, "args": vars(args), "results": results}
    (out / "async_grpo.json").write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    print(f"report: {out / 'async_grpo.json'}")
    if plot(results, out / "async_grpo.png"):
        print(f"plot: {out / 'async_grpo.png'}")
    else:
        print("plot: skipped (pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
