"""The soak's catalogue of requests, their expected outputs, and the check of one finished request.

A job is a prompt and a variant (greedy, long greedy, n=2 seeded sampling, a stop
string). Every job is deterministic: greedy, or sampled with a fixed seed, which
noria keeps independent of the batch. So each job's output is measured once, before
the traffic, through the ZMQ client (its text and token ids) and the non-streaming
HTTP API (its text), and every later run of the job on any surface must give it
again: a stream's deltas must concatenate to it, an aborted stream to a prefix of it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

PROMPTS = [
    "The water wheel turns",
    "Tell me about the river, the mill and the buckets that fill and empty on every turn of the wheel.",
    "Once upon a time",
    "List the parts of a mill: " + ", ".join(f"part {i}" for i in range(12)),
    "Why does the miller grease the axle?",
    "A long story: " + " ".join(f"the wheel turned {i} times and the river kept flowing" for i in range(6)),
    "Q: what is a bucket? A:",
    "Paged attention keeps the KV cache in blocks so that",
]

# Wire fields of each variant (the ZMQ/websocket names, which OpenAI's request also takes).
VARIANTS: dict[str, dict[str, Any]] = {
    "greedy": {"max_tokens": 48, "temperature": 0.0, "ignore_eos": True},
    "long": {"max_tokens": 160, "temperature": 0.0, "ignore_eos": True},
    "n2": {"max_tokens": 40, "temperature": 0.8, "seed": 7, "n": 2, "ignore_eos": True},
    "stop": {"max_tokens": 48, "temperature": 0.0, "ignore_eos": True},  # + a stop string per prompt
}
VARIANT_WEIGHTS = {"greedy": 0.4, "long": 0.15, "n2": 0.2, "stop": 0.25}


@dataclass
class Job:
    prompt: int
    variant: str
    params: dict[str, Any]
    texts: list[str] = field(default_factory=list)  # expected text of each sample
    ids: list[list[int]] | None = None  # expected token ids (None: text only, e.g. a stop string cut a token)
    reasons: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"p{self.prompt}-{self.variant}"


@dataclass
class Outcome:
    """What one client saw of one request."""

    surface: str
    job: Job
    abort_after: int | None  # deltas after which the client aborts (or cuts the connection)
    texts: list[list[str]]
    ids: list[list[int]] | None  # None where the surface sends no token ids
    finals: int = 0  # final messages (done or error) for the request
    after_final: int = 0  # messages that came after its final one
    reasons: list[str | None] = field(default_factory=list)
    completion_tokens: int | None = None
    error: str | None = None
    cut: bool = False  # the client cut the connection: no final message is owed
    deltas: int = 0
    checked: list[str] | None = None  # problems() once it ended; its texts are then dropped

    def settle(self) -> None:
        """Check it now and keep only the verdict (an hour of traffic is ~100k outcomes)."""
        self.checked = problems(self)
        self.texts, self.ids = [], None

    def verdict(self) -> list[str]:
        """Its problems, counting a duplicate that arrived after it was checked."""
        found = list(self.checked) if self.checked is not None else problems(self)
        late = (self.finals > 1 or self.after_final) and not any(p.startswith("duplicated") for p in found)
        return [*found, f"duplicated: {self.finals} final messages, {self.after_final} after the final one"] \
            if late else found

    @classmethod
    def new(cls, surface: str, job: Job, abort_after: int | None, with_ids: bool = True) -> Outcome:
        n = len(job.texts)
        return cls(surface, job, abort_after, [[] for _ in range(n)], [[] for _ in range(n)] if with_ids else None,
                   reasons=[None] * n)

    def delta(self, index: int, text: str, token_ids: list[int] | None) -> None:
        if self.finals:
            self.after_final += 1
            return
        self.deltas += 1
        self.texts[index].append(text)
        if self.ids is not None and token_ids is not None:
            self.ids[index].extend(token_ids)

    def final(self, reasons: list[str] | None, completion_tokens: int | None, error: str | None = None) -> None:
        self.finals += 1
        if self.finals > 1:
            return
        if reasons is not None:
            self.reasons = list(reasons)
        self.completion_tokens = completion_tokens
        self.error = error


def problems(o: Outcome) -> list[str]:
    """Everything wrong with one finished request; an empty list when it is right."""
    out: list[str] = []
    if o.finals == 0 and not o.cut:
        return ["lost: no final message"]
    if o.finals > 1 or o.after_final:
        out.append(f"duplicated: {o.finals} final messages, {o.after_final} messages after the final one")
    if o.error is not None:
        return [*out, f"error: {o.error}"]
    aborted = o.abort_after is not None and (o.cut or "abort" in o.reasons)
    for i, want in enumerate(o.job.texts):
        got = "".join(o.texts[i])
        if aborted and not want.startswith(got):
            out.append(f"sample {i}: aborted stream {got!r} is not a prefix of {want!r}")
        elif not aborted and got != want:
            out.append(f"sample {i}: deltas concatenate to {got!r}, not the final text {want!r}")
        if o.job.ids is not None and o.ids is not None:
            have, ref = o.ids[i], o.job.ids[i]
            if (have != ref[:len(have)]) if aborted else (have != ref):
                out.append(f"sample {i}: token ids {have} differ from {ref}")
        if not aborted and not o.cut and o.reasons[i] != o.job.reasons[i]:
            out.append(f"sample {i}: finish reason {o.reasons[i]!r}, expected {o.job.reasons[i]!r}")
    if o.completion_tokens is not None and o.ids is not None and not o.cut:
        streamed = sum(len(x) for x in o.ids)
        if streamed != o.completion_tokens:
            out.append(f"usage says {o.completion_tokens} completion tokens, the deltas carried {streamed}")
    elif o.completion_tokens is not None and o.job.ids is not None and not aborted:
        want = sum(len(x) for x in o.job.ids)  # no token ids on this surface: the job's count
        if o.completion_tokens != want:
            out.append(f"usage says {o.completion_tokens} completion tokens, the job makes {want}")
    return out


def pick_stop(text: str) -> str | None:
    """A stop string from the middle of a greedy output (its first occurrence past the start)."""
    for k in range(len(text) // 2, len(text) - 3):
        s = text[k:k + 3]
        if "\ufffd" not in s and text.find(s) > 0:
            return s
    return None


def choose(rng: random.Random, jobs: list[Job]) -> Job:
    variant = rng.choices(list(VARIANT_WEIGHTS), weights=list(VARIANT_WEIGHTS.values()))[0]
    return rng.choice([j for j in jobs if j.variant == variant] or jobs)
