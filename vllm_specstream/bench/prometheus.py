"""Reading a vLLM server's ``/metrics`` (Prometheus exposition)."""

from __future__ import annotations


def metric(text: str, name: str, **labels) -> float | None:
    """Sum of the samples ``name`` with ``labels`` in a Prometheus exposition, or None."""
    from prometheus_client.parser import text_string_to_metric_families

    values = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return sum(values) if values else None
