"""docs/DESIGN.md, Layout: imports flow downward, and the scheduler, the KV bookkeeping and the cost
model stay torch-free, so the simulator runs fast and never needs a model.

Every import counts, top-level or inside a function: a lazy import still ties the layers."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tokenslice"

BASE = {"config", "request", "plan", "clock", "delivery"}  # tokenslice/<name>.py: plain data, import each other only

# Mirrors docs/DESIGN.md's "server → engine → sched/kv/predict → model/exec": layer -> lower layers it may import.
ALLOWED: dict[str, set[str]] = {
    "base": set(),
    "kv": {"base"},
    "predict": {"base"},
    "model": {"base"},
    "sched": {"base", "kv", "predict"},
    "exec": {"base", "kv", "predict", "model"},
    "engine": {"base", "sched", "kv", "predict", "model", "exec"},
    "server": {"base", "sched", "kv", "predict", "model", "exec", "engine"},
    "llm": {"base", "sched", "kv", "predict", "model", "exec", "engine"},
    "bench": {"base", "sched", "kv", "predict", "model", "exec", "engine"},
    "sim": {"base", "sched", "kv", "predict", "model", "exec", "engine", "bench"},
    "top": set(),  # cli.py and __init__.py: may import anything
}
TOP = "top"

TORCH_FREE = [PACKAGE / "sched", PACKAGE / "kv"] + [PACKAGE / "predict" / f"{name}.py" for name in
                                                 ("cost", "specs", "roofline", "profile", "fit")]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    """tokenslice.kv.groups -> kv, tokenslice.config -> base, tokenslice (the package) -> the top."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "cli":
        return TOP
    name = parts[1]
    if name in BASE:
        return "base"
    assert name in ALLOWED, f"tokenslice.{name} has no layer: add it to ALLOWED in {Path(__file__).name}"
    return name


def imported_modules(path: Path) -> list[str]:
    """Every module `path` imports, anywhere in the file, relative imports resolved."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            folder = PACKAGE.parent / module.replace(".", "/")
            # `from tokenslice import kv` imports the subpackage kv; other names come from the module
            subs = [a.name for a in node.names
                    if (folder / f"{a.name}.py").exists() or (folder / a.name / "__init__.py").exists()]
            if len(subs) < len(node.names):
                out.append(module)
            out += [f"{module}.{name}" for name in subs]
    return out


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_imports_follow_the_layers() -> None:
    bad = []
    for path in package_files():
        layer = layer_of(module_name(path))
        if layer == TOP:
            continue
        for module in imported_modules(path):
            if module != "tokenslice" and not module.startswith("tokenslice."):
                continue
            target = layer_of(module)
            if target != layer and target not in ALLOWED[layer]:
                bad.append(f"{path.relative_to(ROOT)} ({layer}) imports {module} ({target})")
    if bad:
        pytest.fail("imports against the layering:\n" + "\n".join(bad), pytrace=False)


def test_planning_layers_have_no_torch_import() -> None:
    files = [f for p in TORCH_FREE for f in ([p] if p.is_file() else sorted(p.rglob("*.py")))]
    assert files
    bad = [f"{f.relative_to(ROOT)} imports {m}" for f in files for m in imported_modules(f)
           if m.split(".")[0] == "torch"]
    if bad:
        pytest.fail("torch in a torch-free layer:\n" + "\n".join(bad), pytrace=False)


def _imported_after(modules: list[str], probe: list[str]) -> list[str]:
    code = (f"import sys; import {', '.join(modules)}; "
            f"print(' '.join(m for m in {probe!r} if m in sys.modules))")
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                          cwd=ROOT).stdout.split()


def test_planning_layers_do_not_import_torch() -> None:
    planning = sorted(module_name(f) for d in ("sched", "kv") for f in (PACKAGE / d).glob("*.py"))
    code = ("import sys; import tokenslice.sched.scheduler, tokenslice.sched.mlfq, tokenslice.sched.srpt, "
            "tokenslice.sched.fcfs, tokenslice.kv.manager, tokenslice.kv.groups, tokenslice.predict.cost, "
            f"tokenslice.sim.executor, tokenslice.engine.engine, {', '.join(planning)}; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         cwd=ROOT).stdout.strip()
    assert out == "False"


def test_low_modules_do_not_load_the_engine() -> None:
    loaded = _imported_after(["tokenslice.kv.groups", "tokenslice.kv.manager", "tokenslice.sched.policy",
                              "tokenslice.predict.cost", "tokenslice.predict.roofline", "tokenslice.predict.fit"],
                             ["tokenslice.engine", "tokenslice.llm", "tokenslice.model", "torch"])
    assert loaded == []


def test_public_api_still_imports_from_the_package() -> None:
    code = ("import tokenslice; from tokenslice import *; "
            "print(sorted(n for n in tokenslice.__all__ if getattr(tokenslice, n, None) is None))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         cwd=ROOT).stdout.strip()
    assert out == "[]"
