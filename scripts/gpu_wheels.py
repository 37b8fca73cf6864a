"""The GPU lane's Python packages beyond torch: the table, the wheelhouse, the offline install.

A lent device machine has PyTorch with CUDA and no network (docs/benchmarks.md, "GPU lane").
Whatever else the lane imports travels with the run as wheels. `PACKAGES` is the one list:

- ``carry`` rows: downloaded here into the wheelhouse (``make gpu-wheelhouse``: binary wheels
  only, no dependency resolution, manylinux x86_64, every Python version asked for in one
  folder: pure wheels once, compiled ones with their Python tag) and installed there when the
  module is missing;
- ``carry-exact`` rows: the same, also installed when the machine has another version (DCR is
  checked on these megatron-core / megatron-bridge versions only);
- ``image`` rows: expected on the device image, not carried, because they do not fit the 64 MiB
  a run carries (llvmlite's wheel alone is 59.7 MB for CPython 3.12; numpy's 15.7 MB). The
  lent machines' image lists all three; where one is missing, the install names it and fails,
  and the steps that import it fail.

Two commands, standard library only (``install`` runs before anything else is importable):

- ``download --python 3.12 3.11 --dest DIR``: this machine, with network: ``pip download`` of
  every carried row for each version into DIR; prints the sizes and what a device run carries
  with the working tree (refuses past 64 MiB);
- ``install --wheelhouse DIR --target DIR``: the device machine, offline: every row of this
  interpreter's version whose module is missing (or differs, ``carry-exact``) is installed from
  DIR into the target folder (``pip install --no-index --find-links DIR --no-deps --target``, by
  requirement, so pip picks this interpreter's wheel; without pip the wheel is unpacked, which is
  what pip does for these wheels); one line per row; exits 1 naming every module it could not
  provide (a Python version without wheels is named with the wheels it lacks).

Limitations:
1. Rows are pinned to what the trainer environments run (Makefile ``TRAINER_PINS``: Python
   3.12 with megatron-core 0.19.2, megatron-bridge 0.6.2; Python 3.11 with 0.16.1 / 0.3.1; both
   checked with transformers 5.12.1). A machine whose own transformers is present keeps it
   (checked here: 5.17.0 with tokenizers 0.23.2, the device image's, with megatron-bridge 0.6.2).
2. No dependency resolution: the rows are the closure, found by running the lane on
   interpreters that had only torch and the image rows (Python 3.12 with pip, 3.11 without).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

#: (python "3.12" / "3.11" / "any", import module, requirement, source) -- module docstring
PACKAGES: tuple[tuple[str, str, str, str], ...] = (
    ("any", "torch", "torch", "image"),
    ("any", "numpy", "numpy", "image"),
    ("any", "numba", "numba", "image"),
    ("any", "llvmlite", "llvmlite", "image"),
    # the codec
    ("any", "zstandard", "zstandard==0.25.0", "carry"),
    # the owner side: megatron-core, the bridge's conversion modules and what they import
    ("3.12", "megatron.core", "megatron-core==0.19.2", "carry-exact"),
    ("3.12", "megatron.bridge", "megatron-bridge==0.6.2", "carry-exact"),
    ("3.11", "megatron.core", "megatron-core==0.16.1", "carry-exact"),
    ("3.11", "megatron.bridge", "megatron-bridge==0.3.1", "carry-exact"),
    ("any", "transformers", "transformers==5.12.1", "carry"),
    ("any", "tokenizers", "tokenizers==0.22.2", "carry"),
    ("any", "huggingface_hub", "huggingface-hub==1.33.0", "carry"),
    ("any", "httpx", "httpx==0.29.0", "carry"),
    ("any", "httpcore", "httpcore==1.0.9", "carry"),
    ("any", "h11", "h11==0.16.0", "carry"),
    ("any", "anyio", "anyio==4.16.0", "carry"),
    ("any", "idna", "idna==3.21", "carry"),
    ("any", "certifi", "certifi==2026.10.19.post1", "carry"),
    ("any", "safetensors", "safetensors==0.8.0", "carry"),
    ("any", "regex", "regex==2026.12.2", "carry"),
    ("any", "yaml", "pyyaml==6.0.4", "carry"),
    ("any", "tqdm", "tqdm==4.70.1", "carry"),
    ("any", "packaging", "packaging==26.4", "carry"),
    ("any", "rich", "rich==15.0.0", "carry"),
    ("any", "markdown_it", "markdown-it-py==4.3.0", "carry"),
    ("any", "mdurl", "mdurl==0.1.2", "carry"),
    ("any", "pygments", "pygments==2.21.0", "carry"),
    # the receiver (the intercepted apply of the gpu tests): its metrics
    ("any", "prometheus_client", "prometheus-client==0.26.0", "carry"),
    # the gpu tests
    ("any", "pytest", "pytest==9.2.0", "carry"),
    ("any", "iniconfig", "iniconfig==2.3.1", "carry"),
    ("any", "pluggy", "pluggy==1.7.0", "carry"),
    ("any", "pytest_timeout", "pytest-timeout==2.4.0", "carry"),
)

#: pip download's platform tags for manylinux x86_64 (pip matches each exactly)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
)


def rows_for(python: str) -> list[tuple[str, str, str]]:
    """(module, requirement, source) of every row for Python `python` ("3.12")."""
    return [(m, r, s) for p, m, r, s in PACKAGES if p in ("any", python)]


def versions() -> list[str]:
    """The Python versions with rows of their own (megatron-core is pinned per version)."""
    return sorted({p for p, *_ in PACKAGES if p != "any"}, reverse=True)


def _dist(requirement: str) -> tuple[str, str]:
    name, _, version = requirement.partition("==")
    return name, version


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def _compatible(wheel: str, python: str) -> bool:
    """Does wheel file name `wheel` install on CPython `python` ("3.12"), Linux x86_64?"""
    parts = wheel[: -len(".whl")].split("-")
    if len(parts) < 5:
        return False
    py, abi, plat = parts[-3:]
    if not any(p == "any" or ("manylinux" in p and p.endswith("x86_64")) for p in plat.split(".")):
        return False
    want = int(python.replace(".", ""))
    for tag in py.split("."):
        if tag in ("py3", f"py{python.replace('.', '')}") or tag == f"cp{want}":
            return True
        if abi == "abi3" and tag.startswith("cp3") and int(tag[2:]) <= want:
            return True
    return False


def _wheel_for(folder: Path, requirement: str, python: str) -> Path | None:
    """The wheel of `requirement` in `folder` that installs on Python `python`, if any."""
    name, version = _dist(requirement)
    for w in sorted(folder.glob("*.whl")):
        parts = w.name.split("-")
        if _norm(parts[0]) == _norm(name) and parts[1] == version and _compatible(w.name, python):
            return w
    return None


def _carry_budget(wheels: list[Path]) -> tuple[int, int]:
    """(wheelhouse bytes, working-tree bytes: tracked and untracked files git does not
    ignore), the two parts of what a device run carries (64 MiB at most)."""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=False,
        cwd=root,
    ).stdout
    files = [root / f for f in out.decode().split("\0") if f]
    tree = sum(f.stat().st_size for f in files if f.is_file())
    return sum(w.stat().st_size for w in wheels), tree


def download(pythons: list[str], dest: Path) -> int:
    """``pip download`` the carried rows for each of `pythons` into `dest` (one folder: pure
    wheels are shared; compiled ones carry their Python tag); prints the sizes and the carry
    budget, and fails when wheelhouse plus working tree exceed 64 MiB."""
    dest.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PIP_FIND_LINKS"}
    for python in pythons:
        reqs = [r for _, r, s in rows_for(python) if s != "image"]
        if python not in versions():
            print(f"[gpu-wheelhouse] no rows for Python {python} (rows: {versions()})")
            return 1
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        cmd += ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
        cmd += ["--dest", str(dest)]
        for p in PLATFORMS:
            cmd += ["--platform", p]
        rc = subprocess.call(cmd + reqs, env=env)
        if rc:
            return rc
    keep = {
        w
        for python in pythons
        for _, r, s in rows_for(python)
        if s != "image" and (w := _wheel_for(dest, r, python)) is not None
    }
    for w in set(dest.glob("*.whl")) - keep:  # rows gone from the table, versions not asked for
        w.unlink()
    wheels = sorted(dest.glob("*.whl"))
    for w in wheels:
        print(f"[gpu-wheelhouse] {w.stat().st_size / 1e6:7.2f} MB  {w.name}")
    for python in pythons:
        mine = {
            w
            for _, r, s in rows_for(python)
            if s != "image" and (w := _wheel_for(dest, r, python)) is not None
        }
        size = sum(w.stat().st_size for w in mine)
        print(f"[gpu-wheelhouse] Python {python}: {len(mine)} wheels, {size / 2**20:.1f} MiB")
    ours, tree = _carry_budget(wheels)
    total = ours + tree
    print(
        f"[gpu-wheelhouse] {dest}: {len(wheels)} wheels, {ours / 2**20:.1f} MiB; with the "
        f"working tree ({tree / 2**20:.1f} MiB) a run carries {total / 2**20:.1f} of 64 MiB. "
        "Not carried (expected on the device image): "
        + ", ".join(r for _, r, s in rows_for(pythons[0]) if s == "image")
    )
    if total > 64 << 20:
        print("[gpu-wheelhouse] ERROR: over the 64 MiB a device run carries", file=sys.stderr)
        return 1
    return 0


def _installed_version(requirement: str) -> str | None:
    try:
        return importlib.metadata.version(_dist(requirement)[0])
    except importlib.metadata.PackageNotFoundError:
        return None


def _present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def install(wheelhouse: Path, target: Path) -> int:
    """Install the missing rows of this interpreter's version (module docstring)."""
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    rows = rows_for(python)
    print(
        f"[gpu-wheels] Python {sys.version.split()[0]} ({sys.executable}); wheelhouse {wheelhouse}"
    )
    target.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(target))  # a rerun sees what an earlier one installed
    missing: list[str] = []
    if python not in versions():  # the per-version rows: megatron-core, megatron-bridge
        for module, req in sorted({(m, _dist(r)[0]) for p, m, r, _ in PACKAGES if p != "any"}):
            if _present(module):
                print(f"[gpu-wheels] present   {module:<17} {_installed_version(req) or '?'}")
                continue
            print(f"[gpu-wheels] MISSING   {module:<17} no wheel of {req} for Python {python}")
            missing.append(
                f"{module} (no wheel of {req} for Python {python}: scripts/gpu_wheels.py pins "
                f"it for Python {', '.join(versions())} only)"
            )
    todo: list[tuple[str, str, str, Path]] = []
    for module, req, source in rows:
        have = _present(module)
        version = _installed_version(req) if have else None
        pinned = _dist(req)[1]
        if have and not (source == "carry-exact" and version != pinned):
            print(f"[gpu-wheels] present   {module:<17} {version or '?'}")
            continue
        why = "missing" if not have else f"has {version}, needs {pinned}"
        if source == "image":
            print(f"[gpu-wheels] MISSING   {module:<17} expected on the device image, not carried")
            missing.append(f"{module} ({req}: expected on the image, too large to carry)")
            continue
        wheel = _wheel_for(wheelhouse, req, python) if wheelhouse.is_dir() else None
        if wheel is None:
            print(
                f"[gpu-wheels] MISSING   {module:<17} {why}; no wheel of {req} for Python {python}"
            )
            missing.append(f"{module} (no wheel of {req} for Python {python} in {wheelhouse})")
            continue
        todo.append((module, req, why, wheel))
    rc = 0
    if todo:
        pip = (
            subprocess.call(
                [sys.executable, "-m", "pip", "--version"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            == 0
        )
        if pip:  # by requirement: pip picks the wheel of this interpreter from the folder
            env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
            env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_ROOT_USER_ACTION="ignore")
            cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps"]
            cmd += ["--no-compile", "--upgrade", "--find-links", str(wheelhouse)]
            cmd += ["--target", str(target), *(req for _, req, _, _ in todo)]
            rc = subprocess.call(cmd, env=env)
        else:  # what pip does for these wheels (no scripts or data are needed from them)
            for *_, wheel in todo:
                with zipfile.ZipFile(wheel) as z:
                    z.extractall(target)
        how = "pip" if pip else "unpacked, no pip"
        for module, _, why, wheel in todo:
            state = "FAILED   " if rc else "installed"
            print(f"[gpu-wheels] {state} {module:<17} {why}: {wheel.name} ({how})")
        if rc:
            missing += [f"{m} (pip install of {w.name} failed, rc {rc})" for m, _, _, w in todo]
    if missing:
        print("[gpu-wheels] cannot provide: " + "; ".join(missing))
        return 1
    print(f"[gpu-wheels] ready: {len(rows)} modules, {len(todo)} installed into {target}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("download", help="build the wheelhouse (this machine, with network)")
    d.add_argument("--python", nargs="+", default=versions(), help="major.minor versions")
    d.add_argument("--dest", required=True, type=Path)
    i = sub.add_parser("install", help="install the missing rows offline (device machine)")
    i.add_argument("--wheelhouse", required=True, type=Path)
    i.add_argument("--target", required=True, type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "download":
        return download(args.python, args.dest)
    return install(args.wheelhouse, args.target)


if __name__ == "__main__":
    raise SystemExit(main())
