"""Join the chat model's wheel from the parts `make gpu-carry` cut (benchmarks/gpu/carry.py) and
install it into the check's site folder; says what is missing instead when a part has not
travelled yet. Usage: python3 join_parts.py PARTS_DIR SITE_DIR"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def joined(folder: Path) -> tuple[str, bytes]:
    """(the file's name, its bytes) from the parts in `folder`; ValueError says what is wrong."""
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        raise ValueError(f"no {manifest}: the chat model is not staged")
    spec = json.loads(manifest.read_text())
    missing = [p for p in spec["parts"] if not (folder / p).is_file()]
    if missing:
        raise ValueError(f"{', '.join(missing)} not here yet: carry each part in a call of its own")
    data = b"".join((folder / p).read_bytes() for p in spec["parts"])
    if hashlib.sha256(data).hexdigest() != spec["sha256"]:
        raise ValueError("the joined file's sha256 differs from the manifest's")
    return spec["wheel"], data


def main(parts_dir: str, site: str) -> int:
    try:
        name, data = joined(Path(parts_dir))
    except ValueError as e:
        print(f"join_parts: {e}")
        return 1
    with tempfile.TemporaryDirectory() as d:
        wheel = Path(d) / name
        wheel.write_bytes(data)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", site, str(wheel)], check=True)
    print(f"join_parts: {name} installed into {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
