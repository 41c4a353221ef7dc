"""Half precision end to end on the CPU (torch attention backend): `dtype="bfloat16"` and
`"float16"` through the whole engine (real processes), against transformers run in the same
dtype, compared on log-probabilities, not only on tokens.

The tolerance. noria and transformers compute the same network with different roundings
(noria fuses the Q/K/V and gate/up projections, runs its own paged attention and keeps the
KV cache in the model dtype), so in half precision each logit carries a rounding error of a
few units in the last place of the dtype at the logits' scale (about 1 here). A logprob is a
logit minus a log-sum-exp, so its error is of the same size. We allow 8 ulps of the dtype at
1.0 (torch.finfo(dtype).eps: 2^-7 for bfloat16, 2^-10 for float16), i.e. 0.0625 and 0.0078;
the measured worst case on these prompts is about 2 ulps (0.015 and 0.002). A real error (a
wrong position, a stale KV block, a dtype mix-up in attention) moves logprobs by far more.
Tokens are teacher-forced: transformers scores noria's own sequence, so one near-tie that
rounds the other way does not derail the comparison; each noria token must also be the
reference argmax up to the same tolerance.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from noria import LLM, SamplingParams
from tests.tiny_models import make_checkpoint

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
ULPS = 8


def _tolerance(dtype: torch.dtype) -> float:
    return ULPS * torch.finfo(dtype).eps


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, demo_path: Path) -> Path:
    path = make_checkpoint("llama", tmp_path_factory.mktemp("half") / "llama", seed=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (demo_path / name).exists():
            shutil.copy(demo_path / name, path / name)
    return path


def _reference_logprobs(path: Path, dtype: torch.dtype, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), vocab] float32 logprobs of transformers in `dtype`, teacher-forced."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    start = len(prompt) - 1
    return torch.log_softmax(logits, -1)[start : start + len(generated)]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_half_precision_engine_matches_transformers_logprobs(checkpoint: Path, dtype_name: str) -> None:
    dtype = DTYPES[dtype_name]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (7, 30, 61)]
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=1, ignore_eos=True)
    with LLM(str(checkpoint), dtype=dtype_name, max_num_seqs=4, max_num_batched_tokens=48,
             num_kv_blocks=32, block_size=16) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    tol = _tolerance(dtype)
    for prompt, out in zip(prompts, outs, strict=True):
        done = out.outputs[0]
        assert len(done.token_ids) == 10 and done.logprobs is not None
        ref = _reference_logprobs(checkpoint, dtype, prompt, done.token_ids)
        ids = torch.tensor(done.token_ids)
        ref_chosen = ref[torch.arange(len(ids)), ids]
        got = torch.tensor([lp.logprob for lp in done.logprobs])
        assert (got - ref_chosen).abs().max().item() <= tol, (got, ref_chosen)
        # Greedy: each token is transformers' argmax up to the same tolerance.
        assert (ref.max(-1).values - ref_chosen).max().item() <= tol
