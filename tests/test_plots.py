"""`rollout bench --plot` and `benchmarks/weight_sync.py --plot`: figures drawn from the JSON reports."""

from __future__ import annotations

import sys

import pytest

from rollout.bench.plots import bench_figure, require_matplotlib, weight_sync_figure
from rollout.bench.run import run_bench
from rollout.errors import InvalidConfigError
from tests.support.bench import bench_config
from tests.support.fakes import FakePool

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("baseline", [True, False])
async def test_bench_figure_from_a_report(tmp_path, baseline):
    cfg = bench_config("bench.rounds=4", "bench.warmup_prompts=2", f"bench.baseline={str(baseline).lower()}")
    report = await run_bench(cfg, "tiny", progress=False, pool=FakePool(2))
    path = tmp_path / "bench.png"
    bench_figure(report, str(path))
    assert path.read_bytes().startswith(PNG)


def test_weight_sync_figure_from_a_report(tmp_path):
    result = {
        "mode": "keep",
        "ratio": 0.97,
        "ratios": [0.95, 0.99],
        "stall_s": {"median": 0.02, "max": 0.05},
        "stalls_s": [0.01, 0.02, 0.05],
    }
    report = {
        "interval_s": 2.0,
        "config": "configs/tiny.yaml",
        "results": [result, {**result, "mode": "drain", "ratio": 0.8}],
    }
    path = tmp_path / "ws.png"
    weight_sync_figure(report, str(path))
    assert path.read_bytes().startswith(PNG)


def test_without_matplotlib_plot_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(InvalidConfigError, match=r"--plot: needs matplotlib .*pip install"):
        require_matplotlib()
