"""Finished groups to the learner: the bounded queue and callers' own channels (`queue`), the
learner's end (`to_learner`), the staleness rule (`staleness`), and the durable log (`durable`,
its file format `grouplog`).
"""

from rollout.handout.durable import DurableLog, DurableLogError
from rollout.handout.queue import Submission, TrajectoryQueue
from rollout.handout.staleness import Admission, StalenessFilter, StalenessStats
from rollout.handout.to_learner import Batches, HandOut

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
