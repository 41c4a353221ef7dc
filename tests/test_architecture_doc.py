"""docs/architecture.md names what the code has: every message on the wire, every top-level
folder, and the import rules in its folder table hold.

The messages are found in the code, not listed here: every tagged Struct in noria.protocol, every
member of a union the links are typed by (ClientToServer, FrontendToScheduler, ...), and every
Struct carried inside them (RequestUpdate, NewRequestData, Logprob, ...). A new message that the
page does not name fails this test.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import subprocess
import types
import typing
from pathlib import Path

import msgspec
import msgspec.inspect as mi

import noria.protocol

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
PACKAGES = ("protocol", "frontend", "scheduler", "worker", "kernels", "bench", "noria")


def _protocol_modules() -> list[types.ModuleType]:
    names = [m.name for m in pkgutil.iter_modules(noria.protocol.__path__, "noria.protocol.")]
    return [noria.protocol, *(importlib.import_module(n) for n in names)]


def _is_struct(obj: object) -> bool:
    return isinstance(obj, type) and issubclass(obj, msgspec.Struct) and obj is not msgspec.Struct


def _unions() -> dict[str, tuple[type, ...]]:
    """Module-level `X = A | B | ...` aliases over Structs: the type of a link direction."""
    found = {}
    for module in _protocol_modules():
        for name, value in vars(module).items():
            if isinstance(value, types.UnionType) or typing.get_origin(value) is typing.Union:
                members = tuple(a for a in typing.get_args(value) if _is_struct(a))
                if members:
                    found[name] = members
    return found


def _carried(info: mi.Type, seen: set[type]) -> None:
    """Every Struct class reachable from a msgspec type description."""
    if isinstance(info, mi.StructType):
        if info.cls in seen:
            return
        seen.add(info.cls)
        for f in info.fields:
            _carried(f.type, seen)
        return
    for field in info.__struct_fields__:
        value = getattr(info, field)
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, mi.Type):
                _carried(item, seen)


def wire_structs() -> set[type]:
    roots: set[type] = set()
    for module in _protocol_modules():
        for value in vars(module).values():
            if _is_struct(value) and value.__module__ == module.__name__ and value.__struct_config__.tag is not None:
                roots.add(value)
    for members in _unions().values():
        roots.update(members)
    seen: set[type] = set()
    for cls in roots:
        _carried(mi.type_info(cls), seen)
    return seen


def _named(page: str, name: str) -> bool:
    """Named in code font: `Name`, or inside a span such as `Codec(ClientToServer)`."""
    word = re.compile(rf"\b{re.escape(name)}\b")
    return any(word.search(span) for span in re.findall(r"`([^`\n]+)`", page))


def test_discovery_finds_the_links_and_their_payloads() -> None:
    # Guards the discovery itself: were it to find nothing, the next test would pass vacuously.
    unions = _unions()
    assert {"ClientToServer", "ServerToClient", "FrontendToScheduler", "SchedulerToFrontend",
            "SchedulerToWorker", "WorkerToScheduler"} <= set(unions)
    names = {c.__name__ for c in wire_structs()}
    assert {"StepPlan", "StepResult", "RequestUpdate", "NewRequestData", "SamplingParams", "Logprob"} <= names


def test_every_message_and_link_type_is_named() -> None:
    page = PAGE.read_text()
    missing = sorted(c.__name__ for c in wire_structs() if not _named(page, c.__name__))
    missing += sorted(u for u in _unions() if not _named(page, u))
    assert not missing, f"docs/architecture.md does not name: {', '.join(missing)}"


def _top_level_folders() -> set[str]:
    if (ROOT / ".git").exists():
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True)
        return {line.split("/")[0] for line in out.stdout.splitlines() if "/" in line}
    skip = {"build", "dist", "__pycache__"}
    return {p.name for p in ROOT.iterdir() if p.is_dir() and p.name not in skip
            and not p.name.startswith(".") and not p.name.endswith(".egg-info")}


def test_every_top_level_folder_is_named() -> None:
    page = PAGE.read_text()
    folders = _top_level_folders()
    assert {"protocol", "scheduler", "worker", "tests"} <= folders
    missing = sorted(f for f in folders if f"`{f}/`" not in page)
    assert not missing, f"docs/architecture.md does not name these folders: {missing}"


def _folder_table(page: str) -> dict[str, tuple[str, str]]:
    """`folder/` -> (holds, may import) from the page's folder table."""
    rows = {}
    for line in page.splitlines():
        m = re.match(r"\|\s*`([\w.-]+)/`\s*\|(.*)\|([^|]*)\|\s*$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3).strip())
    return rows


def _imports(folder: str) -> dict[str, set[str]]:
    """noria.* packages and third-party roots that a folder's modules import, with a place each."""
    out: dict[str, set[str]] = {}
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            for mod in mods:
                parts = mod.split(".")
                key = parts[1] if parts[0] == "noria" and len(parts) > 1 else parts[0]
                out.setdefault(key, set()).add(f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


def test_the_import_rules_in_the_folder_table_hold() -> None:
    rows = _folder_table(PAGE.read_text())
    assert set(PACKAGES) <= set(rows), f"folder table rows: {sorted(rows)}"
    broken = []
    for folder in PACKAGES:
        holds, may = rows[folder]
        if may.startswith("anything"):
            continue
        allowed = {w for w in re.findall(r"\w+", may) if w in PACKAGES} | {folder}
        imported = _imports(folder)
        for pkg in set(PACKAGES) - allowed:
            broken += [f"{where} imports noria.{pkg}" for where in sorted(imported.get(pkg, ()))]
        if "never torch" in holds:
            broken += [f"{where} imports torch" for where in sorted(imported.get("torch", ()))]
    assert not broken, "docs/architecture.md's folder table says otherwise:\n" + "\n".join(broken)


def test_the_rule_check_sees_imports() -> None:
    # The worker imports protocol and torch; were `_imports` blind, the rule test would pass vacuously.
    imported = _imports("worker")
    assert "protocol" in imported and "torch" in imported
