"""Where and when each request runs: admission and groups (`scheduler`), groups waiting for room
(`lobby`), the learner's plain groups run by callbacks (`callback_group`), the engines' loads, streams and
failures (`runner`), the routing policy (`router`), and the engine protocols, all this part knows
of engines (`protocols`).
"""

from rollout.scheduling.protocols import Engine, EnginePool
from rollout.scheduling.router import EngineLoad, route
from rollout.scheduling.runner import Runner
from rollout.scheduling.scheduler import Scheduler

__all__ = ["Engine", "EngineLoad", "EnginePool", "Runner", "Scheduler", "route"]
