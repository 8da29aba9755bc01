"""Prometheus figures of the model host: which models are loaded, loads and unloads."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxcel.daemon.hosting.host import ModelHost


class HostCollector:
    """Prometheus: which models are loaded (with their weights) and the load/unload counts."""

    def __init__(self, host: ModelHost) -> None:
        self._host = host

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        host = self._host
        loaded = GaugeMetricFamily(
            "mlxcel_model_loaded", "1 for each model held in memory.", labels=["model"]
        )
        weights = GaugeMetricFamily(
            "mlxcel_model_weights_bytes", "Weights of each loaded model.", labels=["model"]
        )
        for resident in list(host.resident.values()):
            loaded.add_metric([resident.key], 1)
            weights.add_metric([resident.key], resident.loaded.info.weights_bytes)
        yield loaded
        yield weights
        yield GaugeMetricFamily(
            "mlxcel_models_loaded", "Models held in memory.", value=len(host.resident)
        )
        c = host.counters
        yield CounterMetricFamily("mlxcel_model_loads", "Models loaded.", value=c.loads)
        yield CounterMetricFamily("mlxcel_model_unloads", "Models unloaded.", value=c.unloads)
        yield CounterMetricFamily(
            "mlxcel_model_load_failures", "Model loads that failed.", value=c.load_failures
        )
        yield CounterMetricFamily(
            "mlxcel_model_load_seconds", "Time spent loading models.", value=c.load_seconds
        )
