"""``dcr replica``: the canonical replica's store from the command line (docs/replica.md).

- ``dcr replica bootstrap ROOT CHECKPOINT [--version N]``: copy the rollout cluster's initial
  checkpoint into both slots of a new replica root (idempotent for the same checkpoint; a root
  holding another one is refused).
- ``dcr replica status ROOT [--json]``: what ``STATE.json`` records (committed version and
  slot, what each slot holds), read without the writer lock, so also while a replica runs.
- ``dcr replica serve ROOT --source SPEC [--fanout RELAY] [--host H] [--port P] [--key HEX]``:
  the replica's HTTP service (shared_codec/replica/service.py): a required receiver of every
  transition for a coordinator's `HttpReplica`, and the committed checkpoints with range reads
  for restores and joins; with ``--fanout`` also the cluster's one fetcher (fanout.py). Prints
  ``{"url", "root"}`` as one JSON line once it listens.
"""

from __future__ import annotations

import argparse
import json
import sys


def build_parser(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="replica_command", metavar="ACTION")
    b = sub.add_parser("bootstrap", help="copy the initial checkpoint into a new replica root")
    b.add_argument("root", help="replica root directory (created)")
    b.add_argument("checkpoint", help="the rollout cluster's initial checkpoint directory")
    b.add_argument("--version", type=int, default=0, help="its policy version (default 0)")
    b.add_argument("--json", action="store_true", help="print the status as JSON")
    b.set_defaults(func=cmd_bootstrap)
    s = sub.add_parser("status", help="what the replica's STATE.json records")
    s.add_argument("root", help="replica root directory")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=cmd_status)
    v = sub.add_parser("serve", help="serve the replica over HTTP (receiver + checkpoints)")
    v.add_argument("root", help="a bootstrapped replica root directory")
    v.add_argument("--source", required=True, help="payload source spec (JSON: dir, s3, spool)")
    v.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback)")
    v.add_argument("--port", type=int, default=0, help="port (default: any free one)")
    v.add_argument("--key", default="", help="hex payload secret for keyed payloads")
    v.add_argument("--name", default="replica", help="its name in commit records")
    v.add_argument(
        "--fanout", default="",
        help="relay tree root spec (JSON, kind relay): forward every payload read from the "
        "source down the cluster's tree (read once per cluster)",
    )  # fmt: skip
    v.add_argument(
        "--lease-timeout", type=float, default=30.0,
        help="seconds a stage waits for readers of the slot it must write",
    )  # fmt: skip
    v.set_defaults(func=cmd_serve)

    def usage(_args: argparse.Namespace) -> int:
        p.print_help()
        return 2

    p.set_defaults(func=usage)


def _print(status: object, as_json: bool) -> None:
    from shared_codec.replica import ReplicaStatus

    assert isinstance(status, ReplicaStatus)
    if as_json:
        print(json.dumps(status.to_json(), indent=2))
        return
    print(f"root        {status.root}")
    print(f"committed   version {status.committed} in slot{status.committed_slot} "
          f"(attempt {status.committed_attempt})")  # fmt: skip
    print(f"bootstrap   version {status.bootstrap_version} from {status.bootstrap_source}")
    for i, s in enumerate(status.slots):
        extra = (
            ""
            if s.target is None
            else f" -> {s.target} (attempt {s.attempt}, touched {list(s.touched)})"
        )
        print(f"slot{i}       {s.status.value} {s.version}{extra}")


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from shared_codec.errors import DCRError
    from shared_codec.replica import ReplicaStore

    try:
        with ReplicaStore(args.root) as store:
            status = store.bootstrap(args.checkpoint, version=args.version)
    except DCRError as e:
        print(f"dcr replica bootstrap: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    _print(status, args.json)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from shared_codec.errors import DCRError
    from shared_codec.replica import read_status

    try:
        status = read_status(args.root)
    except DCRError as e:
        print(f"dcr replica status: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if status is None:
        print(
            f"dcr replica status: {args.root} holds no replica (not bootstrapped)", file=sys.stderr
        )
        return 1
    _print(status, args.json)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from shared_codec.errors import DCRError
    from shared_codec.replica.receiver import ReplicaReceiver
    from shared_codec.replica.service import serve

    try:
        receiver = ReplicaReceiver(
            args.root, args.source, name=args.name,
            key=bytes.fromhex(args.key) if args.key else None,
            lease_timeout_s=args.lease_timeout, fanout=args.fanout or None,
        )  # fmt: skip
    except (DCRError, ValueError, TypeError) as e:
        print(f"dcr replica serve: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    serve(receiver, args.host, args.port)
    return 0
