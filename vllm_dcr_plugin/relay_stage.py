"""Connect a relay-tree node to the receivers of its rollout node.

`stage_deliver(client)` returns a `RelayNode` ``deliver`` callback that stages every payload the
node receives on the local engine's workers (``dcr_stage`` through `DCRClient`), so payloads are
validated and held compressed while they stream down the tree; the orchestrator applies them
once the tree reports the attempt complete.

Limitations:
1. The callback calls ``collective_rpc`` from the relay thread: the orchestrator must not use the
   same ``LLM`` concurrently (synchronous RL waits for the tree's completion acknowledgement; an
   asynchronous engine should stage through its own event loop instead).
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_dcr_plugin.client import DCRClient


def stage_deliver(client: DCRClient) -> Callable[[bytes], None]:
    """A deliver callback that stages each payload on every local rank (raises on rejection,
    which the relay node reports as a refused payload)."""

    def deliver(payload: bytes) -> None:
        client.stage([payload])

    return deliver
