"""ZeroMQ relay tree: owners -> one root in the rollout cluster -> balanced k-ary tree of nodes.

Contract: every payload an owner sends to the root reaches every node exactly once (duplicates
are suppressed by payload id per (version, attempt)) with identical bytes; the manifest's
completion acknowledgement (`RelaySender.complete`) says that every node of the tree holds every
listed payload, or raises naming the dead or slow nodes; an abandon reaches every live node; a
forget (retention) empties every live node's spool and delivered sets of older versions.
A node process (``python -m shared_codec.transport.relay CONFIG_JSON``) spools what it receives
for the engines of its rollout node, which read it with `read_spool` / `stream_spool`.

Modules, one concern each:
- `messages`: the typed wire messages, keyed by (version, attempt), and their validation;
- `node`: `RelayNode` (one tree node), `CurveKeys`, `tree_children`;
- `sender`: `RelaySender` (owners and the coordinator -> root);
- `spool`: the spool directory, written by the node process and read by engines;
- `__main__`: the node process.

Back-pressure: socket high-water marks bound queued messages and `RelaySender` keeps at most
`window` unacknowledged payloads in flight. V_cross accounting: the root counts the payload bytes
it receives from outside the rollout cluster (`RelayNode.bytes_in`); with one root per cluster
this equals V_payload per attempt.

Security: with `CurveKeys` every node is a CURVE server and accepts only clients whose public key
is in its allow-list (ZAP authentication); traffic is encrypted. Keys are provisioned as
described in docs/operations.md.

Limitations:
1. One manifest per message; payloads of several attempts may interleave.
2. Nodes keep delivered payload ids and spools keep payload files until the coordinator's
   retention (`Forget`, `TransportSpec.forget`) tells them to drop older versions.
3. pyzmq is imported when a node serves or a sender connects (the ``zmq`` extra).
"""

from shared_codec.transport.relay.messages import RelayMessageError
from shared_codec.transport.relay.node import CurveKeys, RelayNode, tree_children
from shared_codec.transport.relay.sender import RelaySender
from shared_codec.transport.relay.spool import (
    SpoolWriter,
    read_spool,
    stream_spool,
    wait_manifest,
)

__all__ = [
    "CurveKeys",
    "RelayMessageError",
    "RelayNode",
    "RelaySender",
    "SpoolWriter",
    "read_spool",
    "stream_spool",
    "tree_children",
    "wait_manifest",
]
