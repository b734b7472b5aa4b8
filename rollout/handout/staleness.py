"""Staleness control: how old the tokens a learner trains on may be, in policy epochs.

Lag of a token = the engine's epoch when its trajectory is handed out - the token's policy epoch.
`staleness.max_lag` bounds it twice:
- admission (`Admission`, used by the scheduler): AReaL's capacity rule. With `k` groups consumed
  per weight update, a group may start only while `accepted + running < (epoch + max_lag + 1) * k`:
  `accepted` counts the groups handed out with something to train on, `running` the ones started
  and not yet handed out. A group that will never be trained on gives its slot back: one dropped
  at hand-out (every trajectory too stale) or one with nothing to train on (prompt rejected, every
  sample failed). This keeps lag small when the learner does one update per batch, and costs
  nothing else.
- hand-out (`StalenessFilter`; `hand_out` adds the admission counts; used by `RolloutEngine`): the
  hard guarantee. Every token of an ok trajectory is checked against the epoch at hand-out; a
  trajectory with tokens older than `max_lag` is dropped (`stale: drop`; a group left empty is not
  handed out at all) or keeps its tokens with the stale ones out of the loss (`stale: mask`:
  `Trajectory.stale_tokens` leading tokens, as epochs only grow along a trajectory).
Counts of what was dropped or masked, and a histogram of the lag of every token seen at hand-out,
are in `StalenessStats`.
"""

from __future__ import annotations

import anyio
import msgspec

from rollout.config import StalenessConfig
from rollout.log import get_logger
from rollout.types import Group, Trajectory

log = get_logger(__name__)


class StalenessStats(msgspec.Struct):
    """Cumulative since the engine started; diff two copies for one learner step."""

    max_lag: int | None = None
    groups: int = 0  # handed out
    dropped_groups: int = 0  # every trajectory stale: not handed out
    dropped_trajectories: int = 0
    dropped_tokens: int = 0
    masked_tokens: int = 0
    lag_tokens: dict[int, int] = msgspec.field(default_factory=dict)  # lag -> generated tokens seen at hand-out

    def lag_quantile(self, q: float) -> int | None:
        """The smallest lag with at least fraction `q` of the seen tokens at or below it."""
        total = sum(self.lag_tokens.values())
        if not total:
            return None
        seen = 0
        for lag in sorted(self.lag_tokens):
            seen += self.lag_tokens[lag]
            if seen >= q * total:
                return lag
        return max(self.lag_tokens)


class StalenessFilter:
    """The hand-out check: drops or masks tokens lagging more than `max_lag`, and counts lags."""

    def __init__(self, cfg: StalenessConfig):
        self.cfg = cfg
        self.stats = StalenessStats(max_lag=cfg.max_lag)

    def apply(self, group: Group, epoch: int) -> Group | None:
        """`group` as handed out at `epoch` (trajectories changed in place), or None if all dropped."""
        max_lag = self.cfg.max_lag
        kept: list[Trajectory] = []
        stale_any = False
        for t in group.trajectories:
            stale = self._count(t, epoch)
            if max_lag is None or stale == 0:
                kept.append(t)
            elif self.cfg.stale == "mask":
                t.stale_tokens = stale
                self.stats.masked_tokens += stale
                kept.append(t)
            else:
                stale_any = True
                self.stats.dropped_trajectories += 1
                self.stats.dropped_tokens += len(t.token_ids)
        if stale_any and not kept and group.trajectories:
            self.stats.dropped_groups += 1
            return None
        group.trajectories = kept
        self.stats.groups += 1
        return group

    def _count(self, t: Trajectory, epoch: int) -> int:
        """Add `t`'s model tokens to the lag histogram; return how many lag more than max_lag.

        Observation tokens of an episode (policy epoch -1) have no lag. Tokens without policy
        epochs cannot be checked: the trajectory fails with the reason (no epoch is ever guessed)."""
        if not t.ok or not t.token_ids:
            return 0
        if not t.policy_epochs:
            t.finish_reason, t.error = (
                "error",
                f"{len(t.token_ids)} tokens and no policy epochs: staleness cannot be checked",
            )
            return 0
        stale = 0
        runs = t.policy_epochs
        ends = [start for start, _ in runs[1:]] + [len(t.token_ids)]
        for (start, e), end in zip(runs, ends):
            if e < 0:
                continue
            lag, count = epoch - e, end - start
            self.stats.lag_tokens[lag] = self.stats.lag_tokens.get(lag, 0) + count
            if self.cfg.max_lag is not None and lag > self.cfg.max_lag:
                stale += count
        return stale


def trainable(group: Group) -> bool:
    """Whether `group` has something to train on: no error, and a sample that did not fail."""
    return group.error is None and any(t.ok for t in group.trajectories)


