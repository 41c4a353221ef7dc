"""Everything imports the product as `noria.*`: the folders are installed under that one
name, and a bare `import kernels` would pick up whichever `kernels` distribution
happens to be installed (Hugging Face publishes one) or load a second copy of a module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("protocol", "frontend", "scheduler", "worker", "kernels", "bench")


def _sources() -> list[Path]:
    skip = {".venv", ".git", "build", "dist"}
    return [p for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts)]


def test_no_bare_top_level_imports() -> None:
    bad = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in FOLDERS]
    assert not bad, "import these through noria.*:\n" + "\n".join(bad)


def test_child_processes_start_inside_the_namespace() -> None:
    # `python -m scheduler` would run whatever top-level `scheduler` is on sys.path.
    bad = []
    for path in _sources():
        text = path.read_text()
        for folder in FOLDERS:
            for form in (f'"-m", "{folder}"', f'"-m", "{folder}.'):
                if form in text:
                    bad.append(f"{path.relative_to(ROOT)}: {form}")
    assert not bad, "\n".join(bad)


def test_the_public_names_load_lazily() -> None:
    import subprocess
    import sys

    # The worker must set OpenMP settings before torch loads, and the scheduler never loads
    # torch, yet `python -m noria.worker` imports the `noria` package first.
    code = "import sys, noria, noria.scheduler.process; assert 'torch' not in sys.modules; print(noria.LLM.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == "LLM"
