"""Reading ``/metrics`` in tests: Prometheus' text format parsed with prometheus_client's parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample as ``{(name, frozenset(labels.items())): value}``."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    """The one sample called ``name`` whose labels include ``labels`` (0 when absent)."""
    want = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    assert len(found) <= 1, f"{name}{labels} is ambiguous: {found}"
    return found[0] if found else 0.0


def delta(after: dict, before: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)
