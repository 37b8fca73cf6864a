"""GPU lane, owner side (a check program, not a test): the real `DCRHook` on a megatron-core GPT
model on one device, checked bit for bit.

One rank, world size 1 on loopback (``env://``). ``--device cuda`` initializes
``torch.distributed`` with NCCL alone, as a default Megatron job does (no CPU backend on the
world), and does NOT enable megatron_dcr_hooks.cpu_compat; ``--device cpu`` runs the same
program with gloo and cpu_compat, so the code path is proven on a machine without a GPU.
megatron-core's ``parallel_state`` at TP=PP=1; a tiny GPT model of a `dcr_tools.fixtures` kind
(default ``qwen3``) built by `dcr_tools.trainers.model` (on CUDA with megatron's GPU
initialization, then moved there), loaded from the fixture's weights through the bridge, and
Megatron DDP + Megatron Adam (`dcr_tools.trainers.trainer.Trainer`). Two hooks in mode X on the
same chunks, both with the baseline streamed in `--chunk-bytes` chunks:

- ``device``: the hook as a job gets it (`enable_dcr`, the optimizer step wrapped). On CUDA the
  product chooses detection by where the parameter lives: `DeviceScan` on the GPU;
- ``host``: a second hook, built by hand after each step, whose scan copies each shard to the
  host and runs the compiled scan there (the host detection path; `HostPathScan`).

On CPU both parameters and trackers are host tensors, so the product takes its compiled host
scan for both hooks; there the program routes every scan through the hook's scan object instead
(the unit tests do the same: tests/unit/megatron/test_hook_units.py), so the streamed scan runs
on host tensors against the host path. On CUDA nothing is patched.

Checks (each a boolean under ``checks`` in the JSON; exit status 1 when any is false):

1. ``params_on_device``: every parameter of the model chunks lives on the device;
2. ``v{k}_records_give_export``: for each of two real optimizer steps, the device hook's
   records applied to the bridge's export before the step give the export after it, bit for
   bit (every tensor; exports are compared on the host);
3. ``v{k}_payload_bytes_equal``: the two hooks' payload bytes are equal, step by step;
4. ``device_scan_ran`` / ``host_path_ran``: every detection of the device hook ran the streamed
   scan on ``--device`` and the host hook's ran the host path;
5. ``host_group_*``: DCR's CPU reductions run on a group that takes CPU tensors
   (``hook.groups.host``). On CUDA: the world group takes no CPU tensors (NCCL) and the host
   group is a separate gloo group over the same ranks (a CPU tensor reduced over the NCCL world
   would have raised); on CPU: the gloo world itself.

Limitations:
1. One rank: no TP/PP/EP gathers cross a process (the owner suite covers layouts on gloo).
2. A tiny model (about 0.2M parameters): this checks paths and bits, not speed
   (dcr_tools/bench/device.py times detection).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shared_codec.scan import DeviceScan, changed_bits


class CountingScan(DeviceScan):
    """The hook's streamed scan (`DeviceScan`), counting its calls and the shards' devices."""

    def __init__(self, chunk_bytes: int) -> None:
        super().__init__(chunk_bytes)
        self.calls = 0
        self.devices: set[str] = set()

    def __call__(
        self, shard: torch.Tensor, tracker: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self.calls += 1
        self.devices.add(shard.device.type)
        return super().__call__(shard, tracker)


class HostPathScan(CountingScan):
    """The host detection path in a scan's place: the shard copied to the host, then the
    compiled scan against the tracker (what detection did before `DeviceScan`)."""

    def __call__(
        self, shard: torch.Tensor, tracker: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self.calls += 1
        self.devices.add(shard.device.type)
        return changed_bits(shard.detach().to("cpu"), tracker)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init(device: str) -> None:
    """World size 1 on loopback: NCCL alone on CUDA, gloo (+ cpu_compat) on CPU."""
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    )
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    # one rank on loopback: the bootstrap sockets need no other interface (a VM may resolve
    # its host name to none)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if device == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method="env://", rank=0, world_size=1)
    else:
        from megatron_dcr_hooks import cpu_compat

        cpu_compat.enable()
        dist.init_process_group("gloo", init_method="env://", rank=0, world_size=1)


def _route_scans_through_the_hooks() -> None:
    """CPU only (module docstring): every detection with a scan object uses it."""
    from megatron_dcr_hooks import detection, hook

    original = detection.changed_bits

    def routed(shard: torch.Tensor, tracker: torch.Tensor, scan: Any = None) -> Any:
        return scan(shard, tracker) if scan is not None else original(shard, tracker)

    detection.changed_bits = routed  # type: ignore[assignment]  # shard_state (the guard)
    hook.changed_bits = routed  # type: ignore[assignment]  # the build's scan


def _host_export(model: list[Any], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    from megatron_dcr_hooks.conversion import export_hf_weights

    return {k: v.detach().to("cpu") for k, v in export_hf_weights(model, cfg).items()}


def run(device: str, kind: str, chunk_bytes: int, steps: int) -> dict[str, Any]:
    """Run the program (module docstring); returns the JSON-able result."""
    t_start = time.perf_counter()
    _init(device)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from dcr_tools.fixtures import hf_config, make_weights, spec_for
    from dcr_tools.trainers.model import ParallelLayout, build_gpt_chunks
    from dcr_tools.trainers.trainer import Trainer
    from megatron_dcr_hooks.bridge_registry import architecture_of
    from megatron_dcr_hooks.conversion import hf_getter, load_hf_weights
    from megatron_dcr_hooks.groups import takes_host_tensors
    from megatron_dcr_hooks.hook import DCRConfig, DCRHook, enable_dcr
    from shared_codec.checkpoint import bits_equal
    from shared_codec.decode import decode_payload
    from shared_codec.records import apply_items

    layout = ParallelLayout(tp=1, pp=1)
    layout.initialize()
    model_parallel_cuda_manual_seed(1234)
    spec = spec_for(kind)
    cfg = hf_config(spec)
    overrides = {"use_cpu_initialization": False} if device == "cuda" else {}
    model = build_gpt_chunks(cfg, layout, **overrides)
    if device == "cuda":
        model = [c.cuda(torch.cuda.current_device()) for c in model]
    load_hf_weights(model, cfg, hf_getter(make_weights(spec, seed=0)))
    trainer = Trainer(model, cfg, distributed_optimizer=False, lr=3e-4)
    t_built = time.perf_counter()

    if device == "cpu":
        _route_scans_through_the_hooks()
    common: dict[str, Any] = {
        "architecture": architecture_of(cfg),
        "bucket_bytes": 4096,
        "hf_config": cfg,
        "detect_chunk_bytes": chunk_bytes,
    }
    hooks = {
        "device": enable_dcr(trainer.chunks, trainer.opt, DCRConfig(mode="X", **common)),
        "host": DCRHook(trainer.chunks, DCRConfig(mode="X", wrap_step=False, **common)),
    }
    scans = {"device": CountingScan(chunk_bytes), "host": HostPathScan(chunk_bytes)}
    for name, h in hooks.items():
        h.scan = scans[name]
        h.guard.device_scan = scans[name]

    checks: dict[str, bool] = {}
    params = [p for c in trainer.chunks for p in c.parameters()]
    checks["params_on_device"] = all(p.device.type == device for p in params)
    steps_out: list[dict[str, Any]] = []
    before = _host_export(model, cfg)
    for step in range(steps):
        version = step + 1
        t0 = time.perf_counter()
        loss, grad_norm = trainer.step(step)  # the wrapped step builds the device hook's delta
        rep_dev = hooks["device"].last_report
        assert rep_dev is not None and rep_dev.version == version, rep_dev
        rep_host = hooks["host"].build(version, 0)
        after = _host_export(model, cfg)
        payloads = {name: list(h.payloads) for name, h in hooks.items()}
        items = [it for p in payloads["device"] for it in decode_payload(p).items]
        state = {k: v.clone() for k, v in before.items()}
        apply_items(state, items)
        bad = [n for n in after if not bits_equal(state[n], after[n])]
        changed = sum(int((before[n].view(torch.int16) != after[n].view(torch.int16)).sum())
                      for n in after if before[n].element_size() == 2)  # fmt: skip
        checks[f"v{version}_records_give_export"] = not bad and changed > 0
        checks[f"v{version}_payload_bytes_equal"] = payloads["device"] == payloads["host"]
        steps_out.append(
            {
                "version": version,
                "loss": loss,
                "grad_norm": grad_norm,
                "seconds": time.perf_counter() - t0,
                "canonical_changed_elements": changed,
                "entries": sum(it.count for it in items),
                "payloads": len(payloads["device"]),
                "payload_bytes": sum(len(p) for p in payloads["device"]),
                "mismatched_tensors": bad,
                "detect_seconds": {
                    "device": rep_dev.detect_seconds,
                    "host": rep_host.detect_seconds,
                },
                "element_change_rate": rep_dev.element_change_rate,
            }
        )
        for h in hooks.values():
            h.payloads.clear()
            h.commit()  # the candidate guard scans again, through the same scan
        before = after
    checks["device_scan_ran"] = scans["device"].calls > 0 and scans["device"].devices == {device}
    checks["host_path_ran"] = scans["host"].calls > 0 and scans["host"].devices == {device}

    groups = hooks["device"].groups
    host = groups.cpu_world
    world_takes_cpu = takes_host_tensors(groups.world.group)
    host_is_world = host is groups.world
    host_takes_cpu = takes_host_tensors(host.group)
    host_info: dict[str, Any] = {
        "world_backend": _backend(groups.world.group),
        "world_takes_cpu": world_takes_cpu,
        "host_group": type(host.group).__name__,
        "host_backend": _backend(host.group),
        "host_is_world": host_is_world,
        "host_takes_cpu": host_takes_cpu,
        "host_size": host.size,
        "world_size": groups.world.size,
    }
    checks["host_group_takes_cpu"] = host_takes_cpu and host.size == groups.world.size
    if device == "cuda":  # an NCCL world: DCR made its own gloo group over the same ranks
        checks["host_group_apart_from_nccl_world"] = (
            not world_takes_cpu and not host_is_world and "gloo" in host_info["host_backend"]
        )
    else:
        checks["host_group_is_gloo_world"] = world_takes_cpu and host_is_world

    result = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "megatron_core": _version("megatron-core"),
        "megatron_bridge": _version("megatron-bridge"),
        "kind": kind,
        "model_parameters": sum(p.numel() for p in params),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "chunk_bytes": chunk_bytes,
        "scans": {n: {"calls": s.calls, "devices": sorted(s.devices)} for n, s in scans.items()},
        "groups": host_info,
        "steps": steps_out,
        "seconds": {"setup": t_built - t_start, "total": time.perf_counter() - t_start},
        "checks": checks,
        "ok": all(checks.values()),
    }
    dist.barrier()
    dist.destroy_process_group()
    return result


def _backend(group: Any) -> str:
    """The backend name of `group` ("nccl", "gloo", ...; a bare gloo group made outside torch's
    registry answers with its class)."""
    if isinstance(group, dist.ProcessGroupGloo):
        return "gloo"
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return type(group).__name__


def _version(dist_name: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def render(res: dict[str, Any]) -> str:
    lines = [
        f"GPU lane, owner side on {res['device']} (torch {res['torch']}, megatron-core "
        f"{res['megatron_core']}, megatron-bridge {res['megatron_bridge']}): {res['kind']}, "
        f"{res['model_parameters']} parameters, TP={res['tp']} PP={res['pp']}, world backend "
        f"{res['groups']['world_backend']}, DCR host group {res['groups']['host_backend']} "
        f"({'the world' if res['groups']['host_is_world'] else 'its own'})",
    ]
    for s in res["steps"]:
        lines.append(
            f"  v{s['version']}: loss {s['loss']:.4f}, {s['canonical_changed_elements']} canonical "
            f"elements changed, {s['entries']} entries in {s['payloads']} payloads "
            f"({s['payload_bytes']} B); detect {s['detect_seconds']['device'] * 1e3:.1f} ms "
            f"(device hook) / {s['detect_seconds']['host'] * 1e3:.1f} ms (host path)"
        )
    for name, ok in res["checks"].items():
        lines.append(f"  [{'ok' if ok else 'FAIL'}] {name}")
    lines.append(f"  {'all checks passed' if res['ok'] else 'CHECKS FAILED'} "
                 f"in {res['seconds']['total']:.1f} s")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--kind", default="qwen3", help="dcr_tools.fixtures kind (default qwen3)")
    ap.add_argument(
        "--chunk-bytes",
        type=int,
        default=4096,
        help="DeviceScan chunk (small, so every tensor streams in several chunks)",
    )
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json", default="out/gpu_lane/owner.json")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("[gpu-owner] no CUDA device (torch.cuda.is_available() is False): not run")
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    res = run(args.device, args.kind, args.chunk_bytes, args.steps)
    print(render(res))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"[gpu-owner] wrote {out}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
