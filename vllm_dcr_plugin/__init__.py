"""vllm_dcr_plugin: the receiver side of DCR, as a vLLM general plugin plus a worker extension.

- ``register()`` is the ``vllm.general_plugins`` entry point. vLLM calls it in every process
  (API server, engine core, workers), possibly several times; it is re-entrant. It installs
  DCR's patches of vLLM internals, all listed in vllm_dcr_plugin.patches: the conditional CPU
  loader condition (cpu_compat), the post-load derived-tensor tracing (derived) and the worker
  glue (worker: pause tracking, the shared receiver); and it registers the weight-transfer
  backend ``dcr`` with vLLM's worker and trainer factories (vllm_dcr_plugin.transfer).
- Front door 1: ``DCRWorkerExtension`` is what ``vllm serve --worker-extension-cls
  vllm_dcr_plugin.DCRWorkerExtension`` (or ``LLM(worker_extension_cls=...)``) mixes into each
  worker; its ``dcr_``-prefixed methods are called with ``collective_rpc``.
- Front door 2: ``vllm serve --weight-transfer-config '{"backend": "dcr"}'`` and vLLM's own
  weight-transfer clients (vllm_dcr_plugin.transfer). Both doors drive the same receiver.

The extension class is imported lazily, so loading the plugin in a process that does not serve
DCR does not enable DCR there.
"""

from __future__ import annotations

import logging
from typing import Any

PLUGIN_VERSION = "0.1.0"

logger = logging.getLogger(__name__)
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


def __getattr__(name: str) -> Any:
    if name == "DCRWorkerExtension":
        from vllm_dcr_plugin.extension import DCRWorkerExtension

        return DCRWorkerExtension
    raise AttributeError(f"module 'vllm_dcr_plugin' has no attribute {name!r}")


__all__ = ["DCRWorkerExtension", "PLUGIN_VERSION", "register", "registration_count"]
