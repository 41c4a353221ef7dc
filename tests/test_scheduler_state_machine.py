"""A hypothesis state machine drives the scheduler and block pool against brute-force models.

Random arrivals (shared prefixes, n > 1 sent as the frontend sends it: one
engine request per sample, in one group, priorities), aborts of one sample or
of all samples of a request, steps and drains, under random cache sizes,
budgets, preemption modes and caching switches. After every step: reference
counts equal owners, no block is owned twice or leaked, with caching off no
block is shared outside a request's samples, every cached hash maps to a
block that holds exactly the tokens hashed, outputs equal the brute-force
model's, and every request ends exactly once; when all requests end, every
block is free. With async scheduling drawn on, each step is planned before the
previous step's result is applied (as the scheduler process does): the worker
runs the plans in order, and outputs must still equal the model's token for token. With
speculative decoding drawn on (drafts of 1-4 tokens, n-gram, suffix or a draft model's whose
context is shorter than the target's, sync or async scheduling: ahead, a step drafts only when
none runs, and its drafted requests sit out the plan made meanwhile), the model is drawn to depend on the last one or two tokens only, so that its outputs repeat and drafts are accepted
in whole or in part: outputs stay the model's, and every cached block still holds exactly the
tokens its key covers (no rejected draft token is ever keyed).
"""

from __future__ import annotations

import struct

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import noria.scheduler.kv_cache_manager as kvm
from noria.bench.fake_worker import FakeWorker, next_token
from noria.protocol.config import EngineConfig
from noria.protocol.engine import EngineRequest, EngineSample
from noria.protocol.sampling import EngineSamplingParams
from noria.protocol.speculative import SpeculativeConfig
from noria.scheduler.process import carries_nothing
from noria.scheduler.scheduler import Scheduler

VOCAB = 40
EOS = VOCAB - 1
BS = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27], []]

_hashed: dict[bytes, tuple[int, ...]] = {}  # block key -> every token it covers
_real_new_digest = kvm.new_digest


