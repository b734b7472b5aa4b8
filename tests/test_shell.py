"""`actors.shell`: the class Ray gets for an engine forwards the public methods, of every kind,
and nothing else (the real engine actors run through it: tests/integration/test_engine.py)."""

from __future__ import annotations

import pytest

from actors.shell import shell


class Policy:
    """A policy."""

    def __init__(self, a: int, b: int = 0) -> None:
        self.a, self.b = a, b

    def plain(self, x: int) -> int:
        return self._own(x)

    async def coro(self, x: int, *, times: int = 1) -> int:
        return self._own(x) * times

    async def stream(self, n: int):
        for i in range(n):
            yield i + self.a

    def _own(self, x: int) -> int:
        return x + self.a + self.b


async def test_each_public_method_reaches_the_policy_it_holds():
    Shell = shell(Policy)
    s = Shell(1, b=2)
    assert isinstance(s.inner, Policy) and (s.inner.a, s.inner.b) == (1, 2)
    assert s.plain(10) == 13
    assert await s.coro(10, times=2) == 26
    assert [i async for i in s.stream(3)] == [1, 2, 3]
    assert Shell.__name__ == "Policy" and Shell.coro.__doc__ is Policy.coro.__doc__ and Shell.coro.__name__ == "coro"


def test_private_methods_stay_the_policy_s():
    Shell = shell(Policy)
    assert not hasattr(Shell, "_own")
    with pytest.raises(AttributeError):
        Shell(1)._own(1)
