"""Staleness control: how old the tokens a learner trains on may be, in policy epochs.

Lag of a token = the engine's epoch when its trajectory is handed out - the token's policy epoch.
`staleness.max_lag` bounds it twice:
- admission (`Admission`, used by the scheduler): with `k` groups consumed per weight update,
  the group started as the `s`-th one (0-based) is consumed around epoch `s // k`, so it may start
  only while `s < (epoch + max_lag + 1) * k` (AReaL's capacity rule). This keeps lag small when the
  learner does one update per batch, and costs nothing else.
- hand-out (`StalenessFilter`, used by `RolloutEngine`): the hard guarantee. Every token of an ok
  trajectory is checked against the epoch at hand-out; a trajectory with tokens older than
  `max_lag` is dropped (`stale: drop`; a group left empty is not handed out at all) or keeps its
  tokens with the stale ones out of the loss (`stale: mask`: `Trajectory.stale_tokens` leading
  tokens, as epochs only grow along a trajectory).
Counts of what was dropped or masked, and a histogram of the lag of every token seen at hand-out,
are in `StalenessStats`.
"""

from __future__ import annotations

import msgspec
import anyio

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
        """Add `t`'s tokens to the lag histogram; return how many lag more than max_lag."""
        if not t.ok or not t.token_ids:
            return 0
        stale = 0
        runs = t.policy_epochs or [(0, 0)]
        ends = [start for start, _ in runs[1:]] + [len(t.token_ids)]
        for (start, e), end in zip(runs, ends):
            lag, count = epoch - e, end - start
            self.stats.lag_tokens[lag] = self.stats.lag_tokens.get(lag, 0) + count
            if self.cfg.max_lag is not None and lag > self.cfg.max_lag:
                stale += count
        return stale


class Admission:
    """The admission rule: the `s`-th group may start while `s < (epoch + max_lag + 1) * k`.

    `k` (groups per weight update) is `staleness.batch_groups`, else the `groups` of the
    learner's latest batch request. Without `max_lag` every group may start.
    """

    def __init__(self, cfg: StalenessConfig):
        self.max_lag = cfg.max_lag
        self.batch_groups = cfg.batch_groups
        self.epoch = 0
        self.started = 0
        self._changed = anyio.Event()
        self._warned_at = -1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._notify()

    def learner_batch(self, groups: int) -> None:
        """The learner asks for batches of `groups` groups (used unless `batch_groups` is set)."""
        if groups != self.batch_groups and self.max_lag is not None:
            self.batch_groups = groups
            self._notify()

    @property
    def limit(self) -> int | None:
        """Groups that may have started by now; None: no limit."""
        if self.max_lag is None:
            return None
        if self.batch_groups is None:
            return 0
        return (self.epoch + self.max_lag + 1) * self.batch_groups

    async def acquire(self) -> None:
        """Wait until one more group may start, and count it as started."""
        while (limit := self.limit) is not None and self.started >= limit:
            if self._warned_at != self.epoch and self.batch_groups is not None:
                self._warned_at = self.epoch
                log.debug("admission waits for the next weight update", epoch=self.epoch, started=self.started,
                          max_lag=self.max_lag, batch_groups=self.batch_groups)  # fmt: skip
            changed = self._changed
            await changed.wait()
        self.started += 1

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()
