"""Finished groups to the learner: the bounded queue and callers' own channels (`queue`), the
learner's end (`handout`), the staleness rule (`staleness`), and the durable log (`durable`,
its file format `grouplog`).
"""

from rollout.handoff.durable import DurableLog, DurableLogError
from rollout.handoff.handout import Batches, HandOut
from rollout.handoff.queue import Submission, TrajectoryQueue
from rollout.handoff.staleness import Admission, StalenessFilter, StalenessStats

__all__ = [
    "Admission",
    "Batches",
    "DurableLog",
    "DurableLogError",
    "HandOut",
    "StalenessFilter",
    "StalenessStats",
    "Submission",
    "TrajectoryQueue",
]
