"""The step log: one line per engine step, written by the worker of rank 0 as it runs.

A line is `[query_lens, seq_lens, num_sampled, model_seconds]` (bench/ceiling.py's
`read_steps` reads it back): exactly the batches noria ran, for the ceiling replay and the
roofline, and the seconds the forward pass took, which split a run's wall time into model
and engine overhead.

Workers are processes of their own, so the log is installed through the environment they
inherit: `env(path)` names `install` as the worker's step observer ($NORIA_STEP_OBSERVER)
and the file ($NORIA_RECORD_STEPS). The file is created (emptied) when the worker builds its
model, so a count of its lines taken after a warm-up is where the timed part starts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING

from noria.protocol import switches

if TYPE_CHECKING:  # the benchmark's own process needs no torch to set the log up
    from noria.worker.model_runner import ModelRunner, StepStats

OBSERVER = "noria.bench.step_log:install"


def env(path: str | Path) -> dict[str, str]:
    """The environment variables that make a worker started with them log its steps to `path`."""
    return {switches.STEP_OBSERVER: OBSERVER, switches.RECORD_STEPS: str(path)}


@contextmanager
def recording(path: str | Path) -> Iterator[None]:
    """Within it, this process's environment carries `env(path)`, so that engines started here
    (an `LLM`) log their steps; the variables are put back as they were on the way out."""
    saved = {name: os.environ.get(name) for name in env(path)}
    os.environ.update(env(path))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def line(step: StepStats) -> str:
    return f"[{step.query_lens}, {step.seq_lens}, {step.num_sampled}, {step.model_seconds:.6f}]\n"


class StepLog:
    """A step observer that appends `line(step)` to an open file, flushed per step so that
    the benchmark reads the steps while the engine still runs."""

    def __init__(self, file: IO[str]) -> None:
        self.file = file

    def __call__(self, step: StepStats) -> None:
        self.file.write(line(step))
        self.file.flush()


def install(runner: ModelRunner) -> None:
    """The worker's step observer installer: rank 0 logs to $NORIA_RECORD_STEPS (the other
    ranks run the same steps)."""
    path = switches.record_steps()
    if path is None:
        raise ValueError(f"{switches.STEP_OBSERVER}={OBSERVER} needs {switches.RECORD_STEPS}, the log's file")
    if runner.rank != 0:
        return
    runner.step_observers.append(StepLog(open(path, "w")))  # noqa: SIM115 - lives as long as the worker
