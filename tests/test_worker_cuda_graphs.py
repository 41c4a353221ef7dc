"""Decode steps through persistent buffers and (padded) graph buckets, on the CPU.

The bucket and padding rules are pure functions, tested against their definitions. The
ModelRunner's decode path through the buffers is compared with the general batch path it
replaced, and the padded replay path (a stand-in graph that re-runs the captured forward
eagerly over the buffers) with the unpadded eager one: same tokens, same logprobs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from noria.bench.spec_models import write_eagle3_head
from noria.protocol.config import EngineConfig
from noria.protocol.sampling import EngineSamplingParams
from noria.protocol.speculative import SpeculativeConfig
from noria.protocol.step import NewRequestData, StepPlan
from noria.worker.cuda_graphs import (
    DecodeBuffers,
    DecodeForward,
    DecodeGraphs,
    DecodeInputs,
    bucket_size,
    capture_sizes,
    pad_decode,
)
from noria.worker.model_runner import ModelRunner
from tests.tiny_models import make_checkpoint

# -- pure functions ---------------------------------------------------------------


def test_default_capture_sizes() -> None:
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 8)]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    # Not a multiple of 8: the next multiple still holds a step of max_num_seqs.
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]


def test_given_capture_sizes() -> None:
    assert capture_sizes(256, [32, 4, 4, 1]) == [1, 4, 32]


@pytest.mark.parametrize("max_num_seqs", [1, 5, 20, 64])
def test_bucket_is_smallest_size_that_fits(max_num_seqs: int) -> None:
    sizes = capture_sizes(max_num_seqs)
    for n in range(1, max_num_seqs + 1):
        expected = min(s for s in sizes if s >= n)
        assert bucket_size(n, sizes) == expected
    assert bucket_size(sizes[-1] + 1, sizes) is None
    assert bucket_size(3, [1, 4, 32]) == 4 and bucket_size(5, [1, 4, 32]) == 32


def test_pad_decode_rows() -> None:
    tables = torch.tensor([[3, 4, 9], [5, 9, 9]])
    inputs = DecodeInputs([11, 12], [20, 7], [4 * 16 + 4, 5 * 16 + 7], [21, 8], tables)
    padded = pad_decode(inputs, 4, null_block=9, block_size=16)
    assert padded.input_ids == [11, 12, 0, 0]
    assert padded.positions == [20, 7, 0, 0]
    assert padded.slots == [68, 87, 144, 144]  # the null block's first slot
    assert padded.seq_lens == [21, 8, 1, 1]
    assert padded.block_tables.tolist() == [[3, 4, 9], [5, 9, 9], [9, 9, 9], [9, 9, 9]]
    assert pad_decode(inputs, 2, 9, 16) == inputs
    with pytest.raises(ValueError):
        pad_decode(inputs, 1, 9, 16)


def test_buffers_stage_and_views() -> None:
    buffers = DecodeBuffers(max_rows=8, max_cols=6, device=torch.device("cpu"))
    tables = torch.arange(12).view(3, 4)
    views = buffers.stage(DecodeInputs([1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12], tables))
    assert views.input_ids.tolist() == [1, 2, 3]
    assert views.positions.tolist() == [4, 5, 6]
    assert views.slot_mapping.tolist() == [7, 8, 9]
    assert views.seq_lens.tolist() == [10, 11, 12]
    assert views.query_start_loc.tolist() == [0, 1, 2, 3]
    assert views.block_tables.is_contiguous() and torch.equal(views.block_tables, tables)
    # Persistent: a later step's views are the same memory.
    again = buffers.stage(DecodeInputs([7], [0], [0], [1], torch.zeros(1, 4, dtype=torch.long)))
    assert again.input_ids.data_ptr() == views.input_ids.data_ptr()
    assert views.input_ids.tolist() == [7, 2, 3]
    with pytest.raises(ValueError):
        buffers.stage(DecodeInputs([1], [1], [1], [1], torch.zeros(1, 7, dtype=torch.long)))


# -- the ModelRunner ----------------------------------------------------------------

BLOCK = 8
PROMPT_LENS = [3, 9, 17, 1, 30, 12, 5, 24, 8, 2]
# Decode steps drop requests as they go so that batches of 10 down to 1 rows run.
FINISH_AFTER = [2, 14, 5, 9, 3, 12, 7, 14, 1, 11]


def drive(runner: ModelRunner, params: EngineSamplingParams, seed: int = 0) -> tuple[dict[int, list[int]], list]:
    """Prefill every prompt in one step, then decode all live requests one token per step,
    each request ending after its FINISH_AFTER tokens. Returns the tokens per request and
    every StepResult's logprobs."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in PROMPT_LENS]
    next_block = iter(range(runner.num_kv_blocks))
    blocks: dict[int, list[int]] = {}
    tokens = {i: list(p) for i, p in enumerate(prompts)}
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    new = []
    for i, p in enumerate(prompts):
        blocks[i] = [next(next_block) for _ in range(-(-(len(p) + 16) // BLOCK))]
        new.append(NewRequestData(i, list(p), blocks[i], 0, 0, len(p)))
    logprobs: list = []
    plan = StepPlan(0, [(i, len(p)) for i, p in enumerate(prompts)], new_requests=new, params=[params])
    step, forgotten = 0, set()
    while True:
        result = runner.execute(plan)
        logprobs.append(result.logprobs)
        for rid, tok in zip(result.req_ids, result.token_ids, strict=True):
            tokens[rid].append(tok)
            outputs[rid].append(tok)
        live = [i for i in outputs if len(outputs[i]) < FINISH_AFTER[i]]
        done = [i for i in outputs if i not in live and i not in forgotten]
        forgotten.update(done)
        step += 1
        if not live:
            break
        plan = StepPlan(step, [(i, 1) for i in live], finished_req_ids=done, params=[params])
    return outputs, logprobs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("graphs") / "llama")


def make_runner(path: Path, **kw: object) -> ModelRunner:
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=64,
                          swap_space=0.001, num_threads=2, max_num_seqs=16, **kw)  # type: ignore[arg-type]
    runner = ModelRunner(config)
    # Stand-in for garbage in never-used memory: nothing NaN may reach an output.
    runner.kv_cache.device_cache[:, :, : runner.num_kv_blocks] = float("nan")
    return runner


class EagerGraphs(DecodeGraphs):
    """The graph path without CUDA: 'capture' keeps the forward, 'replay' re-runs it over the
    buffers at the bucket's size and full table width, as a replayed graph reads them. A real
    replay runs none of the model's Python, so what the model keeps of a pass (the layer inputs
    an EAGLE-3 head reads) is left as its last eager pass left it; only the replay returns them."""

    @classmethod
    def install(cls, runner: ModelRunner) -> EagerGraphs:
        graphs = cls(runner.decode_buffers, runner.graph_sizes)
        graphs.model = runner.model
        graphs.capture(runner._graph_forward, runner.kv_cache.null_block, runner.block_size)
        runner.graphs = graphs
        return graphs

    def capture(self, forward: DecodeForward, null_block: int, block_size: int) -> None:
        self._forward = forward
        self._graphs = dict.fromkeys(self.sizes)  # type: ignore[arg-type]
        self.replayed: list[tuple[int, int]] = []

    def replay(self, size: int, num_seqs: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        self.replayed.append((size, num_seqs))
        kept = self.model.captured
        hidden, aux = self._forward(size, self.buffers.views(size, self.buffers.max_cols))
        self.model.captured = kept
        return hidden[:num_seqs], [a[:num_seqs] for a in aux]


PARAMS = [
    EngineSamplingParams(temperature=0.0, max_tokens=None, logprobs=3),
    EngineSamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=None, logprobs=2),
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_buffered_decode_matches_general_path(checkpoint: Path, params: EngineSamplingParams) -> None:
    buffered = make_runner(checkpoint)
    general = make_runner(checkpoint)
    general.decode_buffers.max_rows = 0  # every decode step through the general batch path
    assert buffered.graphs is None  # no graphs on a CPU
    got, got_lp = drive(buffered, params)
    want, want_lp = drive(general, params)
    assert got == want
    assert got_lp == want_lp


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_padded_replay_matches_eager(checkpoint: Path, params: EngineSamplingParams) -> None:
    eager = make_runner(checkpoint)
    replayed = make_runner(checkpoint, cuda_graph_sizes=[1, 4, 8, 16])
    graphs = EagerGraphs.install(replayed)
    got, got_lp = drive(replayed, params)
    want, want_lp = drive(eager, params)
    assert got == want
    for a, b in zip(got_lp, want_lp, strict=True):
        assert (a is None) == (b is None)
        for x, y in zip(a or [], b or [], strict=True):
            assert x.token_id == y.token_id and x.top_token_ids == y.top_token_ids
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
    sizes = {size for size, _ in graphs.replayed}
    assert {size for size, n in graphs.replayed if n < size}, "no step was padded"
    assert sizes <= {1, 4, 8, 16} and len(sizes) >= 3
    assert all(size == bucket_size(n, [1, 4, 8, 16]) for size, n in graphs.replayed)


def test_replay_gives_an_eagle3_head_the_layer_inputs_of_eager_steps(tmp_path: Path) -> None:
    """Decode steps replayed with an EAGLE-3 head: the head reads the target's kept layer inputs
    of every step, which come out of the graph (a replay runs none of the model's Python). Its
    outputs after every step are the eager runner's, and so are the tokens."""
    target = make_checkpoint("llama", tmp_path / "target", num_hidden_layers=4)
    # Layer 0's input is the embedding (kept as a copy), the others the residual stream's sum.
    head = write_eagle3_head(target, tmp_path / "head", aux=[0, 2, 3])
    _replayed_as_eager(target, SpeculativeConfig(method="eagle3", model=str(head), num_speculative_tokens=3))


def test_replay_gives_an_mtp_layer_the_outputs_of_eager_steps(tmp_path: Path) -> None:
    """Decode steps replayed with a MiMo checkpoint's MTP layer drafting: the layer reads the
    target's output rows as the replay returns them (views of the graph's buffers, valid until
    the next replay); its outputs after every step are the eager runner's, and so are the tokens."""
    target = make_checkpoint("mimo", tmp_path / "mimo", num_hidden_layers=3)
    _replayed_as_eager(target, SpeculativeConfig(method="mtp", model=str(target), num_speculative_tokens=2))


def _replayed_as_eager(target: Path, spec: SpeculativeConfig) -> None:
    """The same decode steps eager and through padded replays: the same tokens, and the head's
    outputs after every step (more steps than replays: the prompts' run eager)."""
    eager = make_runner(target, speculative_config=spec)
    replayed = make_runner(target, speculative_config=spec, cuda_graph_sizes=[1, 4, 8, 16])
    graphs = EagerGraphs.install(replayed)
    want_heads, got_heads = _head_outputs(eager), _head_outputs(replayed)
    want, _ = drive(eager, PARAMS[0])
    got, _ = drive(replayed, PARAMS[0])
    assert got == want
    assert graphs.replayed and {size for size, n in graphs.replayed if n < size}
    assert len(got_heads) == len(want_heads) > len(graphs.replayed)
    assert_same_head_outputs(got_heads, want_heads, 1e-5)


def assert_same_head_outputs(got: list[dict[int, tuple[int, torch.Tensor]]],
                             want: list[dict[int, tuple[int, torch.Tensor]]], tol: float) -> None:
    """Step by step, the same requests with the head's outputs at the same positions."""
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys() and g, f"step {step}"
        for rid in w:
            assert g[rid][0] == w[rid][0], f"step {step} request {rid}: the head's position"
            torch.testing.assert_close(g[rid][1], w[rid][1], rtol=tol, atol=tol)


def _head_outputs(runner: ModelRunner) -> list[dict[int, tuple[int, torch.Tensor]]]:
    """After each step, the head's last output per request (position, output), as it keeps them."""
    seen: list[dict[int, tuple[int, torch.Tensor]]] = []
    drafter = runner.drafter
    stepped = drafter.stepped

    def record(batch: object, requests: object) -> None:
        stepped(batch, requests)
        seen.append({rid: (pos, out.clone()) for rid, (pos, out) in drafter.last.items()})

    drafter.stepped = record
    return seen


# -- flags ------------------------------------------------------------------------


def test_flags_reach_the_config() -> None:
    import argparse

    from noria.frontend.cli import add_engine_args, engine_flags
    from noria.frontend.startup import make_config

    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    config = make_config("demo", **engine_flags(ap.parse_args(["--enforce-eager", "--cuda-graph-sizes", "1", "4"])))
    assert config.enforce_eager is True and config.cuda_graph_sizes == [1, 4]
    default = make_config("demo", **engine_flags(ap.parse_args([])))
    assert default.enforce_eager is False and default.cuda_graph_sizes is None
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        make_config("demo", cuda_graph_sizes=[0, 4])
