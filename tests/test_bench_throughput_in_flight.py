"""`noria bench throughput`'s noria-serve-16: the client holds at most that many requests in
flight (llama.cpp's runs' limit), read back from the worker's own step log: no step ran more
sequences than the limit, and every request still ran to its length."""

from __future__ import annotations

from pathlib import Path

import pytest

from noria.bench.ceiling import read_steps
from noria.bench.throughput import run_noria_serve


def test_at_most_in_flight_requests_run_together(demo_path: Path, tmp_path: Path) -> None:
    # Long enough that a request's companions arrive while it runs, however loaded the host.
    work = [([5 + i, 6, 7], 40) for i in range(7)]
    record = str(tmp_path / "steps")
    row = run_noria_serve(demo_path, work, ["--num-kv-blocks", "64"], record, in_flight=2)
    assert row["system"] == "noria-serve-2" and row["output_tokens"] == 7 * 40
    steps = read_steps(record, row["record_skip"])
    assert max(len(query_lens) for query_lens, *_ in steps) == 2  # the limit, and reached
    unlimited = run_noria_serve(demo_path, work, ["--num-kv-blocks", "64"], str(tmp_path / "all"))
    assert unlimited["system"] == "noria-serve"
    assert max(len(q) for q, *_ in read_steps(str(tmp_path / "all"), unlimited["record_skip"])) > 2


def test_noria_serve_n_is_any_limit_and_runs_in_noria_serve_16s_place() -> None:
    from noria.bench.throughput import main, recorded, repeated, serve_limit

    assert [serve_limit(s) for s in ("noria-serve-16", "noria-serve-64", "noria-serve", "noria-serve-0")] == [
        16, 64, None, None]
    assert repeated(["llama.cpp", "noria-serve-64", "hf-cb", "noria-llm"]) == ["noria-llm", "llama.cpp",
                                                                              "noria-serve-64"]
    assert recorded("noria-serve-64") and recorded("noria-llm") and not recorded("llama.cpp")
    # Beside llama.cpp, only at its own limit: refused before anything runs.
    with pytest.raises(SystemExit, match="noria-serve-64 beside llama.cpp at --in-flight 16"):
        main(["--model", "serving", "--systems", "noria-serve-64,llama.cpp"])
