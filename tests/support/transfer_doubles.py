"""What the weight-transfer backend tests (gloo, shm) put around vLLM's real engine classes: a
module standing in for vLLM's model, its load, and a client with vLLM's four calls."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


class Module(torch.nn.Module):
    """Stands in for vLLM's model: `load_weights` copies by name and records what it got."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.w = {k: torch.zeros_like(v) for k, v in weights.items()}
        self.loaded: list[str] = []

    def load_weights(self, pairs):
        for name, t in pairs:
            self.w[name].copy_(t)
            self.loaded.append(name)


def reload(self, pairs) -> None:
    """vLLM's layerwise reload needs a vLLM model: here the load is the module's `load_weights`
    (a worker engine's `_reload`)."""
    self.model.loaded.clear()
    self.model.load_weights(pairs)


class Client:
    """vLLM's `VLLMWeightSyncClient` over in-process workers, each at its own rank, as rollout's
    client fans out to engines; `refuse` makes update_weights fail before any worker receives."""

    def __init__(self, workers):
        self.workers, self.refuse, self.pool = workers, None, ThreadPoolExecutor(len(workers))

    def _all(self, fn):
        for f in [self.pool.submit(fn, k, w) for k, w in enumerate(self.workers)]:
            f.result()

    def init_weight_transfer_engine(self, info):
        self._all(
            lambda k, w: w.init_transfer_engine(w.parse_init_info({**info, "rank_offset": info["rank_offset"] + k}))
        )

    def start_weight_update(self):
        self._all(lambda k, w: w.start_weight_update())

    def update_weights(self, info):
        if self.refuse:
            raise ValueError(self.refuse)
        self._all(lambda k, w: w.update_weights(info))

    def finish_weight_update(self, weight_version=None):
        self._all(lambda k, w: w.finish_weight_update())
