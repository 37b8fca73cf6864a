"""The endpoint plugin's metrics merge (pure unit test, no engine: tests/integration/test_coordinator.py reads
/dcr/status and /dcr/metrics from real `vllm serve` engines): every rank's samples in one valid
exposition, one family per metric, each sample labelled with its rank."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from vllm_dcr_plugin.endpoint import DCREndpoints, merge_metrics
from vllm_dcr_plugin.metrics import ReceiverMetrics


def test_merge_labels_every_sample_with_its_rank() -> None:
    ranks = [ReceiverMetrics(0), ReceiverMetrics(1)]
    for r, m in enumerate(ranks):
        m.committed.set(7)
        m.applied({"ok": True, "elements_written": 10 * (r + 1)}, 0.2)
    ranks[1].applied({"ok": False, "elements_written": 3}, 0.02)
    text = merge_metrics([(r, m.text()) for r, m in enumerate(ranks)])
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert text.count("# TYPE dcr_committed_version gauge") == 1

    def value(family: str, sample: str, **labels: str) -> float:
        (v,) = [
            s.value for s in families[family].samples if s.name == sample and s.labels == labels
        ]
        return v

    assert value("dcr_committed_version", "dcr_committed_version", rank="0") == 7
    assert value("dcr_committed_version", "dcr_committed_version", rank="1") == 7
    assert value("dcr_elements_written", "dcr_elements_written_total", rank="1") == 23
    assert value("dcr_applies", "dcr_applies_total", rank="1", result="failed") == 1
    assert value("dcr_apply_seconds", "dcr_apply_seconds_count", rank="0") == 1


def test_plugin_matches_vllm_endpoint_protocol() -> None:
    from vllm.plugins.endpoint_plugins.interface import EndpointPlugin

    assert isinstance(DCREndpoints(), EndpointPlugin)
