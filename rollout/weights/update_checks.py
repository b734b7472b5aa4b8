"""What a learner sends, checked before any engine sees it (`rollout.weights.updates` and
`rollout.weights.transfer` call these): a state dict packed on the driver's loop, tensor by
tensor; each transfer update's names, dtypes and shapes against the model; and the timeout our
backends' init infos carry to the engines.

Owns: `pack_on_loop`, `check_update` (a pure function of the model's manifest and the round so
far), `capped_infos`, `ONE_CALL_ROUND`, `LEARNER_TIMEOUT_S`. Does not own: the round and its
engines (`rollout.weights.transfer`), the manifest and the checks of one tensor (`rollout.tensors`),
which backend the engines run (`rollout.transfer_backend`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import anyio

from rollout.tensors import Manifest, Packed, TensorSpec, check_state_dict, pack, tensor_bytes
from rollout.transfer_backend import stages, transfer_backend

LEARNER_TIMEOUT_S = 300.0  # the timeout_s of our backends' init infos when the learner gives none
# backends whose trainer sends a round's names, dtypes and shapes in one update_weights call (vLLM's
# `nccl` trainer; ours, `gloo` and `shm`): a round that leaves a parameter out is refused there.
# vLLM's `ipc` trainer sends one call per packed chunk: its completeness is known only at finish.
ONE_CALL_ROUND = ("nccl", "gloo", "shm")


def check_update(manifest: Manifest, cfg: Any, sent: set[str], update_info: Any) -> tuple[list[str], list[str], int]:
    """The update's names, dtypes and shapes against the model's `manifest`, each name once in the
    round (`sent`: the round's names so far); the round's first call of a backend that sends it in
    one (`ONE_CALL_ROUND`, the engines' backend as `cfg` says) lists every parameter. Returns the
    names, what does not fit, and the update's bytes (0 when it does not)."""
    info = update_info[0] if isinstance(update_info, list) and update_info else update_info
    problems: list[str] = []
    try:
        names, dtypes, shapes = list(info["names"]), list(info["dtype_names"]), [tuple(s) for s in info["shapes"]]
    except (KeyError, TypeError) as e:
        problems.append(f"update_info: expected names, dtype_names and shapes, got {type(e).__name__}: {e}")
        names, dtypes, shapes = [], [], []
    if not problems and not (len(names) == len(dtypes) == len(shapes)):
        problems.append(f"update_info: {len(names)} names, {len(dtypes)} dtype_names, {len(shapes)} shapes")
    seen = set(sent)
    for name, dtype, shape in zip(names, dtypes, shapes):
        want = manifest.get(name)
        if want is None:
            problems.append(f"unknown {name}")
        elif want != TensorSpec(dtype, shape):
            problems.append(f"{name}: {dtype} {list(shape)}, model has {want.dtype} {list(want.shape)}")
        if name in seen:
            problems.append(f"{name} twice in the round")
        seen.add(name)
    if not problems and not sent and transfer_backend(cfg) in ONE_CALL_ROUND:
        if missing := sorted(set(manifest) - seen):
            problems.append(f"the round left out {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    if problems:
        return names, problems, 0
    return names, problems, sum(math.prod(s) * _itemsize(d) for d, s in zip(dtypes, shapes))


def capped_infos(cfg: Any, infos: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """Our backends' init infos with `timeout_s` (each of the worker's waits: connect,
    rendezvous, receive) at most `weight_sync.timeout_s`, so a rendezvous nobody serves ends
    within it; and what was capped, said (errors of the init's rendezvous repeat it)."""
    if not stages(cfg):
        return infos, ""  # vLLM's nccl / ipc take no timeout of ours
    bound = cfg.weight_sync.timeout_s
    asked = float(infos[0].get("timeout_s", LEARNER_TIMEOUT_S)) if infos else bound
    said = f"; the learner's timeout_s {asked:g} is capped at weight_sync.timeout_s={bound:g}"
    return [{**info, "timeout_s": min(asked, bound)} for info in infos], said if asked > bound else ""


async def pack_on_loop(weights: Any, manifest: Manifest) -> Any:
    """`rollout.tensors.pack` for the driver's event loop: a state dict of CPU tensors is checked
    and packed on the loop's own thread, one tensor per loop turn, so the loop blocks for one
    tensor at a time. Not in a worker thread: each torch call there releases the GIL and must win
    it back from the loop, and on cores the engines keep busy each hand-off waits to be scheduled
    (`benchmarks/weight_sync.py` times the update call). A directory (file reads) and tensors off the CPU (a copy
    each) go to a worker thread, where those costs outweigh the hand-offs."""
    if isinstance(weights, (str, Path)):
        return await anyio.to_thread.run_sync(pack, weights, manifest)
    specs = check_state_dict(weights, manifest)
    data = {}
    for name, t in list(weights.items()):
        if t.device.type == "cpu":
            data[name] = tensor_bytes(name, t)
            await anyio.sleep(0)
        else:
            data[name] = await anyio.to_thread.run_sync(tensor_bytes, name, t)
    return Packed(specs=specs, data=data)


def _itemsize(dtype: str) -> int:
    import torch

    return getattr(torch, dtype).itemsize
