"""A mixture split's stats (stats.py) as GetStats and /metrics show them."""

from __future__ import annotations

from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from queue_client.wire import batchqueue_pb2 as pb


def mixture_proto(stats: dict[str, Any] | None) -> pb.MixtureStats | None:
    if stats is None:
        return None
    return pb.MixtureStats(
        sources=[pb.MixtureSourceStats(**s) for s in stats["sources"]],
        rows_served=stats["rows_served"],
        window_rows=stats["window_rows"],
        history=[pb.MixtureWeightChange(**h) for h in stats["history"]],
    )


def mixture_families(labels: list[str]) -> dict[str, Any]:
    """One family per per-source figure, labelled by dataset, split and source."""
    by_source = [*labels, "source"]
    return {
        "rows_served": CounterMetricFamily(
            "batchqueue_mixture_rows", "Rows of each source in consumed files", labels=by_source
        ),
        "tokens_served": CounterMetricFamily(
            "batchqueue_mixture_tokens", "Tokens of each source in consumed files", labels=by_source
        ),
        "weight": GaugeMetricFamily(
            "batchqueue_mixture_weight", "Each source's weight now (sum 1)", labels=by_source
        ),
        "share": GaugeMetricFamily(
            "batchqueue_mixture_share", "Each source's share of the rows served", labels=by_source
        ),
        "target_share": GaugeMetricFamily(
            "batchqueue_mixture_target_share",
            "The share of the rows served that each source's weights targeted",
            labels=by_source,
        ),
        "window_share": GaugeMetricFamily(
            "batchqueue_mixture_window_share",
            "Each source's share of the last 10,000 rows served",
            labels=by_source,
        ),
        "epochs": GaugeMetricFamily(
            "batchqueue_mixture_epochs", "Epochs of each source's own data served", labels=by_source
        ),
    }


def add_mixture_metrics(
    families: dict[str, Any], key: list[str], stats: dict[str, Any] | None
) -> None:
    if stats is None:
        return
    for source in stats["sources"]:
        for attr, family in families.items():
            if source.get(attr) is not None:
                family.add_metric([*key, source["name"]], float(source[attr]))
