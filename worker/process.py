"""One worker rank: register with the scheduler, load the model it names, run its plans.

The same code runs a local rank (`noria serve` starts `python -m noria.worker --connect
ipc://...`) and a remote one (`noria worker --connect tcp://HOST:PORT`). The life of a rank:

* register (`Register`): refused -> log the reason, exit 1; no scheduler for
  `scheduler_wait` seconds -> exit 1;
* `Welcome`: load the model (kept from an earlier group when the config is the same and
  no process group is involved), answer `WorkerReady`, then run every plan of that epoch;
  rank 0 answers each with its `StepResult`;
* `Disband` (another rank was lost) or a scheduler silent for its timeout: drop every
  request and register again; `WorkerShutdown`: exit 0;
* an exception (loading, a step): `WorkerFailed`, then exit 1. `noria serve` restarts
  its local ranks; the scheduler re-queues the requests either way.
"""

from __future__ import annotations

import logging
import pkgutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from noria.protocol import switches
from noria.protocol.config import EngineConfig
from noria.protocol.model_identity import ModelIdentity, identity_difference, model_identity
from noria.protocol.security import is_loopback
from noria.protocol.step import StepPlan
from noria.protocol.worker_link import (
    Disband,
    Refused,
    Welcome,
    WorkerFailed,
    WorkerReady,
    WorkerShutdown,
)
from noria.worker import cpu_ops
from noria.worker.errors import WorkerFatal
from noria.worker.link import LinkDown, WorkerLink
from noria.worker.registration import address_towards, hello, use_route_for_gloo

log = logging.getLogger("noria.worker")


@dataclass(frozen=True)
class WorkerOptions:
    connect: str  # the scheduler's worker link
    rank: int = 0
    model: str | None = None  # this host's path to the checkpoint; None: the Welcome's path
    device: str | None = None  # None: the engine's --device
    curve_keys: str | None = None
    scheduler_wait: float = 60.0  # give up after this long without a scheduler


