"""The import rules of DESIGN.md section 2 ("Layers"), checked on the source rather than trusted.

torchio may use only ucfs.{store, catalog, config, errors} and never pulls in trio or pyfuse3 (a
training script must not load the daemon's machinery); ucfs never imports torch; boto3 lives in
ucfs/store.py alone and pyfuse3 in ucfs/fs.py and ucfs/mount.py; config and errors import nothing of
ours. Imports inside functions count like the ones at the top of a file.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCHIO_MAY_USE = {"ucfs.store", "ucfs.catalog", "ucfs.config", "ucfs.errors"}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, at any depth. `from . import x` and
    `from pkg import x` give pkg.x, since x may be a module."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def _top(name: str) -> str:
    return name.split(".", 1)[0]


def _ucfs_module(name: str) -> str:
    """ucfs.store.S3Store -> ucfs.store; ucfs.errors -> ucfs.errors."""
    return ".".join(name.split(".")[:2])


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_torchio_imports_only_the_ucfs_modules_the_layers_allow():
    found, used = [], set()
    for path in _sources("torchio"):
        for line, name in _imports(path):
            if _top(name) == "ucfs":
                used.add(_ucfs_module(name))
            where = f"{path.relative_to(ROOT)}:{line} imports {name}"
            if _top(name) in ("trio", "pyfuse3"):
                found.append(where)
            elif _top(name) == "ucfs" and _ucfs_module(name) not in TORCHIO_MAY_USE:
                found.append(where)
    assert found == []
    assert {"ucfs.store", "ucfs.config", "ucfs.errors"} <= used  # the scan sees imports at all depths


def test_importing_torchio_loads_neither_trio_nor_pyfuse3():
    """What the allowed modules import in turn counts too: run in a fresh interpreter, every torchio
    module and every ucfs module torchio may use, then look at what got loaded."""
    modules = sorted({".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                      for p in _sources("torchio")} | TORCHIO_MAY_USE)
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}:\n"
            "    importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout)
    assert "torchio.bench" in loaded  # the check saw what it was meant to
    assert [m for m in loaded if _top(m) in ("trio", "pyfuse3")] == []


def test_ucfs_keeps_torch_out_and_boto3_and_pyfuse3_in_their_modules():
    allowed = {"boto3": {"ucfs/store.py"}, "botocore": {"ucfs/store.py"},
               "pyfuse3": {"ucfs/fs.py", "ucfs/mount.py"}, "torch": set()}
    found, seen = [], set()
    for path in _sources("ucfs"):
        rel = str(path.relative_to(ROOT))
        for line, name in _imports(path):
            seen.add((rel, _top(name)))
            if _top(name) in allowed and rel not in allowed[_top(name)]:
                found.append(f"{rel}:{line} imports {name}")
    assert found == []
    assert {("ucfs/store.py", "boto3"), ("ucfs/fs.py", "pyfuse3")} <= seen


def test_config_and_errors_import_nothing_of_ours():
    found = [f"{p.name}:{line} imports {name}" for p in (ROOT / "ucfs/config.py", ROOT / "ucfs/errors.py")
             for line, name in _imports(p) if _top(name) in ("ucfs", "torchio")]
    assert found == []
