"""The weight plane's cuda_ipc path on a real GPU, without vLLM: `benchmarks/gpu_ipc.py`'s core on a
tiny Llama shape. The learner's `PlaneSender` writes buckets into CUDA slots, a second process's
`PlaneReceiver` reads them through the IPC handles and loads them into a torch module; the
module's parameters must equal the source byte for byte, in every round (slots reused through
acks, tensors split over buckets, parameters zeroed before each round).

Skipped where torch sees no CUDA device. On a GPU machine without Ray / vLLM (the integration
conftest imports them), run it on its own:
    python -m pytest tests/integration/test_gpu_ipc.py --noconftest -p no:cacheprovider -q
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def tiny(**kw):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from benchmarks.gpu_ipc import run_size

    # 48 KiB buckets: ~80 buckets over 2 slots (every slot reused through acks), most tensors split
    # over several buckets; 8 MiB: one bucket holds the whole model.
    results = run_size(
        "tiny", [48 << 10, 8 << 20], slots=2, warmup=1, timeout_s=60, d2d_repeats=2, log=lambda _: None, **kw
    )
    assert results[0]["buckets"] > 40 and results[1]["buckets"] == 1
    for r in results:
        assert r["exact"], {k: v for k, v in r.items() if k != "rounds"}
        assert r["checksums_match"]
        assert all(round_["bytes"] == r["bytes"] and round_["tensors"] == r["tensors"] for round_ in r["rounds"])
    return results


def test_cuda_ipc_loads_exact_bytes_into_a_torch_model():
    for r in tiny(repeats=2):
        assert r["ipc_load_gbps_best"] > 0 and r["d2d_gbps"] > 0


def test_cuda_ipc_waits_for_queued_copies():
    """Both streams busy when a round starts (a learner straight out of its optimizer step, with
    `check_finite` off): a header sent before the copy into the slot ran, or an ack before the copy
    out of it, would load wrong bytes."""
    tiny(repeats=1, busy_ms=20)
