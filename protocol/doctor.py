"""What `noria doctor` hands its generation child and gets back.

The doctor runs in the worker's folder (it drives the kernels and torch), which may not
import the frontend's `LLM`; each short generation it compares therefore runs in a child,
`python -m noria.frontend.doctor_generation`, and these two Structs are that link.
"""

from __future__ import annotations

from typing import Any

import msgspec

from noria.protocol.client import Logprob, SchedulerStats


class GenerationProbe(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A greedy run of the demo model in float32: these prompts, this many tokens each."""

    prompts: list[list[int]]
    max_tokens: int
    engine: dict[str, Any]  # engine flags as `LLM` takes them (device, num_kv_blocks, preemption_mode, ...)


class GenerationSample(msgspec.Struct, kw_only=True):
    token_ids: list[int]
    logprobs: list[Logprob]


class GenerationRun(msgspec.Struct, kw_only=True):
    """The outputs in prompt order and the engine's stats after the run (its blocks all back?)."""

    samples: list[GenerationSample]
    stats: SchedulerStats
