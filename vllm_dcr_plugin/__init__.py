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

`register` lives in vllm_dcr_plugin.plugin. The extension class is imported lazily, so loading the plugin in a process that does not serve
DCR does not enable DCR there.
"""

from __future__ import annotations

from typing import Any

from vllm_dcr_plugin.plugin import PLUGIN_VERSION, register, registration_count


def __getattr__(name: str) -> Any:
    if name == "DCRWorkerExtension":
        from vllm_dcr_plugin.extension import DCRWorkerExtension

        return DCRWorkerExtension
    raise AttributeError(f"module 'vllm_dcr_plugin' has no attribute {name!r}")


__all__ = ["DCRWorkerExtension", "PLUGIN_VERSION", "register", "registration_count"]
