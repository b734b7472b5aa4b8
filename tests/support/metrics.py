"""What the Prometheus exporter (`metrics.port`) serves, read as a dashboard would."""

from __future__ import annotations

import urllib.request


def scrape(url: str) -> dict[str, float]:
    """Every sample at `url`: its name with labels -> its value."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
