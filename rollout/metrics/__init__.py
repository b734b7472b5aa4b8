"""Figures of a running engine: `engine.metrics()` and Prometheus (`figures`), speculative
decoding (`specdecode`).
"""

from rollout.metrics.figures import Collector, EngineMetrics, MetricsWindow, PrometheusExporter
from rollout.metrics.specdecode import SpecDecodeMeter, SpecDecodeReport

__all__ = ["Collector", "EngineMetrics", "MetricsWindow", "PrometheusExporter", "SpecDecodeMeter", "SpecDecodeReport"]
