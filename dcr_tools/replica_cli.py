"""``dcr replica``: the canonical replica's store from the command line (docs/replica.md).

- ``dcr replica bootstrap ROOT CHECKPOINT [--version N]``: copy the rollout cluster's initial
  checkpoint into both slots of a new replica root (idempotent for the same checkpoint; a root
  holding another one is refused).
- ``dcr replica status ROOT [--json]``: what ``STATE.json`` records (committed version and
  slot, what each slot holds), read without the writer lock, so also while a replica runs.

The service (coordinator channel, HTTP range reads, restore and join) is not built yet.
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
