"""The worker process: receives StepPlans, runs the model, answers with StepResults.

Every rank executes every plan; only rank 0 answers. A failure is reported to
the scheduler (WorkerFailed) before the process exits non-zero, so the engine
can fail cleanly instead of hanging.
"""

from __future__ import annotations

import logging
import time
import traceback

import zmq

from noria.protocol.codec import Codec
from noria.protocol.config import EngineAddresses, EngineConfig
from noria.protocol.sockets import make_socket
from noria.protocol.step import (
    SchedulerToWorker,
    StepPlan,
    WorkerFailed,
    WorkerReady,
    WorkerShutdown,
    WorkerToScheduler,
)

log = logging.getLogger("noria.worker")


def run(config: EngineConfig, addrs: EngineAddresses, rank: int, dist_init_method: str | None = None) -> int:
    """`dist_init_method`: the tensor-parallel ranks' torch.distributed rendezvous."""
    ctx = zmq.Context()
    plans = make_socket(ctx, zmq.PULL, addrs.plans[rank], bind=False)
    results = make_socket(ctx, zmq.PUSH, addrs.results, bind=False)
    plan_codec: Codec[SchedulerToWorker] = Codec(SchedulerToWorker)
    out_codec: Codec[WorkerToScheduler] = Codec(WorkerToScheduler)
    runner = None
    try:
        from noria.worker.model_runner import ModelRunner

        t0 = time.monotonic()
        runner = ModelRunner(config, rank, dist_init_method)
        log.info("rank %d loaded %s in %.1fs: %d KV blocks", rank, config.model, time.monotonic() - t0, runner.num_kv_blocks)
        results.send(
            out_codec.encode(
                WorkerReady(rank, runner.num_kv_blocks, runner.num_cpu_blocks, runner.vocab_size, runner.max_model_len)
            )
        )
        while True:
            msg = plan_codec.decode(plans.recv())
            if isinstance(msg, WorkerShutdown):
                return 0
            assert isinstance(msg, StepPlan)
            result = runner.execute(msg)
            if rank == 0:
                results.send(out_codec.encode(result))
    except Exception:
        reason = traceback.format_exc()
        log.error("rank %d failed:\n%s", rank, reason)
        results.send(out_codec.encode(WorkerFailed(rank, reason[-4000:])))
        time.sleep(0.2)  # let the message leave before the context goes
        return 1
    finally:
        if runner is not None:
            runner.close()
        plans.close(linger=0)
        results.close(linger=500)
        ctx.term()
