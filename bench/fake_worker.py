"""A brute-force stand-in for the worker, for scheduler tests without torch.

It keeps a model of every KV slot's content (token, position) and checks that
whatever a step attends to was really computed for that sequence, so a wrong
block table, a bad prefix hit or a lost copy fails loudly. The "model" is a
deterministic function of the whole token sequence, so greedy outputs must
not depend on how the scheduler batched, chunked, cached or preempted.
"""

from __future__ import annotations

from noria.protocol.step import StepPlan, StepResult


def next_token(tokens: list[int], vocab: int) -> int:
    return hash(tuple(tokens)) % vocab


class FakeWorker:
    def __init__(self, num_blocks: int, block_size: int, vocab: int = 1000, num_cpu_blocks: int = 0) -> None:
        self.block_size = block_size
        self.vocab = vocab
        self.kv: list[list[tuple[int, int] | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.cpu: list[list[tuple[int, int] | None]] = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.reqs: dict[int, dict] = {}
        self.forced: dict[int, list[int]] = {}  # req_id -> tokens to emit instead of the model's

    def _check_prefix(self, rid: int, upto: int) -> None:
        st = self.reqs[rid]
        bs = self.block_size
        for pos in range(upto):
            block = st["blocks"][pos // bs]
            got = self.kv[block][pos % bs]
            want = (st["tokens"][pos], pos)
            assert got == want, f"req {rid} pos {pos}: block {block} holds {got}, expected {want}"

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished_req_ids:
            del self.reqs[rid]
        for nr in plan.new_requests:
            assert nr.req_id not in self.reqs, f"req {nr.req_id} sent twice as new"
            # The last token a request may compute: its last output token is sampled, never fed back.
            max_tokens = plan.params[nr.params].max_tokens
            last = nr.num_prompt_tokens + max_tokens - 1 if max_tokens else None
            self.reqs[nr.req_id] = {"tokens": list(nr.token_ids), "blocks": list(nr.block_ids),
                                    "computed": nr.num_computed_tokens, "last": last}
        for cr in plan.cached_requests:
            self.reqs[cr.req_id]["blocks"].extend(cr.new_block_ids)
        for dev, cpu in plan.swap_out:
            self.cpu[cpu] = list(self.kv[dev])
        for dev, cpu in plan.swap_in:
            self.kv[dev] = list(self.cpu[cpu])
        bs = self.block_size
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
                forced = self.forced.get(rid)
                tok = forced.pop(0) if forced else next_token(st["tokens"], self.vocab)
                st["tokens"].append(tok)
                out_ids.append(rid)
                out_toks.append(tok)
        return StepResult(plan.step_id, out_ids, out_toks, epoch=plan.epoch)
