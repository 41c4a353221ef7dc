"""A brute-force stand-in for the worker, for scheduler tests without torch.

It keeps a model of every KV slot's content (token, position) and checks that
whatever a step attends to was really computed for that sequence, so a wrong
block table, a bad prefix hit or a lost copy fails loudly. The "model" is a
deterministic function of the whole token sequence, so greedy outputs must
not depend on how the scheduler batched, chunked, cached or preempted.
"""

from __future__ import annotations

from noria.protocol.step import KVPull, KVPulled, StepPlan, StepResult


def next_token(tokens: list[int], vocab: int, window: int | None = None) -> int:
    """The model: a hash of the whole sequence, or (`window`) of its last `window` tokens only,
    whose outputs soon repeat (what speculation's n-gram lookup finds)."""
    return hash(tuple(tokens[-window:] if window else tokens)) % vocab


class FakeWorker:
    def __init__(self, num_blocks: int, block_size: int, vocab: int = 1000, num_cpu_blocks: int = 0,
                 window: int | None = None) -> None:
        self.block_size = block_size
        self.vocab = vocab
        self.window = window  # next_token's
        self.kv: list[list[tuple[int, int] | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.cpu: list[list[tuple[int, int] | None]] = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.reqs: dict[int, dict] = {}
        self.forced: dict[int, list[int]] = {}  # req_id -> tokens to emit instead of the model's
        # Prefill/decode disaggregation: a producer's holds (transfer id -> blocks), and the
        # producers a consumer reaches, by endpoint (a missing one is a producer that is gone).
        self.holds: dict[int, list[int]] = {}
        self.peers: dict[str, FakeWorker] = {}
        self.endpoint = f"tcp://fake-{id(self)}:1"
        # A pull ends (its blocks written, its outcome reported) this many steps after the step
        # that names it, as the real worker's pull thread lets steps go on meanwhile.
        self.pull_delay = 0
        self.pending: list[tuple[int, KVPull]] = []
        self.steps = 0

    def _check_prefix(self, rid: int, upto: int) -> None:
        st = self.reqs[rid]
        bs = self.block_size
        for pos in range(upto):
            block = st["blocks"][pos // bs]
            got = self.kv[block][pos % bs]
            want = (st["tokens"][pos], pos)
            assert got == want, f"req {rid} pos {pos}: block {block} holds {got}, expected {want}"

    def _pull(self, pull: KVPull) -> KVPulled:
        """Copy the held blocks as the real worker does; fail as it does when they are not held."""
        producer = self.peers.get(pull.endpoints[0])
        held = producer.holds.get(pull.transfer_id) if producer is not None else None
        if held is None or not set(pull.remote_block_ids) <= set(held):
            return KVPulled(pull.req_id, False, 0, 0.0, "not held")
        for remote, local in zip(pull.remote_block_ids, pull.local_block_ids, strict=True):
            assert producer is not None
            self.kv[local] = list(producer.kv[remote])
        return KVPulled(pull.req_id, True, len(pull.local_block_ids), 0.0)

    def execute(self, plan: StepPlan) -> StepResult:
        for tid in plan.kv_release:
            self.holds.pop(tid, None)
        for rid in plan.finished_req_ids:
            del self.reqs[rid]
        for nr in plan.new_requests:
            assert nr.req_id not in self.reqs, f"req {nr.req_id} sent twice as new"
            # The last token a request may compute: its last output token is sampled, never fed back.
            max_tokens = plan.params[nr.params].max_tokens
            last = nr.num_prompt_tokens + max_tokens - 1 if max_tokens else None
            self.reqs[nr.req_id] = {"tokens": list(nr.token_ids), "blocks": list(nr.block_ids),
                                    "computed": nr.num_computed_tokens, "last": last,
                                    "export": nr.kv_export_id, "prompt": nr.num_prompt_tokens}
        for cr in plan.cached_requests:
            self.reqs[cr.req_id]["blocks"].extend(cr.new_block_ids)
        for dev, cpu in plan.swap_out:
            self.cpu[cpu] = list(self.kv[dev])
        for dev, cpu in plan.swap_in:
            self.kv[dev] = list(self.cpu[cpu])
        self.steps += 1
        self.pending += [(self.steps + self.pull_delay, p) for p in plan.kv_pulls]
        due = [p for at, p in self.pending if at <= self.steps]
        self.pending = [(at, p) for at, p in self.pending if at > self.steps]
        pulled = [self._pull(p) for p in due]
        bs = self.block_size
        drafted: dict[int, int] = {}
        for draft in plan.drafts:  # speculative decoding: the row is the last token and the draft
            st = self.reqs[draft.req_id]
            assert st["computed"] == len(st["tokens"]) - 1, f"req {draft.req_id}: a draft on a non-decode"
            assert bool(draft.propose) != bool(draft.token_ids), f"req {draft.req_id}: a draft of neither kind"
            if draft.propose:  # the worker's draft model: the model's tokens, every third one wrong
                for _ in range(draft.propose):
                    seq = st["tokens"] + draft.token_ids
                    tok = next_token(seq, self.vocab, self.window)
                    draft.token_ids.append(tok if hash(tuple(seq)) % 3 else (tok + 1) % self.vocab)
            st["tokens"].extend(draft.token_ids)
            drafted[draft.req_id] = len(draft.token_ids)
        # Like every layer of the real worker: write the whole step's KV, then attend.
        for rid, n in plan.scheduled:
            st = self.reqs[rid]
            c = st["computed"]
            assert c + n <= len(st["tokens"]), f"req {rid}: scheduled past its known tokens"
            assert st["last"] is None or c + n <= st["last"], f"req {rid}: scheduled past max_tokens"
            assert len(st["blocks"]) * bs >= c + n, f"req {rid}: too few blocks for {c + n} tokens"
            for pos in range(c, c + n):
                self.kv[st["blocks"][pos // bs]][pos % bs] = (st["tokens"][pos], pos)
        out_ids: list[int] = []
        out_toks: list[int] = []
        for rid, n in plan.scheduled:
            st = self.reqs[rid]
            st["computed"] += n
            self._check_prefix(rid, st["computed"])
            if st["computed"] == len(st["tokens"]):
                k = drafted.get(rid, 0)
                base = st["tokens"][:len(st["tokens"]) - k]
                draft = st["tokens"][len(base):]
                kept: list[int] = []
                for j in range(k + 1):  # the model's token at each drafted position, up to the first miss
                    forced = self.forced.get(rid)
                    tok = forced.pop(0) if forced else next_token(base + kept, self.vocab, self.window)
                    kept.append(tok)
                    if j == k or tok != draft[j]:
                        break
                st["tokens"] = base + kept
                st["computed"] = len(st["tokens"]) - 1 if k else st["computed"]
                out_ids += [rid] * len(kept)
                out_toks += kept
                if st["export"]:
                    self.holds[st["export"]] = st["blocks"][: -(-st["prompt"] // self.block_size)]
        return StepResult(plan.step_id, out_ids, out_toks, epoch=plan.epoch, kv_pulled=pulled)
