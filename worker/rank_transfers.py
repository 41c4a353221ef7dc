"""One worker rank's part in prefill/decode disaggregation, as the ModelRunner drives it: a
producer's block server (worker/kv_server.py) and a consumer's pulls (worker/kv_pull_queue.py),
made by `start` as the engine's --kv-transfer-config says."""

from __future__ import annotations

import torch

from noria.protocol.config import EngineConfig
from noria.protocol.step import KVPull, KVPulled
from noria.worker.kv_cache import KVCache
from noria.worker.kv_pull import KVPuller
from noria.worker.kv_pull_queue import PullQueue
from noria.worker.kv_server import KVBlockServer
from noria.worker.models.parallel import TensorParallel
from noria.worker.step_inputs import RequestState

# How long a step with nothing but pulls to wait for waits for one to end: the scheduler plans
# such steps only to hear of its pulls, and would otherwise plan them back to back.
PULL_POLL_SECONDS = 0.005


class RankTransfers:
    def __init__(self, config: EngineConfig, rank: int, tp: TensorParallel, device: torch.device) -> None:
        self.config = config
        self.rank = rank
        self.tp = tp
        self.device = device
        self.server: KVBlockServer | None = None
        self.pulls: PullQueue | None = None
        self._refused: list[KVPulled] = []

    def start(self, cache: KVCache, host: str, curve_folder: str | None) -> str:
        """Serve held blocks on `host` (a producer) and pull blocks (a consumer); where this rank
        serves ("" if it does not)."""
        tc = self.config.kv_transfer_config
        if tc is None:
            return ""
        if tc.produces and self.server is None:
            self.server = KVBlockServer(cache, host, curve_folder)
        if tc.consumes and self.pulls is None:
            opts = tc.kv_connector_extra_config
            self.pulls = PullQueue(KVPuller(cache, self.rank, opts.transfer_timeout, opts.chunk_bytes, curve_folder))
        return self.server.endpoint if self.server is not None else ""

    def release(self, transfer_ids: list[int]) -> None:
        if self.server is not None:
            self.server.release(transfer_ids)

    def hold(self, transfer_id: int, block_ids: list[int]) -> None:
        if self.server is not None:
            self.server.hold(transfer_id, block_ids)

    def hold_exports(self, sampled: list[RequestState], tables: list[list[int]], block_size: int) -> None:
        """Hold the prompt blocks, as they are now, of the producer's requests that sampled."""
        for state in sampled:
            if state.kv_export:
                self.hold(state.kv_export, tables[state.row][:-(-state.num_prompt_tokens // block_size)])

    def submit(self, pulls: list[KVPull]) -> None:
        if self.pulls is None:  # a plan the engine's role does not allow: each fails at once
            self._refused += [KVPulled(p.req_id, False, error="this engine pulls no KV (its "
                                       "--kv-transfer-config role is kv_producer)") for p in pulls]
        else:
            self.pulls.submit(pulls)

    def ended(self, idle: bool = False) -> list[KVPulled]:
        """The pulls that have ended on every rank since the last call (every rank calls it once
        per step). A step with nothing else to do (`idle`) waits a little for one, so that a
        scheduler waiting only for pulls does not spin."""
        out, self._refused = self._refused, []
        q = self.pulls
        if q is None or not q.outstanding:
            return out
        if idle:
            q.wait_any(PULL_POLL_SECONDS)
        state = q.snapshot()
        ended = [(rid, o) for rid, o in state if o is not None]
        if self.tp.size > 1:  # ended everywhere, whole only if whole everywhere
            votes = torch.tensor([[int(o is not None), int(o is not None and not o.ok), o.nbytes if o else 0]
                                  for _, o in state], dtype=torch.long, device=self.device)
            self.tp.all_reduce(votes)
            ended = []
            for (rid, o), (done, failed, nbytes) in zip(state, votes.tolist(), strict=True):
                if done == self.tp.size:
                    assert o is not None
                    error = o.error or ("another rank's shard did not arrive" if failed else None)
                    ended.append((rid, KVPulled(rid, failed == 0, nbytes, o.seconds, error)))
        q.forget([rid for rid, _ in ended])
        return out + [o for _, o in ended if o is not None]

    def forget(self) -> None:
        """The worker group is gone: its pulls' blocks belong to the next group, and the
        scheduler's holds went with it."""
        if self.pulls is not None:
            self.pulls.cancel_all()
        if self.server is not None:
            self.server.clear()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.pulls is not None:
            self.pulls.close()
        self.server, self.pulls = None, None
