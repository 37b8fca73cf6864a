"""DCR's status and metrics as routes of ``vllm serve`` (a ``vllm.endpoint_plugins`` entry).

Routes (GET), each answering within `TIMEOUT_S`:

- ``/dcr/status``: ``{"ranks": [...]}``, every worker rank's ``dcr_status`` reply (state,
  committed and target version, staged payloads and bytes), and ``"committed_version"`` when
  every rank agrees (None otherwise);
- ``/dcr/metrics``: every rank's DCR Prometheus metrics (vllm_dcr_plugin/metrics.py) in one text
  exposition, each sample labelled ``rank`` (vLLM's own ``/metrics`` lives in the API server
  process; the receivers' counters live in the workers).

Both reach the workers the way vLLM's own handlers do, through the engine client's
``collective_rpc`` with the worker extension's ``dcr_*`` RPCs, so the server needs
``--worker-extension-cls vllm_dcr_plugin.DCRWorkerExtension``. vLLM loads endpoint plugins only
when they are allow-listed: ``VLLM_PLUGINS=dcr`` (the name also allows the general plugin,
which is named ``dcr`` too). A failing RPC answers 503 with the error.

Limitations:
1. Engines reached only through vLLM's weight-transfer API (``--weight-transfer-config`` without
   the worker extension) have no ``dcr_status`` RPC: the routes answer 503 there.
"""

from __future__ import annotations

from typing import Any

TIMEOUT_S = 30.0


def merge_metrics(texts: list[tuple[int, str]]) -> str:
    """One Prometheus text exposition of every rank's (`rank`, exposition) with a ``rank`` label
    on every sample."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    merged: dict[str, Metric] = {}
    for rank, text in texts:
        for family in text_string_to_metric_families(text):
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(family.name, family.documentation, family.type)
            for s in family.samples:
                out.add_sample(s.name, {**s.labels, "rank": str(rank)}, s.value, s.timestamp)

    class _Merged:
        def collect(self) -> Any:
            return list(merged.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())  # type: ignore[arg-type]
    return generate_latest(registry).decode()


class DCREndpoints:
    """The `EndpointPlugin` vLLM instantiates (vllm/plugins/endpoint_plugins/interface.py)."""

    name = "dcr"
    required_tasks = None  # any serving task: the routes only read the receivers

    def __init__(self) -> None:
        self.engine: Any = None

    def attach_router(self, app: Any) -> None:
        from fastapi import APIRouter
        from fastapi.responses import JSONResponse, PlainTextResponse

        router = APIRouter()

        async def rpc(method: str) -> list[dict[str, Any]]:
            if self.engine is None:
                raise RuntimeError("no engine behind this server")
            replies = await self.engine.collective_rpc(method, timeout=TIMEOUT_S)
            bad = [r for r in replies if not (isinstance(r, dict) and r.get("ok"))]
            if bad:
                raise RuntimeError("; ".join(str(r.get("error", r)) for r in bad))
            return list(replies)

        @router.get("/dcr/status")
        async def status() -> Any:
            try:
                ranks = await rpc("dcr_status")
            except Exception as e:  # reported, never raised into the server
                return JSONResponse({"error": f"{type(e).__name__}: {e}"}, status_code=503)
            versions = {r.get("committed_version") for r in ranks}
            committed = versions.pop() if len(versions) == 1 else None
            return JSONResponse({"committed_version": committed, "ranks": ranks})

        @router.get("/dcr/metrics")
        async def metrics() -> Any:
            try:
                ranks = await rpc("dcr_metrics")
            except Exception as e:
                return PlainTextResponse(f"# {type(e).__name__}: {e}\n", status_code=503)
            text = merge_metrics([(int(r["rank"]), str(r["text"])) for r in ranks])
            return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        self.engine = engine_client