class WorkerSession:
    def __init__(self, opts: WorkerOptions, link: WorkerLink) -> None:
        self.opts = opts
        self.link = link
        # Known before registering when this host names its own path, so a wrong model is refused at once.
        self.identity: ModelIdentity | None = _own_identity(opts.model) if opts.model else None
        self.runner: Any = None  # ModelRunner, imported late: torch loads after the OpenMP settings
        self.runner_key: tuple[EngineConfig, str | None] | None = None

    def run(self) -> int:
        while True:
            welcome = self._register()
            if welcome is None:
                return 1
            try:
                self._start(welcome)
                outcome = self._serve(welcome.epoch)
            except Exception as e:
                reason = str(e) if isinstance(e, WorkerFatal) else traceback.format_exc()
                log.error("rank %d failed: %s", self.opts.rank, reason)
                self.link.send(WorkerFailed(welcome.epoch, self.opts.rank, reason[-4000:]))
                return 1
            if outcome is None:
                return 0
            log.warning("rank %d leaves the group of epoch %d (%s) and registers again", self.opts.rank,
                        welcome.epoch, outcome)
            self._forget()

    def _register(self) -> Welcome | None:
        opts = self.opts
        give_up = time.monotonic() + opts.scheduler_wait
        while True:
            self.link.connect(timeout=opts.scheduler_wait)
            self.link.send(hello(opts.rank, opts.device, self.identity, opts.connect))
            while True:
                msg = self.link.recv()
                if isinstance(msg, Welcome):
                    return msg
                if isinstance(msg, Refused):
                    log.error("the scheduler at %s refused rank %d: %s", opts.connect, opts.rank, msg.reason)
                    return None
                if isinstance(msg, LinkDown):
                    break  # plans or disbands of an older incarnation are ignored
            if time.monotonic() > give_up:
                hint = (" (with --curve-keys: is this worker's public key in the scheduler's authorized/ "
                        "folder, and scheduler.key the scheduler's?)") if opts.curve_keys else ""
                log.error("no scheduler answered at %s for %gs (--scheduler-wait): giving up%s", opts.connect,
                          opts.scheduler_wait, hint)
                return None
            log.warning("%s; registering again", msg.reason)

    def _start(self, welcome: Welcome) -> None:
        config = welcome.config
        if self.opts.model:
            config = msgspec.structs.replace(config, model=self.opts.model)
        if self.opts.device:
            config = msgspec.structs.replace(config, device=self.opts.device)
        self.link.beat(welcome.epoch, welcome.heartbeat_interval, welcome.worker_timeout)
        if self.identity is None:
            self.identity = _check_model(config.model, welcome.model, config.load_format != "dummy")
        key = (config, welcome.dist_init_method)
        if self.runner is None or key != self.runner_key:
            self._close_runner()
            from noria.worker.model_runner import ModelRunner

            if welcome.dist_init_method:
                use_route_for_gloo(self.opts.connect)
            t0 = time.monotonic()
            self.runner = ModelRunner(config, self.opts.rank, welcome.dist_init_method)
            self.runner_key = key
            install_step_observer(self.runner)
            log.info("rank %d loaded %s in %.1fs: %d KV blocks", self.opts.rank, config.model,
                     time.monotonic() - t0, self.runner.num_kv_blocks)
            if self.runner.device.type == "cpu":
                cpu_ops.log_once()
        r = self.runner
        choice = r.attention_choice
        kv_endpoint = r.transfers.start(r.kv_cache, self._kv_host(config), self.opts.curve_keys)
        self.link.send(WorkerReady(welcome.epoch, self.opts.rank, r.num_kv_blocks, r.num_cpu_blocks, r.vocab_size,
                                   r.max_model_len, choice.name, choice.reason, kv_endpoint))

    def _kv_host(self, config: EngineConfig) -> str:
        """Where this rank serves KV blocks: the engine's kv_ip on the scheduler's host, else this
        host's address on the route to the scheduler (consumers reach the producer's hosts)."""
        tc = config.kv_transfer_config
        if tc is None or is_loopback(self.opts.connect):
            return tc.kv_ip if tc is not None else "127.0.0.1"
        return address_towards(self.opts.connect)

    def _serve(self, epoch: int) -> str | None:
        """Run the epoch's plans; why it ended (None: shut down)."""
        runner, rank, link = self.runner, self.opts.rank, self.link
        while True:
            msg = link.recv()
            if isinstance(msg, StepPlan):
                if msg.epoch != epoch:
                    continue
                result = runner.execute(msg)
                if rank == 0:
                    result.epoch = epoch
                    link.send(result)
            elif isinstance(msg, Disband) and msg.epoch == epoch:
                return f"disbanded: {msg.reason}"
            elif isinstance(msg, WorkerShutdown):
                return None
            elif isinstance(msg, LinkDown):
                return msg.reason

    def _forget(self) -> None:
        """Drop every request; the weights stay unless a process group must be formed anew."""
        if self.runner is None:
            return
        if self.runner.tp.size > 1:
            self._close_runner()  # its torch.distributed group is gone with the other ranks
            return
        self.runner.transfers.forget()  # its pulls and holds went with the group
        # The plan that finishes every request the runner knows, and does nothing else.
        self.runner.execute(StepPlan(0, [], finished_req_ids=list(self.runner.requests)))

    def _close_runner(self) -> None:
        if self.runner is not None:
            self.runner.close()
        self.runner = self.runner_key = None

    def close(self) -> None:
        self._close_runner()


def install_step_observer(runner: Any) -> None:
    """Call $NORIA_STEP_OBSERVER ("package.module:callable") with a new runner, so that it may add
    to `runner.step_observers` (e.g. bench/step_log.py's step log). A name that does not resolve
    fails the rank at start: a run asked for observation and must not go unobserved."""
    name = switches.step_observer()
    if name is None:
        return
    try:
        install = pkgutil.resolve_name(name)
    except (ImportError, AttributeError, ValueError) as e:
        raise WorkerFatal(f"{switches.STEP_OBSERVER}={name}: {e}") from e
    install(runner)


def _own_identity(path: str) -> ModelIdentity | None:
    """This host's checkpoint's identity; None for a folder without weights (a dummy load's, or
    not a checkpoint at all), checked once the engine's config says which (`_check_model`)."""
    try:
        return model_identity(path)
    except FileNotFoundError:
        return None


def _check_model(path: str, engine: ModelIdentity, weights: bool = True) -> ModelIdentity:
    if not Path(path).exists():
        raise WorkerFatal(f"the engine's model {path} does not exist on this host: pass --model PATH "
                          "(this host's copy of the same checkpoint)")
    mine = model_identity(path, weights)
    diff = identity_difference(engine, mine)
    if diff:
        raise WorkerFatal(f"the model at {path} is not the engine's: {diff}")
    return mine


def run(opts: WorkerOptions) -> int:
    link = WorkerLink(opts.connect, opts.curve_keys)
    session = WorkerSession(opts, link)
    try:
        return session.run()
    finally:
        session.close()
        link.close()
