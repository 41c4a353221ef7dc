"""`noria serve` with an API key: HTTP needs it, and no child process can see it.

Only the bridge needs the key; it gets it through a pipe on its standard input.
The scheduler and the workers never get it. Every child's command line and
environment (/proc/PID/cmdline, /proc/PID/environ) is searched for it.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request

import pytest

from noria.frontend.api_key import add_api_key_args, resolve_api_key
from tests.procs import children_of, serve_http

KEY = "sekret-7f3a9c51-do-not-leak"


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        out += kids
        todo += kids
    return out


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _request(url: str, key: str | None, body: dict | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("source", ["flag", "env"])  # the file is read like the flag: see below
def test_the_key_guards_http_and_reaches_no_child(source, tmp_path):
    args: list[str] = []
    env = {k: v for k, v in os.environ.items() if k != "NORIA_API_KEY"}
    if source == "flag":
        args = ["--api-key", KEY]
    else:
        env["NORIA_API_KEY"] = KEY
    with serve_http(*args, env=env) as served:
        kids = descendants(served.proc.pid)
        cmdlines = {pid: _read(f"/proc/{pid}/cmdline") for pid in kids}
        environs = {pid: _read(f"/proc/{pid}/environ") for pid in kids}
        roles = [c.replace(b"\0", b" ") for c in cmdlines.values()]
        assert any(b"noria.scheduler" in c for c in roles), roles
        assert any(b"noria.worker" in c for c in roles), roles
        assert any(b" bridge " in c for c in roles), roles
        if source == "flag":  # the search finds the key where it was given...
            assert KEY.encode() in _read(f"/proc/{served.proc.pid}/cmdline")
        # ...and it is in no child.
        for pid in kids:
            assert KEY.encode() not in cmdlines[pid], f"key on the command line of {roles}"
            assert KEY.encode() not in environs[pid], f"key in the environment of {cmdlines[pid]!r}"
            assert b"NORIA_API_KEY=" not in environs[pid]

        models = f"{served.http}/v1/models"
        assert _request(models, None)[0] == 401
        assert _request(models, "wrong")[0] == 401
        status, body = _request(models, KEY)
        assert status == 200 and body["data"][0]["id"]
        status, body = _request(f"{served.http}/v1/completions", KEY,
                                {"model": body["data"][0]["id"], "prompt": "Hello", "max_tokens": 3})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
        status, body = _request(f"{served.http}/v1/completions", None, {"prompt": "Hello", "max_tokens": 3})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        # vLLM's /tokenize and /detokenize sit beside /v1, behind the key all the same.
        for path, body in (("/tokenize", {"prompt": "Hello"}), ("/detokenize", {"tokens": [5, 6]})):
            assert _request(f"{served.http}{path}", None, body)[0] == 401
            assert _request(f"{served.http}{path}", KEY, body)[0] == 200


def _resolve(monkeypatch, argv: list[str], env: str | None) -> tuple[str | None, str | None]:
    ap = argparse.ArgumentParser()
    add_api_key_args(ap)
    if env is None:
        monkeypatch.delenv("NORIA_API_KEY", raising=False)
    else:
        monkeypatch.setenv("NORIA_API_KEY", env)
    return resolve_api_key(ap.parse_args(argv)), os.environ.get("NORIA_API_KEY")


def test_where_the_key_comes_from(tmp_path, monkeypatch):
    (tmp_path / "key").write_text(f"  {KEY}\n")
    assert _resolve(monkeypatch, ["--api-key-file", str(tmp_path / "key")], "other") == (KEY, None)
    assert _resolve(monkeypatch, ["--api-key", KEY], "other") == (KEY, None)
    assert _resolve(monkeypatch, [], KEY) == (KEY, None)  # and no child can inherit it now
    assert _resolve(monkeypatch, [], None) == (None, None)
    assert _resolve(monkeypatch, [], "") == (None, None)


def test_an_empty_key_file_is_refused(tmp_path):
    from noria.frontend.cli import main

    (tmp_path / "key").write_text("\n")
    assert main(["bridge", "--api-key-file", str(tmp_path / "key")]) == 2
