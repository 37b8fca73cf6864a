"""Prometheus metrics of one receiver rank (prometheus_client, a vLLM dependency).

Each `Receiver` owns a `ReceiverMetrics` with its own registry (so several receivers in one
process, e.g. unit tests, never collide). The ``dcr_metrics`` RPC returns the text exposition of
every rank (scrape it through ``collective_rpc`` or vLLM's HTTP ``/collective_rpc``); with a
metrics port in the receiver's config (``DCR_METRICS_PORT``, config.py), each worker also serves
``/metrics`` on that port + rank (vLLM's own ``/metrics`` lives in the API server process, not
in the workers).

Metrics: ``dcr_payloads_total{result=staged|duplicate|rejected}``, ``dcr_payload_bytes_total``,
``dcr_applies_total{result=ok|failed}``, ``dcr_elements_written_total``,
``dcr_apply_seconds`` / ``dcr_fetch_seconds`` (histograms), ``dcr_dense_loads_total``,
``dcr_committed_version``, ``dcr_placement_items_total{path=plan|loader}``,
``dcr_placement_fallbacks_total{reason=loader_mode|stale|not_planned}`` (direct-path items that
went through ``load_weights`` instead of the placement plan; placement.py),
``dcr_plan_mismatches_total`` (tensors whose placement changed in a ``dcr_verify_plan``).
"""

from __future__ import annotations

from typing import Any

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


class ReceiverMetrics:
    """Counters and histograms updated by the receiver state machine. With `port` (the base
    port) they are also served over HTTP on port + `rank` at `addr` (0.0.0.0: reachable by a
    remote Prometheus)."""

    def __init__(self, rank: int = 0, *, port: int | None = None, addr: str = "127.0.0.1") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.payloads = Counter(
            "dcr_payloads", "Payloads offered to dcr_stage", ["result"], registry=r
        )
        self.payload_bytes = Counter(
            "dcr_payload_bytes", "Bytes of payloads offered to dcr_stage", registry=r
        )
        self.applies = Counter("dcr_applies", "dcr_apply calls", ["result"], registry=r)
        self.elements = Counter(
            "dcr_elements_written", "Elements written in place by dcr_apply", registry=r
        )
        self.apply_seconds = Histogram(
            "dcr_apply_seconds", "dcr_apply wall time", buckets=_BUCKETS, registry=r
        )
        self.fetch_seconds = Histogram(
            "dcr_fetch_seconds", "dcr_fetch wall time", buckets=_BUCKETS, registry=r
        )
        self.placement_items = Counter(
            "dcr_placement_items",
            "Items applied, by path: plan (replayed placement) or loader (load_weights)",
            ["path"],
            registry=r,
        )
        self.fallbacks = Counter(
            "dcr_placement_fallbacks",
            "Direct-path items applied through load_weights instead of the placement plan",
            ["reason"],
            registry=r,
        )
        self.plan_mismatches = Counter(
            "dcr_plan_mismatches",
            "Tensors whose placement differed in a dcr_verify_plan re-trace",
            registry=r,
        )
        self.dense_loads = Counter("dcr_dense_loads", "dcr_dense_load calls", registry=r)
        self.committed = Gauge("dcr_committed_version", "Committed policy version", registry=r)
        self.server_port: int | None = None
        if port is not None:
            from prometheus_client import start_http_server

            self.server_port = int(port) + int(rank)
            start_http_server(self.server_port, addr=addr, registry=r)

    def staged(self, result: dict[str, Any], nbytes: int) -> None:
        self.payloads.labels("staged").inc(len(result.get("staged", [])))
        self.payloads.labels("duplicate").inc(len(result.get("duplicates", [])))
        self.payloads.labels("rejected").inc(len(result.get("rejected", [])))
        self.payload_bytes.inc(nbytes)

    def applied(self, ack: dict[str, Any], seconds: float) -> None:
        self.applies.labels("ok" if ack.get("ok") else "failed").inc()
        self.elements.inc(int(ack.get("elements_written", 0)))
        self.apply_seconds.observe(seconds)

    def placed(self, tally: Any) -> None:
        """Count an apply's items by placement path and its fall backs by reason (ack.Tally)."""
        self.placement_items.labels("plan").inc(tally.plan_items)
        self.placement_items.labels("loader").inc(tally.loader_items)
        for why, n in tally.fallbacks.items():
            self.fallbacks.labels(why).inc(n)

    def text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


def process_memory(reset_peak: bool = False) -> dict[str, int | None]:
    """Resident and peak resident set size of this process (Linux /proc: ``rss_bytes``,
    ``peak_rss_bytes``; None where unavailable); with `reset_peak` the peak is reset to the
    current RSS first (for peak-delta measurements)."""
    if reset_peak:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
    fields: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    fields[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return {"rss_bytes": fields.get("VmRSS"), "peak_rss_bytes": fields.get("VmHWM")}
