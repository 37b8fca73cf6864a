"""Run one relay node process: ``python -m shared_codec.transport.relay CONFIG_JSON``.

Config keys: ``name``, ``bind``, ``children`` ([[name, address, server_public_z85 or null]]),
``deliver_dir`` (the node's spool, see `spool.py`), ``public``/``secret``/``allowed`` (Z85,
optional: CURVE), ``child_timeout_s`` (default 5).

Limitations:
1. The config is one JSON argument (it holds the secret key when CURVE is on: pass it through
   a file the process reads, e.g. ``"$(cat node.json)"``, not a shell history).
"""

from __future__ import annotations

import json
import sys

from shared_codec.transport.relay.node import CurveKeys, RelayNode
from shared_codec.transport.relay.spool import SpoolWriter


def main(argv: list[str] | None = None) -> int:
    cfg = json.loads((argv or sys.argv[1:])[0])
    keys = None
    if cfg.get("secret"):
        keys = CurveKeys(
            cfg["public"].encode(),
            cfg["secret"].encode(),
            tuple(k.encode() for k in cfg.get("allowed", [])),
        )
    spool = SpoolWriter(cfg["deliver_dir"])
    node = RelayNode(
        cfg["name"],
        cfg["bind"],
        children=[(n, a, p.encode() if p else None) for n, a, p in cfg.get("children", [])],
        deliver=spool.deliver,
        on_manifest=spool.on_manifest,
        on_abandon=spool.on_abandon,
        on_forget=spool.forget,
        keys=keys,
        child_timeout_s=float(cfg.get("child_timeout_s", 5.0)),
    )
    node.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
