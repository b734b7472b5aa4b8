"""A long-tailed prompt set for `rollout bench`: most prompts short, a few long.

Writes JSONL, one `Prompt` per line: random token prompts (lengths uniform in [min_len, max_len]),
a fraction `--long-fraction` (default 10%) generating `--long-tokens` (512) tokens, the rest
`--short-tokens` (32); each prompt's `min_tokens` equals its `max_tokens`, so a random-weight model
stopping early cannot shorten the tail. Long prompts sit at seeded random positions.

    python benchmarks/long_tail_prompts.py --count 512 --out /tmp/long_tail.jsonl
    rollout bench configs/tiny.yaml -o prompts.source=jsonl -o prompts.path=/tmp/long_tail.jsonl

What to look at: this engine / raw vLLM (handed everything at once, dealt round-robin by group)
and each side's mean running batch; an engine left with the long samples of a wave runs alone.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import msgspec

from rollout.types import Prompt


def long_tail(count: int, long_fraction: float = 0.1, short_tokens: int = 32, long_tokens: int = 512,
              min_len: int = 16, max_len: int = 128, vocab_size: int = 260, seed: int = 0) -> list[Prompt]:  # fmt: skip
    """`count` prompts, round(count * long_fraction) of them generating `long_tokens` tokens."""
    if not 0 <= long_fraction <= 1:
        raise ValueError(f"long_fraction: expected a fraction in [0, 1], got {long_fraction}")
    rng = random.Random(seed)
    longs = set(rng.sample(range(count), round(count * long_fraction)))
    prompts = []
    for i in range(count):
        tokens = long_tokens if i in longs else short_tokens
        ids = [rng.randrange(4, vocab_size) for _ in range(rng.randint(min_len, max_len))]
        sampling = {"max_tokens": tokens, "min_tokens": tokens}
        prompts.append(Prompt(token_ids=ids, id=f"{'long' if i in longs else 'short'}-{i}", sampling=sampling))
    return prompts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=512)
    p.add_argument("--long-fraction", type=float, default=0.1)
    p.add_argument("--short-tokens", type=int, default=32)
    p.add_argument("--long-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    prompts = long_tail(a.count, a.long_fraction, a.short_tokens, a.long_tokens, seed=a.seed)
    a.out.write_bytes(b"".join(msgspec.json.encode(x) + b"\n" for x in prompts))
    print(
        f"{a.out}: {len(prompts)} prompts, {sum(x.id.startswith('long') for x in prompts)} generating "
        f"{a.long_tokens} tokens"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
