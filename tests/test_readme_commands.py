"""The README's commands, run from a fresh clone of this repository.

The clone gets its own .venv (made by bin/bootstrap.sh, as a user's would);
a path file lends it this environment's already-installed packages so that
the test does not download torch again. Tests what is committed (HEAD).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from noria import Client, SamplingParams
from tests.procs import serve

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("fresh") / "noria"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], check=True)
    subprocess.run([sys.executable, "-m", "venv", str(dest / ".venv")], check=True)
    site = subprocess.run(
        [str(dest / ".venv/bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    # A plain path line: this environment's packages become importable, but its
    # own editable install of noria (a .pth hook) is not run, so the clone's is used.
    Path(site, "lend-packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return dest


def test_generate_prints_text(clone):
    out = subprocess.run(
        [str(clone / "bin/noria"), "generate", "Hello", "--max-tokens", "20"],
        cwd=clone, capture_output=True, text=True, timeout=600, env=os.environ,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip(), "no text printed"
    assert str(clone) in (clone / ".venv/bin/noria").read_text() or (clone / ".venv/bin/noria").exists()


def test_serve_answers_a_client(clone):
    with serve(cmd=[str(clone / "bin/noria")], cwd=str(clone)) as (address, proc):
        with Client(address) as c:
            out = c.generate("Hello", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].text
        # The server runs the clone's code, not this checkout's.
        exe = os.readlink(f"/proc/{proc.pid}/cwd")
        assert Path(exe) == clone
