"""The general plugin's entry point: `register`, called by vLLM in every process (API server,
engine core, workers), possibly several times; re-entrant and cheap after the first call. It
installs DCR's patches of vLLM internals (all listed in vllm_dcr_plugin.patches) and registers
the weight-transfer backend ``dcr`` (vllm_dcr_plugin.transfer). The package re-exports it, so
the entry point is ``vllm_dcr_plugin:register``.

Limitations:
1. A patch or the backend registration that fails is logged and left out: a plugin must never
   take the engine down at import (``dcr_info`` reports the patches that are active).
"""

from __future__ import annotations

import logging

PLUGIN_VERSION = "0.1.0"

logger = logging.getLogger("vllm_dcr_plugin")
_registered = {"count": 0}


def register() -> None:
    """vLLM general-plugin entry point (re-entrant; cheap after the first call)."""
    _registered["count"] += 1
    if _registered["count"] > 1:
        return
    try:  # each patch that fails is logged and left out (patches.install_all)
        from vllm_dcr_plugin import patches

        patches.install_all()
    except Exception:  # a plugin must never take the engine down at import
        logger.exception("DCR plugin: vLLM patches not installed")
    try:
        from vllm_dcr_plugin.transfer import register_backends

        register_backends()
    except Exception:
        logger.exception("DCR plugin: weight-transfer backend 'dcr' not registered")


def registration_count() -> int:
    """How many times vLLM called register() in this process (tests use it)."""
    return _registered["count"]
