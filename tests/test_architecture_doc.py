"""docs/architecture.md names what the code has: every message on the wire, each link's table
lists exactly its union, every top-level folder, the import rules in its folder table hold, and
every socket is made where it says. Every file that the docs, the READMEs and the code's
comments name exists.

The messages are found in the code, not listed here: every tagged Struct in noria.protocol, every
member of a union the links are typed by (ClientToServer, FrontendToScheduler, ...), and every
Struct carried inside them (RequestUpdate, NewRequestData, Logprob, ...). A new message that the
page does not name fails this test.
"""

from __future__ import annotations

import ast
import importlib
import io
import os
import pkgutil
import re
import subprocess
import tokenize
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
    assert {"StepPlan", "StepResult", "RequestUpdate", "NewRequestData", "EngineSamplingParams", "Logprob"} <= names


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


# ---- the message tables -----------------------------------------------------------------------

_TABLE_HEAD = "| direction | union | messages |"


def _union_rows(page: str) -> tuple[dict[str, str], list[str]]:
    """union -> its messages cell, from rows inside a table that has the header above them;
    and the union rows found outside any such table (a paragraph breaks a Markdown table:
    what follows it is text, not rows)."""
    lines = page.splitlines()
    inside: dict[str, str] = {}
    for i, line in enumerate(lines):
        if line.strip() != _TABLE_HEAD:
            continue
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            m = re.match(r"\|[^|]*\|\s*`(\w+)`\s*\|(.*)\|\s*$", row)
            if m:
                inside[m.group(1)] = m.group(2)
    outside = []
    for line in lines:
        m = re.match(r"\|[^|]*\|\s*`(\w+)`\s*\|.*\|\s*$", line)
        if m and m.group(1) in _unions() and m.group(1) not in inside:
            outside.append(m.group(1))
    return inside, outside


def _top_level_names(cell: str) -> set[str]:
    """The `Names` of a messages cell outside parentheses: the union's members, not what
    they carry (`StepPlan` (… `NewRequestData` …) names StepPlan only)."""
    depth, kept = 0, []
    for ch in cell:
        depth += ch == "("
        if depth == 0:
            kept.append(ch)
        depth -= ch == ")" and depth > 0
    return set(re.findall(r"`(\w+)`", "".join(kept)))


def test_each_link_table_lists_exactly_its_union() -> None:
    rows, outside = _union_rows(PAGE.read_text())
    assert not outside, f"docs/architecture.md: rows outside a message table (a paragraph between rows?): {outside}"
    links = {"ClientToServer", "ServerToClient", "FrontendToScheduler", "SchedulerToFrontend",
             "SchedulerToWorker", "WorkerToScheduler"}
    unions = _unions()
    assert links <= set(rows), f"the message tables have rows for {sorted(rows)}"
    wrong = []
    for name in sorted(links):
        real = {c.__name__ for c in unions[name]}
        listed = _top_level_names(rows[name])
        if real != listed:
            wrong.append(f"{name}: missing {sorted(real - listed)}, not in the union {sorted(listed - real)}")
    assert not wrong, "docs/architecture.md's message tables:\n" + "\n".join(wrong)


def test_the_table_parser_sees_a_broken_table() -> None:
    # A paragraph between two rows ends the table: the row after it is reported.
    page = "\n".join([_TABLE_HEAD, "|---|---|---|", "| a → b | `SchedulerToWorker` | `StepPlan` |", "",
                      "A paragraph.", "| b → a | `WorkerToScheduler` | `StepResult` |"])
    rows, outside = _union_rows(page)
    assert set(rows) == {"SchedulerToWorker"} and outside == ["WorkerToScheduler"]
    assert _top_level_names("`StepPlan` (a `NewRequestData` (nested `X`)), `Heartbeat`") == {"StepPlan", "Heartbeat"}


# ---- file paths named in the docs and in the code's comments -----------------------------------

DOCS = ("README.md", "kernels/README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))))
# A file name with one of these extensions, not part of a longer word (`client.beta.chat.completions`)
# nor of a URL or a shell variable.
_PATH = re.compile(r"(?<![\w./$:-])([\w./-]*\w\.(?:py|c|h|cu|cuh|md))(?![\w-])")
_SKIP = {".git", ".venv", "build", "dist", "__pycache__", "node_modules", ".pytest_cache", ".ruff_cache"}


def _tree() -> set[str]:
    files = set()
    for top, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in _SKIP and not d.endswith(".egg-info")]
        rel = Path(top).relative_to(ROOT)
        files.update((rel / n).as_posix() for n in names)
    return files


