"""What a `--runner pooling` engine scores with, when it classifies: a sequence-classification
checkpoint's `score` head, or a causal LM scored by some of its tokens' logits (vLLM's
`--hf-overrides` conversion). Read from the checkpoint folder without torch, so that the
frontend (how a pair is tokenized, which activation, the labels) and the workers (the head)
agree.

* A checkpoint whose `architectures` name a `...ForSequenceClassification` has a `score`
  head [num_labels, hidden] over the final hidden state of the last non-pad token, as
  transformers' AutoModelForSequenceClassification reads it.
* `classifier_from_token` (with `method` "from_2_way_softmax" or "no_post_processing", or
  `is_original_qwen3_reranker`, which implies the former): the head is made of the lm_head
  rows of those tokens, as vLLM makes it. From two tokens [false, true], one row,
  true - false, so that sigmoid(score) = softmax over the two logits = p(true).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from noria.protocol.model_spec import read_config
from noria.protocol.validation import json_flag

Activation = Literal["sigmoid", "softmax", "identity"]
_METHODS = ("from_2_way_softmax", "no_post_processing")
_CLASSIFIER = "ForSequenceClassification"
# The config.json keys --hf-overrides may set: the ones that say how the model classifies.
OVERRIDABLE = frozenset({"architectures", "classifier_from_token", "method", "is_original_qwen3_reranker",
                         "num_labels", "id2label", "label2id", "pad_token_id", "problem_type"})

# vLLM's template for the original Qwen3-Reranker (its docs and its offline Qwen3-Reranker example),
# which a client formatting the pair itself sends ready-made.
QWEN3_PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the '
                'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


class ScoreSpec(msgspec.Struct, frozen=True, kw_only=True):
    num_labels: int
    labels: tuple[str, ...]
    activation: Activation
    # Empty: the checkpoint's `score.weight`; else the lm_head rows of these token ids.
    token_ids: tuple[int, ...] = ()
    two_way: bool = False  # one row: token_ids[1]'s minus token_ids[0]'s
    # transformers pools at the last token that is not this one (a classifier checkpoint's rule).
    pad_token_id: int | None = None
    qwen3_template: bool = False
    architecture: str = ""

    @property
    def from_checkpoint(self) -> bool:
        return not self.token_ids


def is_classifier(config: Mapping[str, Any]) -> bool:
    return any(isinstance(a, str) and a.endswith(_CLASSIFIER) for a in config.get("architectures") or ())


def parse_overrides(text: str) -> dict[str, Any]:
    """`--hf-overrides`: a JSON object of config.json keys (vLLM's flag)."""
    return json_flag(text, "--hf-overrides", "config.json keys")


def score_spec(model_path: str | Path, overrides: Mapping[str, Any] | None = None,
               tokenizer_path: str | Path | None = None) -> ScoreSpec | None:
    """How the checkpoint at `model_path` (its config.json with `overrides` on top) classifies;
    None for a model that does not. ValueError says what cannot be followed."""
    unknown = sorted(set(overrides or {}) - OVERRIDABLE)
    if unknown:
        raise ValueError(f"--hf-overrides key {unknown[0]!r} is not one noria applies; it takes "
                         f"{', '.join(sorted(OVERRIDABLE))}")
    cfg = {**read_config(model_path), **(overrides or {})}
    tokens = cfg.get("classifier_from_token")
    method = cfg.get("method") or ("from_2_way_softmax" if cfg.get("is_original_qwen3_reranker") else None)
    if not is_classifier(cfg):
        if tokens is not None or method is not None:
            raise ValueError("classifier_from_token needs \"architectures\": [\"...ForSequenceClassification\"] "
                             "in --hf-overrides too, as vLLM's")
        return None
    arch = next(a for a in cfg["architectures"] if a.endswith(_CLASSIFIER))
    ids: tuple[int, ...] = ()
    if tokens is not None or method is not None:
        if method not in _METHODS:
            raise ValueError(f"classifier_from_token needs \"method\" ({' or '.join(_METHODS)}) or "
                             "\"is_original_qwen3_reranker\": true in --hf-overrides")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise ValueError("classifier_from_token must be a list of token strings, e.g. [\"no\", \"yes\"]")
        if method == "from_2_way_softmax" and len(tokens) != 2:
            raise ValueError(f"from_2_way_softmax takes two tokens [false, true], got {len(tokens)}")
        ids = tuple(token_ids(Path(tokenizer_path or model_path), tokens))
        num_labels = 1 if method == "from_2_way_softmax" else len(ids)
    else:
        num_labels = _num_labels(cfg)
    labels = _labels(cfg, num_labels)
    problem = cfg.get("problem_type")
    activation: Activation = ("identity" if problem == "regression" else
                              "sigmoid" if problem == "multi_label_classification" or num_labels == 1 else "softmax")
    pad = cfg.get("pad_token_id")
    return ScoreSpec(num_labels=num_labels, labels=labels, activation=activation, token_ids=ids,
                     two_way=method == "from_2_way_softmax",
                     pad_token_id=pad if isinstance(pad, int) and not ids else None,
                     qwen3_template=bool(cfg.get("is_original_qwen3_reranker")), architecture=arch)


def _num_labels(cfg: Mapping[str, Any]) -> int:
    id2label = cfg.get("id2label")
    if isinstance(id2label, Mapping) and id2label:
        return len(id2label)
    return int(cfg.get("num_labels") or 2)  # transformers' default


def _labels(cfg: Mapping[str, Any], num_labels: int) -> tuple[str, ...]:
    id2label = cfg.get("id2label")
    if isinstance(id2label, Mapping) and len(id2label) == num_labels:
        try:
            return tuple(str(id2label[k]) for k in sorted(id2label, key=int))
        except ValueError:
            pass
    return tuple(f"LABEL_{i}" for i in range(num_labels))


def token_ids(folder: Path, tokens: list[str]) -> list[int]:
    """The ids of `tokens` as the tokenizer's convert_tokens_to_ids gives them (added tokens
    first, then the model's vocabulary), read from tokenizer.json."""
    path = folder / "tokenizer.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"classifier_from_token needs the tokenizer's {path}: {e}") from None
    vocab: dict[str, int] = {}
    model_vocab = (data.get("model") or {}).get("vocab")
    if isinstance(model_vocab, dict):
        vocab.update(model_vocab)
    elif isinstance(model_vocab, list):  # Unigram: [piece, score] by id
        vocab.update({entry[0]: i for i, entry in enumerate(model_vocab)})
    for added in data.get("added_tokens") or ():
        vocab[added["content"]] = added["id"]
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ValueError(f"classifier_from_token {missing[0]!r} is not a token of {path}")
    return [vocab[t] for t in tokens]


def pair_texts(spec: ScoreSpec, text_1: str, text_2: str) -> tuple[str, str]:
    """The two texts a cross-encoder pair is tokenized from: the Qwen3-Reranker's template around
    them (unless the client already formatted them, as vLLM's example does), else as given."""
    if not spec.qwen3_template or text_1.startswith(QWEN3_PREFIX):
        return text_1, text_2
    return (f"{QWEN3_PREFIX}<Instruct>: {QWEN3_INSTRUCTION}\n<Query>: {text_1}\n",
            f"<Document>: {text_2}{QWEN3_SUFFIX}")


def engine_score(model_path: str | Path, runner: str, overrides: Mapping[str, Any] | None,
                 tokenizer_path: str | Path | None, pooling: str | None) -> ScoreSpec | None:
    """What an engine scores with (None: it embeds or generates); ValueError for a runner or
    pooling the checkpoint cannot serve."""
    spec = score_spec(model_path, overrides, tokenizer_path)
    if spec is None:
        return None
    if runner != "pooling":
        if spec.from_checkpoint:
            raise ValueError(f"{spec.architecture} is a sequence-classification checkpoint (a score head, no "
                             "language-model head): serve it with --runner pooling")
        return None  # a causal LM generates as itself; the overrides matter to a pooling engine only
    if pooling not in (None, "last"):
        raise ValueError(f"{spec.architecture} classifies from the last token: --pooling {pooling} does not apply")
    return spec
