"""protocol/score.py without a server: how a checkpoint (and --hf-overrides) says it classifies,
what it refuses in one sentence, and the head the worker builds from the checkpoint files."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from noria.frontend.cli_args import add_engine_args, engine_flags
from noria.protocol.model_spec import read_spec
from noria.protocol.pooling import PoolingSpec
from noria.protocol.score import QWEN3_PREFIX, ScoreSpec, engine_score, pair_texts, score_spec
from noria.worker.pooling import Pooler
from noria.worker.score_head import score_head
from tests.tiny_models import make_checkpoint

RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["Ġ1", "Ġ2"],
            "is_original_qwen3_reranker": True}


@pytest.fixture(scope="module")
def causal(tmp_path_factory, demo_path) -> Path:
    path = make_checkpoint("qwen3", tmp_path_factory.mktemp("causal") / "q", vocab_size=706)
    shutil.copy(demo_path / "tokenizer.json", path / "tokenizer.json")
    return path


def _config(tmp_path: Path, **cfg: object) -> Path:
    base = {"architectures": ["LlamaForSequenceClassification"], "model_type": "llama", "vocab_size": 64,
            "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "rms_norm_eps": 1e-6, **cfg}
    (tmp_path / "config.json").write_text(json.dumps(base))
    return tmp_path


def test_classifier_checkpoint(tmp_path):
    path = _config(tmp_path, id2label={"0": "bad", "1": "good"}, pad_token_id=3)
    spec = score_spec(path)
    assert spec is not None and spec.from_checkpoint and spec.labels == ("bad", "good")
    assert spec.activation == "softmax" and spec.pad_token_id == 3 and spec.architecture == "LlamaForSequenceClassification"
    # The decoder is Llama's, and no lm_head is expected of it.
    model = read_spec(path)
    assert model.architecture == "LlamaForCausalLM" and model.tie_word_embeddings
    assert score_spec(_config(tmp_path, num_labels=1)).activation == "sigmoid"  # type: ignore[union-attr]
    assert score_spec(_config(tmp_path, problem_type="multi_label_classification")).activation == "sigmoid"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="--runner pooling"):
        engine_score(path, "generate", None, None, None)
    with pytest.raises(ValueError, match="--pooling mean"):
        engine_score(path, "pooling", None, None, "mean")
    assert engine_score(_config(tmp_path, architectures=["LlamaForCausalLM"]), "pooling", None, None, "last") is None


def test_reranker_overrides(causal):
    from transformers import AutoTokenizer

    spec = score_spec(causal, RERANKER)
    assert spec is not None
    assert list(spec.token_ids) == AutoTokenizer.from_pretrained(str(causal)).convert_tokens_to_ids(["Ġ1", "Ġ2"])
    assert spec.two_way and spec.num_labels == 1 and spec.activation == "sigmoid" and spec.qwen3_template
    assert engine_score(causal, "generate", RERANKER, None, None) is None  # the causal LM still generates
    # The head: the "yes" row minus the "no" row of the lm_head, read from the checkpoint.
    from safetensors.torch import load_file

    weights = load_file(str(causal / "model.safetensors"))
    lm_head = weights["lm_head.weight"]
    no, yes = spec.token_ids
    head = score_head(causal, spec, torch.device("cpu"))
    assert torch.equal(head, (lm_head[yes] - lm_head[no]).unsqueeze(0).float())


@pytest.mark.parametrize(("overrides", "match"), [
    ({"hidden_size": 8}, "not one noria applies"),
    ({**RERANKER, "classifier_from_token": ["Ġ1", "not-a-token"]}, "not a token"),
    ({**RERANKER, "classifier_from_token": ["Ġ1"]}, "two tokens"),
    ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["Ġ1", "Ġ2"]}, "method"),
    ({"classifier_from_token": ["Ġ1", "Ġ2"], "method": "no_post_processing"}, "ForSequenceClassification"),
])
def test_bad_overrides_are_one_sentence(causal, overrides, match):
    with pytest.raises(ValueError, match=match):
        score_spec(causal, overrides)


def test_hf_overrides_flag_and_template():
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    assert engine_flags(ap.parse_args(["--runner", "pooling", "--hf-overrides", json.dumps(RERANKER)])) == {
        "runner": "pooling", "hf_overrides": RERANKER}
    with pytest.raises(SystemExit):
        ap.parse_args(["--hf-overrides", "[1]"])
    qwen = ScoreSpec(num_labels=1, labels=("LABEL_0",), activation="sigmoid", token_ids=(1, 2), qwen3_template=True)
    first, second = pair_texts(qwen, "q", "d")
    assert first.startswith(QWEN3_PREFIX) and first.endswith("<Query>: q\n") and second.startswith("<Document>: d")
    assert pair_texts(qwen, first, second) == (first, second)  # already formatted: as sent


def test_pooler_head_needs_last_token():
    head = torch.ones(1, 4)
    with pytest.raises(ValueError, match="last token"):
        Pooler(PoolingSpec("mean"), head)