def _resolves(name: str, named_in: str, tree: set[str]) -> bool:
    """A path with a folder is named from the root, from the naming file's folder, or from a
    folder the text is about (`models/moe.py` in the worker's row, `csrc/common.cuh` in the
    kernels' README): some file's path ends with it. A bare name must be some file's name,
    unless its stem is all capitals: a placeholder (`OUT.md` for `--out OUT`), as a real one
    (README.md, RESULTS.md) is named with its folder where it matters."""
    name = name.removeprefix("./")
    if "/" not in name:
        return name.split(".")[0].isupper() or any(f.rsplit("/", 1)[-1] == name for f in tree)
    here = (Path(named_in).parent / name).as_posix()
    return name in tree or here in tree or any(f.endswith("/" + name) for f in tree)


def _missing(texts: dict[str, list[tuple[int, str]]], tree: set[str]) -> list[str]:
    out = []
    for where, lines in texts.items():
        for lineno, text in lines:
            out += [f"{where}:{lineno}: {m}" for m in _PATH.findall(text) if not _resolves(m, where, tree)]
    return out


def test_every_file_the_docs_name_exists() -> None:
    tree = _tree()
    texts = {doc: list(enumerate((ROOT / doc).read_text().splitlines(), 1)) for doc in DOCS}
    missing = _missing(texts, tree)
    assert not missing, "files named but not in the tree:\n" + "\n".join(missing)


def _comments(path: Path) -> list[tuple[int, str]]:
    """(line, text) of a source file's comments and docstrings: what a reader takes as prose."""
    source = path.read_text()
    if path.suffix != ".py":
        return [(source.count("\n", 0, m.start()) + 1, m.group())
                for m in re.finditer(r"//[^\n]*|/\*.*?\*/", source, re.S)]
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.append((first.lineno, first.value.value))
    return out


def test_every_file_the_code_comments_name_exists() -> None:
    tree = _tree()
    sources = sorted(f for f in tree if f.endswith((".py", ".c", ".h", ".cu", ".cuh")))
    assert "scheduler/request.py" in sources and "kernels/csrc/cache_ops.cu" in sources
    missing = _missing({f: _comments(ROOT / f) for f in sources}, tree)
    assert not missing, "files named in comments or docstrings but not in the tree:\n" + "\n".join(missing)


def test_the_path_check_catches_a_missing_file() -> None:
    tree = {"scheduler/results.py", "worker/models/spec.py", "kernels/csrc/cache_ops.cu"}
    named = {"docs/architecture.md": [(1, "see `scheduler/outputs.py` and https://x.org/a.py"),
                                      (2, "`models/spec.py`, `results.py`, client.beta.chat.completions")],
             "kernels/README.md": [(3, "`csrc/cache_ops.cu`, `csrc/gone.cu`, $root/pyproject.md, OUT.md")]}
    assert _missing(named, tree) == ["docs/architecture.md:1: scheduler/outputs.py",
                                     "kernels/README.md:3: csrc/gone.cu"]


# ---- sockets ----------------------------------------------------------------------------------

SOCKET_HOME = "protocol/sockets.py"


def _socket_creations(source: str, where: str) -> list[str]:
    """Calls that make a ZeroMQ socket: `<context>.socket(...)` and `zmq.Socket(...)`
    (`socket.socket(...)`, the standard library's, is not one)."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        made = (isinstance(f, ast.Attribute) and f.attr == "socket"
                and not (isinstance(f.value, ast.Name) and f.value.id == "socket"))
        made |= isinstance(f, ast.Attribute) and f.attr in ("Socket", "SyncSocket")
        made |= isinstance(f, ast.Name) and f.id == "Socket"
        if made:
            found.append(f"{where}:{node.lineno}")
    return found


def test_every_zmq_socket_is_made_by_protocol_sockets() -> None:
    """The page says so: every socket of the processes and the client library comes from
    make_socket, so none misses LINGER, its high-water mark or its largest frame."""
    assert "`make_socket` (`protocol/sockets.py`)" in PAGE.read_text()
    made = []
    for folder in PACKAGES:
        if folder == "bench":  # its fuzzers and probes speak raw ZeroMQ on purpose
            continue
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel != SOCKET_HOME:
                made += _socket_creations(path.read_text(), rel)
    assert not made, f"sockets made outside {SOCKET_HOME}'s make_socket:\n" + "\n".join(made)
    assert _socket_creations((ROOT / SOCKET_HOME).read_text(), SOCKET_HOME), "make_socket makes none?"


def test_the_socket_check_sees_a_socket() -> None:
    src = ("import socket, zmq\nctx = zmq.Context()\na = ctx.socket(zmq.DEALER)\n"
           "b = zmq.Context.instance().socket(zmq.PUSH)\nc = socket.socket()\nd = zmq.Socket(ctx, zmq.PULL)\n")
    assert _socket_creations(src, "x.py") == ["x.py:3", "x.py:4", "x.py:6"]
