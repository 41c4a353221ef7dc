"""/v1/score, /v1/rerank, /rerank, /v2/rerank and /classify against live `noria serve --runner
pooling` servers, each checked against transformers on the same checkpoint and token ids:

* a random LlamaForSequenceClassification (one label, a pad token some inputs end with), behind
  --api-key: scores, the `cohere` SDK's rerank (v1 and v2 clients, unmodified), plain-HTTP
  rerank, and the errors;
* a random Qwen3ForSequenceClassification with three named labels: /classify's softmax;
* a random Qwen3 causal LM served the Qwen3-Reranker way (--hf-overrides): sigmoid of the
  difference of two tokens' logits over vLLM's template;
* the demo model generating: every scoring endpoint is a 400 naming its runner.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import cohere
import pytest
import torch

from noria.protocol.score import QWEN3_INSTRUCTION, QWEN3_PREFIX, QWEN3_SUFFIX
from tests.procs import scrape_metrics, serve_http
from tests.test_embeddings import with_tokenizer
from tests.tiny_models import make_checkpoint, tiny_config

KEY = "sk-score-test"
MAX_LEN = 128
TOL = 1e-4
PAD = 18  # the demo tokenizer's ".": inputs ending with it are scored at the token before
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow", "The capital city of France is Paris, a city on "
        "the Seine with many museums, bridges and old streets, long enough to take two steps.", "x", "Berlin."]


def _vocab(demo_path: Path) -> int:
    return json.loads((demo_path / "config.json").read_text())["vocab_size"]


def _classifier(arch: str, path: Path, demo_path: Path, num_labels: int, **extra: Any) -> Path:
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging

    logging.disable_progress_bar()
    cfg = tiny_config(arch, vocab_size=_vocab(demo_path), num_labels=num_labels, **extra)
    torch.manual_seed(3)
    model = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(str(path))
    return with_tokenizer(path, demo_path)


@pytest.fixture(scope="module")
def tokenizer(demo_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_path))


def _serve(path: Path, *extra: str, max_len: int = MAX_LEN) -> Any:
    # 32 tokens a step: the longer pairs are computed over several steps.
    return serve_http("--model", str(path), "--runner", "pooling", "--dtype", "float32", "--num-kv-blocks",
                      str(max_len // 4), "--max-model-len", str(max_len), "--max-num-batched-tokens", "32", *extra)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, demo_path):
    path = _classifier("llama", tmp_path_factory.mktemp("cls") / "llama", demo_path, 1, pad_token_id=PAD)
    with _serve(path, "--api-key", KEY) as s:
        yield s, path


def _post(url: str, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _seq_cls_logits(path: Path, ids: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([i])).logits[0].double() for i in ids]


def _pair_ids(tokenizer: Any, pairs: list[tuple[str, str]]) -> list[list[int]]:
    return [tokenizer(a, b)["input_ids"] for a, b in pairs]


def test_score_matches_transformers(llama, tokenizer):
    served, path = llama
    ids = _pair_ids(tokenizer, [(QUERY, d) for d in DOCS])
    assert max(len(i) for i in ids) > 32 and ids[0][-1] == PAD  # chunked, and one scored before its pad
    want = [torch.sigmoid(x)[0].item() for x in _seq_cls_logits(path, ids)]
    status, out = _post(f"{served.http}/v1/score", {"model": str(path), "text_1": QUERY, "text_2": DOCS})
    assert status == 200, out
    assert out["object"] == "list" and out["model"] == str(path) and out["id"].startswith("score-")
    assert [(d["index"], d["object"]) for d in out["data"]] == [(i, "score") for i in range(len(DOCS))]
    assert max(abs(d["score"] - w) for d, w in zip(out["data"], want, strict=True)) < TOL
    assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] > 0
    # Two lists pair index by index; one text_1 in a list is broadcast.
    status, zipped = _post(f"{served.http}/v1/score", {"text_1": [QUERY, DOCS[1]], "text_2": [DOCS[0], QUERY]})
    assert status == 200, zipped
    back = [torch.sigmoid(x)[0].item() for x in _seq_cls_logits(path, _pair_ids(tokenizer, [(DOCS[1], QUERY)]))]
    assert abs(zipped["data"][0]["score"] - want[0]) < TOL and abs(zipped["data"][1]["score"] - back[0]) < TOL
    status, one = _post(f"{served.http}/v1/score", {"text_1": [QUERY], "text_2": DOCS[:2]})
    assert status == 200 and [round(d["score"], 4) for d in one["data"]] == [round(w, 4) for w in want[:2]]
    # /classify of one text: the one label's sigmoid.
    status, cls = _post(f"{served.http}/classify", {"input": [DOCS[1]]})
    solo = _seq_cls_logits(path, [tokenizer(DOCS[1])["input_ids"]])[0]
    assert status == 200 and cls["data"][0]["num_classes"] == 1
    assert abs(cls["data"][0]["probs"][0] - torch.sigmoid(solo)[0].item()) < TOL


def test_cohere_sdk_rerank(llama, tokenizer):
    served, path = llama
    want = [torch.sigmoid(x)[0].item() for x in _seq_cls_logits(path, _pair_ids(tokenizer, [(QUERY, d) for d in DOCS]))]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    before = scrape_metrics(served.http).get('noria_request_success_total{finish_reason="stop"}', 0)
    v1 = cohere.Client(api_key=KEY, base_url=served.http, timeout=60)
    res = v1.rerank(model=str(path), query=QUERY, documents=DOCS, top_n=3, return_documents=True)
    assert [r.index for r in res.results] == order[:3]
    for r in res.results:
        assert abs(r.relevance_score - want[r.index]) < TOL and r.document.text == DOCS[r.index]
    v2 = cohere.ClientV2(api_key=KEY, base_url=served.http, timeout=60)
    res2 = v2.rerank(model=str(path), query=QUERY, documents=DOCS)
    assert [r.index for r in res2.results] == order
    # Every pair counted as a request, as /v1/chat/completions counts its requests.
    after = scrape_metrics(served.http)['noria_request_success_total{finish_reason="stop"}']
    assert after - before == 2 * len(DOCS)
    with pytest.raises(cohere.core.api_error.ApiError) as e:
        cohere.Client(api_key="wrong", base_url=served.http, timeout=60).rerank(query=QUERY, documents=DOCS)
    assert e.value.status_code == 401


def test_rerank_plain_http(llama):
    served, _ = llama
    docs = [{"text": d} for d in DOCS]
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        status, out = _post(f"{served.http}{path}", {"query": QUERY, "documents": docs, "return_documents": False})
        assert status == 200, out
        scores = [r["relevance_score"] for r in out["results"]]
        assert sorted(r["index"] for r in out["results"]) == list(range(len(DOCS)))
        assert scores == sorted(scores, reverse=True) and all("document" not in r for r in out["results"])
        assert out["usage"]["total_tokens"] > 0 and out["id"].startswith("rerank-")
    status, top = _post(f"{served.http}/rerank", {"query": QUERY, "documents": DOCS, "top_n": 1})
    assert status == 200 and len(top["results"]) == 1 and top["results"][0]["index"] == out["results"][0]["index"]
    assert top["results"][0]["document"] == {"text": DOCS[top["results"][0]["index"]]}


@pytest.mark.parametrize(("path", "body", "param", "code"), [
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents", "invalid_request"),
    ("/v1/rerank", {"query": QUERY, "documents": ["ok", "word " * MAX_LEN]}, "documents", "prompt_too_long"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n", "invalid_request"),
    ("/v1/rerank", {"query": QUERY, "documents": [{"title": "no text"}]}, "documents", "invalid_request"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2", "invalid_request"),
    ("/v1/score", {"text_1": "word " * MAX_LEN, "text_2": "b"}, "text_1", "prompt_too_long"),
    ("/v1/score", {"text_1": [], "text_2": "b"}, "text_1", "invalid_request"),
    ("/classify", {"input": ""}, "input", "invalid_request"),
    ("/v1/embeddings", {"input": "a"}, None, "invalid_request"),
])
def test_bad_requests_are_400(llama, path, body, param, code):
    served, _ = llama
    status, out = _post(f"{served.http}{path}", body)
    assert status == 400, out
    assert out["error"]["param"] == param and out["error"]["code"] == code, out
    if path == "/v1/embeddings":
        assert "classifies" in out["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/score", "/v1/rerank", "/rerank", "/v2/rerank", "/classify"])
def test_api_key_guards_every_endpoint(llama, path):
    served, _ = llama
    body = {"text_1": "a", "text_2": "b", "query": "a", "documents": ["b"], "input": "a"}
    assert _post(f"{served.http}{path}", body, key=None)[0] == 401
    assert _post(f"{served.http}{path}", body, key="nope")[0] == 401


def test_classify_labels_match_transformers(tmp_path, demo_path, tokenizer):
    path = _classifier("qwen3", tmp_path / "qwen3", demo_path, 3, id2label=LABELS,
                       label2id={v: k for k, v in LABELS.items()})
    texts = ["I loved it", DOCS[2], "meh"]
    want = [torch.softmax(x, -1) for x in _seq_cls_logits(path, [tokenizer(t)["input_ids"] for t in texts])]
    with _serve(path) as served:
        status, out = _post(f"{served.http}/classify", {"model": str(path), "input": texts}, key=None)
        assert status == 200, out
        assert out["object"] == "list" and out["id"].startswith("classify-")
        for d, w in zip(out["data"], want, strict=True):
            assert d["num_classes"] == 3 and abs(sum(d["probs"]) - 1) < 1e-6
            assert (torch.tensor(d["probs"], dtype=torch.float64) - w).abs().max().item() < TOL
            assert d["label"] == LABELS[int(w.argmax())]
        assert out["usage"]["prompt_tokens"] == sum(len(tokenizer(t)["input_ids"]) for t in texts)
        status, err = _post(f"{served.http}/v1/score", {"text_1": "a", "text_2": "b"}, key=None)
        assert status == 400 and "3 labels" in err["error"]["message"]


def test_qwen3_reranker_style(tmp_path, demo_path, tokenizer):
    """A causal LM scored by two tokens' logits, configured as vLLM's --hf-overrides configures it."""
    from transformers import AutoModelForCausalLM

    path = with_tokenizer(make_checkpoint("qwen3", tmp_path / "rr", tied=True, vocab_size=_vocab(demo_path)), demo_path)
    no, yes = "Ġ1", "Ġ2"  # two tokens of the demo vocabulary stand for "no" and "yes"
    no_id, yes_id = tokenizer.convert_tokens_to_ids([no, yes])
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes],
                 "is_original_qwen3_reranker": True}
    query = f"{QWEN3_PREFIX}<Instruct>: {QWEN3_INSTRUCTION}\n<Query>: {QUERY}\n"
    ids = _pair_ids(tokenizer, [(query, f"<Document>: {d}{QWEN3_SUFFIX}") for d in DOCS[:3]])
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        last = [model(torch.tensor([i])).logits[0, -1].double() for i in ids]
    want = [torch.sigmoid(x[yes_id] - x[no_id]).item() for x in last]
    assert max(len(i) for i in ids) > MAX_LEN  # the template is long in the demo vocabulary
    with _serve(path, "--hf-overrides", json.dumps(overrides), max_len=4 * MAX_LEN) as served:
        status, out = _post(f"{served.http}/v1/rerank", {"query": QUERY, "documents": DOCS[:3]}, key=None)
        assert status == 200, out
        got = {r["index"]: r["relevance_score"] for r in out["results"]}
        assert max(abs(got[i] - w) for i, w in enumerate(want)) < TOL
        # A client that formats the pair itself, as vLLM's example does, gets the same scores.
        status, pre = _post(f"{served.http}/v1/score", {"text_1": query, "text_2": [f"<Document>: {d}{QWEN3_SUFFIX}"
                                                                                   for d in DOCS[:3]]}, key=None)
        assert status == 200 and max(abs(d["score"] - w) for d, w in zip(pre["data"], want, strict=True)) < TOL


def test_generate_server_refuses_scoring(demo_path):
    with serve_http("--num-kv-blocks", "16") as s:
        for path, body in [("/v1/rerank", {"query": "q", "documents": ["d"]}),
                           ("/v1/score", {"text_1": "a", "text_2": "b"}), ("/classify", {"input": "a"})]:
            status, out = _post(f"{s.http}{path}", body, key=None)
            assert status == 400 and "generate runner" in out["error"]["message"], out
