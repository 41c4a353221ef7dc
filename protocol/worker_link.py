"""The scheduler <-> worker link: registration, welcome, heartbeats and the unions it is typed by.

The scheduler binds one ROUTER; each worker rank connects one DEALER (a fresh identity per
incarnation) and says `Register`. The scheduler checks it (protocol version, rank, model
identity) and answers `Refused`, or, once every rank of a group has registered, `Welcome`
with the group's epoch, the engine config and the tensor-parallel rendezvous. Each rank then
loads the model and answers `WorkerReady`; plans and results follow (protocol/step.py).
Both sides send `Heartbeat` while the other is quiet; a side silent for `worker_timeout`
is lost. Every plan, result, ready, failure and heartbeat carries the epoch: anything from
an incarnation already declared lost is discarded, never applied.
"""

from __future__ import annotations

import msgspec

from noria.protocol.config import EngineConfig
from noria.protocol.model_identity import ModelIdentity
from noria.protocol.step import StepPlan, StepResult

WORKER_PROTOCOL_VERSION = 5
"""Bumped whenever a message on this link changes shape; a mismatch is refused by name."""


def heartbeat_interval(worker_timeout: float) -> float:
    """How often each side speaks when it has nothing else to say: several beats per timeout."""
    return max(0.05, min(1.0, worker_timeout / 5))


# ---- worker -> scheduler -------------------------------------------------------------------


class Register(msgspec.Struct, array_like=True, gc=False, tag="register"):
    """A worker rank's hello. `model` None: "I will load the path your Welcome names".

    `kv_capacity_bytes`: memory this rank can give its KV cache (free device memory on
    a GPU, available RAM on a CPU), for the scheduler's log; the block count comes in
    WorkerReady. `dist_address` (HOST:PORT, rank 0 only): where this rank can host the
    tensor-parallel rendezvous, HOST being its own address towards the scheduler.
    """

    protocol_version: int
    rank: int
    device: str
    hostname: str
    pid: int
    kv_capacity_bytes: int
    model: ModelIdentity | None
    dist_address: str | None = None


class WorkerReady(msgspec.Struct, array_like=True, gc=False, tag="ready"):
    """`attention_backend`: what the rank's attention runs on ("kernels" or "torch",
    --attention-backend); `attention_reason`: why not the kernels, for some or all layers
    ("" when nothing fell back). The scheduler reports rank 0's in its stats (/health)."""

    epoch: int
    rank: int
    num_kv_blocks: int
    num_cpu_blocks: int
    vocab_size: int
    max_model_len: int
    attention_backend: str = ""
    attention_reason: str = ""
    kv_endpoint: str = ""  # where this rank serves held KV blocks to consumers (a producer's); "" none


class WorkerFailed(msgspec.Struct, array_like=True, gc=False, tag="failed"):
    """Sent before a rank exits on an error (loading the model, a step): the group is lost."""

    epoch: int
    rank: int
    reason: str


class Heartbeat(msgspec.Struct, array_like=True, gc=False, tag="beat"):
    epoch: int


# ---- scheduler -> worker -------------------------------------------------------------------


class Welcome(msgspec.Struct, array_like=True, gc=False, tag="welcome"):
    """The group is complete: load `config.model` (or the worker's own `--model` path, whose
    identity must equal `model`) and answer WorkerReady with this epoch."""

    epoch: int
    config: EngineConfig
    model: ModelIdentity
    heartbeat_interval: float
    worker_timeout: float
    dist_init_method: str | None = None  # tcp://HOST:PORT of rank 0's rendezvous; None with one rank


class Refused(msgspec.Struct, array_like=True, gc=False, tag="refused"):
    """The registration is refused for good (the worker logs `reason` and exits non-zero)."""

    reason: str


class Disband(msgspec.Struct, array_like=True, gc=False, tag="disband"):
    """The group of `epoch` is gone (another rank was lost): drop every request and the KV
    contents, leave the process group, keep the weights and register again."""

    epoch: int
    reason: str


class WorkerShutdown(msgspec.Struct, array_like=True, gc=False, tag="shutdown"):
    """The engine is shutting down: exit 0."""


SchedulerToWorker = StepPlan | Welcome | Refused | Heartbeat | Disband | WorkerShutdown
WorkerToScheduler = StepResult | Register | WorkerReady | WorkerFailed | Heartbeat