def _recording_new_digest(data: bytes):
    """A block's key is the digest of its parent's key (or root) and its packed token ids."""
    h = _real_new_digest(data)
    parent, tokens = data[: -8 * BS], data[-8 * BS :]
    _hashed[h.digest()] = _hashed.get(parent, ()) + struct.unpack(f"<{BS}q", tokens)
    return h


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(6, 32),
        budget=st.sampled_from([6, 16, 64]),
        max_seqs=st.integers(3, 8),
        swap=st.booleans(),
        cpu_blocks=st.integers(0, 24),
        caching=st.booleans(),
        ahead=st.booleans(),
        spec=st.sampled_from([None, None, 1, 2, 4]),
        method=st.sampled_from(["ngram", "suffix", "draft_model", "eagle3"]),
        window=st.sampled_from([1, 2, None]),
        row_cost=st.sampled_from([0.0, 0.0, 0.2, 1.0]),
    )
    def setup(self, num_blocks, budget, max_seqs, swap, cpu_blocks, caching, ahead, spec, method, window, row_cost):
        kvm.new_digest = _recording_new_digest
        self.window = window if spec else None
        cfg = EngineConfig(
            block_size=BS, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
            preemption_mode="swap" if swap else "recompute", enable_prefix_caching=caching,
            scheduling_policy="priority",  # the arrivals draw priorities: let them order the queues
            async_scheduling=ahead,
            speculative_config=SpeculativeConfig(method=method, num_speculative_tokens=spec, prompt_lookup_min=1,
                                                 prompt_lookup_max=3, model="draft", max_model_len=24)
            if spec else None,
        )
        event(f"speculation by {method}" if spec else "no speculation")
        self.s = Scheduler(cfg, num_blocks, 10_000, cpu_blocks)
        self.w = FakeWorker(num_blocks, BS, vocab=VOCAB, num_cpu_blocks=cpu_blocks, window=self.window)
        self.sizes = (num_blocks, cpu_blocks)
        self.next_id = 0
        self.prompts: dict[int, list[int]] = {}
        self.outputs: dict[int, list[int]] = {}
        self.ended: dict[int, str] = {}
        self.max_tokens: dict[int, int] = {}
        self.group: dict[int, int] = {}  # req_id -> its client request's first engine id
        self.shared = False
        self.ahead = ahead  # async scheduling
        # What a step of n tokens costs, as the scheduler process measures it (speculation reads
        # it): 1 + row_cost * n, flat (rows are free) to compute-bound.
        self.row_cost = row_cost
        self.in_flight = None  # the result of the step planned before the last one (ahead only)

    def teardown(self):
        kvm.new_digest = _real_new_digest
        if hasattr(self, "s"):
            st_ = self.s.stats
            # Coverage signals, shown by --hypothesis-show-statistics.
            event("preempted" if st_.num_preemptions else "no preemption")
            event("swapped" if st_.num_swap_ins else "no swap-in")
            event("prefix hit" if st_.prefix_cache_hits else "no prefix hit")
            caching = "caching on" if self.s.kv.enable_prefix_caching else "caching off"
            event(f"samples shared a block, {caching}" if self.shared else "no sample sharing")
            event("async scheduling" if self.ahead else "sync scheduling")
            if self.s.spec is not None:
                event("drafts accepted" if st_.spec_accepted_tokens else "no draft accepted")
                if self.ahead:
                    event("async with drafts" if st_.spec_drafts else "async, nothing drafted")
                    event("async, a step planned ahead" if st_.steps_planned_ahead else "async, none ahead")
                event("a draft rejected" if st_.spec_accepted_tokens < st_.spec_draft_tokens else "none rejected")

    def _busy(self):
        return self.s.has_work() or self.in_flight is not None

    def _run_step(self):
        """One turn of the scheduler process: plan and send a step if there is work, then
        (ahead: only now) apply the result of the step before it. Ahead, as the process does,
        no plan is made while the next would draft, and none is sent that carries nothing."""
        result = None
        ahead = self.ahead and self.in_flight is not None
        if self.s.has_work() and not (ahead and self.s.drafts_next()):
            plan = self.s.schedule(ahead)
            if not (ahead and carries_nothing(plan)):
                assert not (ahead and plan.drafts), "a plan made while a step runs drafted"
                result = self.w.execute(plan)
                self.s.stats.steps_planned_ahead += ahead
                n = sum(k for _, k in plan.scheduled)
                self.s.observe_step(plan.step_id, 1.0 + self.row_cost * n, len(result.token_ids))
        if self.ahead:
            result, self.in_flight = self.in_flight, result
        if result is not None:
            self.s.update_from_result(result)

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, VOCAB - 2), min_size=0, max_size=20),
        max_tokens=st.integers(1, 24),
        n=st.integers(1, 3),
        priority=st.integers(0, 2),
        copies=st.integers(1, 3),
    )
    def arrive(self, prefix, suffix, max_tokens, n, priority, copies):
        for k in range(copies):
            self._arrive(prefix + suffix[k:], max_tokens, n, priority)

    def _arrive(self, prompt, max_tokens, n, priority):
        first = self.next_id
        for _ in range(n):
            rid = self.next_id
            self.next_id += 1
            self.prompts[rid] = prompt
            self.outputs[rid] = []
            self.max_tokens[rid] = max_tokens
            self.group[rid] = first
        # One engine request carries every sample, as the frontend sends them.
        params = EngineSamplingParams(max_tokens=max_tokens)
        more = [EngineSample(first + i, i) for i in range(1, n)]
        self.s.add_request(EngineRequest(first, prompt, params, [EOS], priority, first if n > 1 else None,
                                         more_samples=more))
        self._collect()

    @rule(data=st.data(), whole=st.booleans())
    def abort(self, data, whole):
        """One sample (a stop string) or every open sample of its request (a client abort)."""
        live = sorted(set(self.prompts) - set(self.ended))
        if live:
            rid = data.draw(st.sampled_from(live))
            ids = [r for r in live if self.group[r] == self.group[rid]] if whole else [rid]
            self.s.abort(ids)
            self._collect()

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            if not self._busy():
                return
            self._run_step()
            self._collect()
            self.check_state()

    @precondition(lambda self: hasattr(self, "s"))
    @rule()
    def lose_worker(self):
        """The worker group dies with its KV (and, ahead, with the step in flight, whose
        result is never applied); a new one of the same size takes over."""
        self.s.reset_after_worker_loss()
        self.in_flight = None
        self.w = FakeWorker(self.sizes[0], BS, vocab=VOCAB, num_cpu_blocks=self.sizes[1], window=self.window)
        event("worker lost")
        self._collect()

    @precondition(lambda self: hasattr(self, "s"))
    @rule()
    def drain(self):
        for _ in range(2000):
            if not self._busy():
                break
            self._run_step()
            self._collect()
        assert not self._busy(), "the engine did not finish its work"
        assert set(self.ended) == set(self.prompts), "a request never ended"
        assert self.s.kv.pool.num_free == self.s.kv.pool.num_blocks, "blocks leaked"
        assert len(self.s.kv.cpu_free) == self.s.kv.num_cpu_blocks, "CPU blocks leaked"

    def _collect(self):
        for u in self.s.take_updates():
            assert u.req_id not in self.ended, f"request {u.req_id} got an update after it ended"
            if u.finish_reason == "error":
                prompt = self.prompts[u.req_id]
                legit = (not prompt and u.error_code == "invalid_request") or (
                    len(prompt) >= self.s.max_model_len and u.error_code == "prompt_too_long"
                )
                assert legit, u.error_message
                self.ended[u.req_id] = "error"
                continue
            self.outputs[u.req_id].extend(u.new_token_ids)
            out, cap = self.outputs[u.req_id], self.max_tokens[u.req_id]
            assert len(out) <= cap, f"request {u.req_id}: {len(out)} tokens, max_tokens {cap}"
            if u.finish_reason == "length":  # max_tokens, or the cache's whole size
                full = len(self.prompts[u.req_id]) + len(out) >= self.s.max_model_len
                assert len(out) == cap or full, f"request {u.req_id} ended at {len(out)} of {cap} tokens"
            if u.finish_reason == "stop":
                assert out[-1] == EOS, f"request {u.req_id} stopped on {out[-1]}"
            if u.finish_reason:
                self.ended[u.req_id] = u.finish_reason

    @invariant()
    def check_state(self):
        if not hasattr(self, "s"):
            return
        s = self.s
        assert s.check_blocks() is None, s.check_blocks()
        holders: dict[int, list[int]] = {}  # block -> the groups of the requests holding it
        for r in s.requests.values():
            assert len(set(r.block_ids)) == len(r.block_ids), f"request {r.req_id} owns a block twice"
            # Ahead, a sampled token may be on its way; a draft being verified, all of its tokens.
            drafted = s.spec.num_speculative_tokens if r.spec_pending and s.spec is not None else 0
            assert r.num_computed_tokens <= r.num_worker_tokens <= r.num_tokens + (1 if self.ahead else 0) + drafted
            for b in r.block_ids:
                holders.setdefault(b, []).append(self.group[r.req_id])
        for b, groups in holders.items():
            if len(set(groups)) > 1:
                assert s.kv.enable_prefix_caching, f"block {b} is shared across requests with caching off"
            elif len(groups) > 1:
                self.shared = True
        assert set(s.requests) == set(self.prompts) - set(self.ended)
        for h, b in s.kv.pool.cached.items():
            tokens = _hashed[h]
            k = len(tokens) // BS - 1
            want = [(tokens[k * BS + j], k * BS + j) for j in range(BS)]
            assert self.w.kv[b] == want, f"cached block {b} holds {self.w.kv[b]}, hash says {want}"
        for rid, out in self.outputs.items():
            toks = list(self.prompts[rid])
            for t in out:
                assert t == next_token(toks, VOCAB, self.window), f"request {rid} output differs from the model"
                toks.append(t)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=400, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