def hand_out(
    group: Group, epoch: int, check: StalenessFilter, admission: Admission, keep_dropped: bool = False
) -> Group | None:
    """`group` as handed out at `epoch`: filtered by `check`, counted by `admission` (accepted when
    there is something to train on, released when dropped). None when dropped, unless
    `keep_dropped` (a caller that must answer every prompt it fed): then with `error` set instead."""
    to_accept = trainable(group)  # else: it gave its slot back when it finished
    if (kept := check.apply(group, epoch)) is not None:
        if to_accept:
            admission.accept()
        return kept
    admission.release()  # never trained on
    if not keep_dropped:
        return None
    reason = f"every sample lagged more than staleness.max_lag={admission.max_lag} at epoch {epoch}"
    return Group(prompt_id=group.prompt_id, prompt=group.prompt, error=reason)


class Admission:
    """The admission rule: a group may start while `accepted + running < (epoch + max_lag + 1) * k + granted`.

    `k` (groups per weight update) is `staleness.batch_groups` when configured, else the `groups`
    of the learner's latest batch request. `granted`: groups let in by `grant` (a caller's step of
    its own size). Without `max_lag` every group may start. The scheduler calls `acquire` before a
    group starts and `release` for a group that finished with nothing to train on; the engine
    calls `accept` for a group handed out to be trained on, `release` for one dropped at hand-out.
    """

    def __init__(self, cfg: StalenessConfig):
        self.max_lag = cfg.max_lag
        self.configured = cfg.batch_groups
        self.batch_groups = cfg.batch_groups
        self.epoch = 0
        self.accepted = 0  # handed out to be trained on
        self.running = 0  # started, not yet handed out or released
        self.granted = 0
        self.waiting = 0  # groups held back by the rule right now
        self._changed = anyio.Event()
        self._warned_at = -1
        self._warned_batches: set[int] = set()

    def set_epoch(self, epoch: int) -> None:
        if self.max_lag and self.accepted and self.waiting and not self.running:
            # The learner took every group admitted; the next batch starts only now, so nothing
            # was generated during the step that just ended (by design only with max_lag=0).
            # (`accepted`: an update before the learner took anything ends no step.)
            log.warning("admission held generation back for a whole learner step: nothing was running ahead of "
                        "the learner at the update. Does it take more groups per update than batch_groups?",
                        epoch=epoch, max_lag=self.max_lag, batch_groups=self.batch_groups,
                        accepted=self.accepted)  # fmt: skip
        self.epoch = epoch
        self._notify()

    def learner_batch(self, groups: int) -> None:
        """The learner asks for batches of `groups` groups (used unless `batch_groups` is configured)."""
        if self.max_lag is None:
            return
        if self.configured is not None:
            if groups > self.configured and groups not in self._warned_batches:
                self._warned_batches.add(groups)
                log.warning("staleness.batch_groups is below the learner's batch size: admission lets batch_groups "
                            "groups start per weight update, so a batch fills only with one update per batch_groups",
                            batch_groups=self.configured, groups=groups)  # fmt: skip
            return
        if groups != self.batch_groups:
            self.batch_groups = groups
            self._notify()

    def grant(self, groups: int) -> None:
        """Let `groups` more groups start now, whatever the epoch: a caller's step of its own size,
        whose groups are all handed out before it can update weights (RolloutGeneration's calls).
        A failed one leaves its grant unused: harmless while that caller is the only consumer."""
        self.granted += groups
        self._notify()

    @property
    def limit(self) -> int | None:
        """Groups that may be accepted or running now; None: no limit."""
        if self.max_lag is None:
            return None
        if self.batch_groups is None:
            return self.granted
        return (self.epoch + self.max_lag + 1) * self.batch_groups + self.granted

    async def acquire(self) -> None:
        """Wait until one more group may start, and count it as running."""
        self.waiting += 1
        try:
            while (limit := self.limit) is not None and self.accepted + self.running >= limit:
                if self._warned_at != self.epoch and self.batch_groups is not None:
                    self._warned_at = self.epoch
                    log.debug("admission waits for the next weight update", epoch=self.epoch, accepted=self.accepted,
                              running=self.running, max_lag=self.max_lag, batch_groups=self.batch_groups)  # fmt: skip
                changed = self._changed
                await changed.wait()
        finally:
            self.waiting -= 1
        self.running += 1

    def accept(self) -> None:
        """A running group was handed out to be trained on."""
        self.running -= 1
        self.accepted += 1

    def release(self) -> None:
        """A running group will never be trained on (dropped at hand-out, nothing to train on): its slot frees."""
        self.running -= 1
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()
