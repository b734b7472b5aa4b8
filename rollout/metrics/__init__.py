"""Figures of a running engine: `engine.metrics()` (`live`), Prometheus (`prometheus`), speculative
decoding (`specdecode`), what each name means (`names`).
"""

from rollout.metrics.live import EngineMetrics, MetricsWindow
from rollout.metrics.prometheus import Collector, PrometheusExporter
from rollout.metrics.specdecode import SpecDecodeMeter, SpecDecodeReport

__all__ = ["Collector", "EngineMetrics", "MetricsWindow", "PrometheusExporter", "SpecDecodeMeter", "SpecDecodeReport"]
