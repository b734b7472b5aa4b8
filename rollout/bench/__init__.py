"""`rollout bench`: the run against raw vLLM (`run`), multi-turn episodes (`multiturn`), the
printed table (`table`), plots (`plots`) and the progress bar (`progress`).
"""

from rollout.bench.progress import Progress
from rollout.bench.run import run_bench

__all__ = ["Progress", "run_bench"]
