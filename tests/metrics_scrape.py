"""A running server's /metrics as the tests read it."""

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(base_url: str) -> dict[str, float]:
    """Sample name and labels -> value, summed over all replicas."""
    text = httpx.get(f"{base_url}/metrics").text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                              if k not in ("model_name", "replica"))
            key = f"{sample.name}{{{labels}}}"
            values[key] = values.get(key, 0.0) + sample.value
    return values
