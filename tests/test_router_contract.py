"""What routers read from an engine (docs/protocol.md, "Metrics" and "For routers"), on a real
`noria serve`: vLLM's metric names beside noria's with the same numbers, /load, /get_load,
/get_server_info, /v1/models' lineage fields, and the render endpoints, whose token ids must be
the ones generation runs."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import msgspec
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.procs import engine_idle, serve_http, wait_metrics

LABELS = '{engine="0",model_name="demo"}'


@pytest.fixture(scope="module")
def served(demo_path):
    with serve_http("--num-kv-blocks", "128", "--max-model-len", "1024") as s:
        yield s


@pytest.fixture(scope="module")
def oai(served):
    with openai.OpenAI(base_url=f"{served.http}/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def _get(url: str) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, msgspec.json.decode(r.read())
    except urllib.error.HTTPError as e:
        return e.code, msgspec.json.decode(e.read())


def _post(url: str, body: dict) -> tuple[int, object]:
    req = urllib.request.Request(url, data=msgspec.json.encode(body), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, msgspec.json.decode(r.read())
    except urllib.error.HTTPError as e:
        return e.code, msgspec.json.decode(e.read())


def _families(http: str) -> dict[str, object]:
    with urllib.request.urlopen(f"{http}/metrics", timeout=10) as r:
        return {f.name: f for f in text_string_to_metric_families(r.read().decode())}


def test_vllm_metrics_mirror_noria_numbers(served, oai):
    prompts = ["one two three", "the quick brown fox jumps over the lazy dog " * 4]
    usages = [oai.completions.create(model="demo", prompt=p, max_tokens=5, temperature=0).usage for p in prompts]
    generated = sum(u.completion_tokens for u in usages)
    # A scrape answers with the engine's last published stats (and asks for fresh ones): wait until
    # they count both requests, and the bridge has observed both.
    m = wait_metrics(served.http, lambda m: engine_idle(m) and m["noria_generation_tokens_total"] == generated
                     and m.get(f"vllm:request_prompt_tokens_count{LABELS}") == 2)
    assert m[f"vllm:request_prompt_tokens_count{LABELS}"] == 2
    assert m[f"vllm:request_prompt_tokens_sum{LABELS}"] == sum(u.prompt_tokens for u in usages)
    assert m[f"vllm:request_generation_tokens_sum{LABELS}"] == sum(u.completion_tokens for u in usages)
    pairs = {"vllm:num_requests_running": "noria_num_requests_running",
             "vllm:num_requests_waiting": "noria_num_requests_waiting",
             "vllm:kv_cache_usage_perc": "noria_kv_cache_usage_ratio",
             "vllm:gpu_cache_usage_perc": "noria_kv_cache_usage_ratio",
             "vllm:prompt_tokens_total": "noria_prompt_tokens_total",
             "vllm:generation_tokens_total": "noria_generation_tokens_total",
             "vllm:prefix_cache_queries_total": "noria_prefix_cache_queries_total",
             "vllm:prefix_cache_hits_total": "noria_prefix_cache_hits_total",
             "vllm:num_preemptions_total": "noria_num_preemptions_total",
             "vllm:time_to_first_token_seconds_count": "noria_time_to_first_token_seconds_count",
             "vllm:e2e_request_latency_seconds_count": "noria_e2e_request_latency_seconds_count",
             "vllm:e2e_request_latency_seconds_sum": "noria_e2e_request_latency_seconds_sum",
             "vllm:inter_token_latency_seconds_count": "noria_inter_token_latency_seconds_count",
             "vllm:time_per_output_token_seconds_count": "noria_inter_token_latency_seconds_count"}
    for vllm_name, noria_name in pairs.items():
        assert m[vllm_name + LABELS] == m[noria_name], vllm_name
    assert m["noria_generation_tokens_total"] == sum(u.completion_tokens for u in usages)
    assert m['vllm:request_success_total{engine="0",finished_reason="length",model_name="demo"}'] == \
        m['noria_request_success_total{finish_reason="length"}'] == 2
    # The histogram's buckets are cumulative and end with +Inf holding every observation.
    assert m['vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="demo"}'] == 2

    families = _families(served.http)
    (info,) = families["vllm:cache_config_info"].samples
    assert info.value == 1
    assert info.labels["block_size"] == "16" and info.labels["engine"] == "0"
    assert int(info.labels["num_gpu_blocks"]) == m["noria_kv_cache_blocks"] == 128
    assert info.labels["cache_dtype"] == "auto" and info.labels["enable_prefix_caching"] == "True"
    (lora,) = families["vllm:lora_requests_info"].samples
    assert lora.labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert abs(lora.value - time.time()) < 600  # a reading's timestamp, as vLLM's


def _wait(check, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, what
        time.sleep(0.05)  # poll interval; the deadline only bounds a hang


def test_load_endpoints_follow_a_running_request(served, oai):
    wait_metrics(served.http, engine_idle)
    assert _get(f"{served.http}/get_load") == (200, {"load": 0, "dp_rank": 0, "num_reqs": 0, "num_running_reqs": 0,
                                                     "num_waiting_reqs": 0, "num_tokens": 0})
    assert _get(f"{served.http}/load") == (200, {"server_load": 0})
    stream = oai.completions.create(model="demo", prompt="count", max_tokens=900, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    next(iter(stream))  # running now
    load = _wait(lambda: (b := _get(f"{served.http}/get_load")[1])["num_running_reqs"] == 1 and b, "no running request")
    assert load["load"] == load["num_reqs"] == 1 and load["num_waiting_reqs"] == 0
    assert load["num_tokens"] > 0 and load["num_tokens"] % 16 == 0  # whole blocks
    assert _get(f"{served.http}/load")[1] == {"server_load": 1}
    status, info = _get(f"{served.http}/get_server_info")
    assert status == 200
    assert info["served_model_name"] == "demo" and info["max_model_len"] == 1024 and info["block_size"] == 16
    assert info["num_gpu_blocks"] == 128 and info["dp_size"] == 1 and info["status"] == "ok"
    assert info["internal_states"][0]["num_running"] == 1
    stream.close()  # hangs up: the request is aborted
    _wait(lambda: _get(f"{served.http}/get_load")[1]["load"] == 0, "the aborted request still counted")
    _wait(lambda: _get(f"{served.http}/load")[1] == {"server_load": 0}, "the aborted request still open")


def test_models_carry_vllm_lineage_fields(served):
    status, body = _get(f"{served.http}/v1/models")
    assert status == 200
    (card,) = body["data"]
    assert card["id"] == card["root"] == "demo" and card["parent"] is None


def test_completions_render_gives_the_ids_generation_runs(served, oai):
    texts = ["Hello there", "a second, longer prompt with more words in it"]
    status, rendered = _post(f"{served.http}/v1/completions/render",
                             {"model": "demo", "prompt": texts, "max_tokens": 7, "temperature": 0.5, "cache_salt": "t1"})
    assert status == 200 and len(rendered) == 2
    for text, item in zip(texts, rendered, strict=True):
        _, tok = _post(f"{served.http}/tokenize", {"prompt": text})
        assert item["token_ids"] == tok["tokens"]
        assert item["request_id"].startswith("cmpl-") and item["model"] == "demo" and item["stream"] is False
        assert item["sampling_params"]["max_tokens"] == 7 and item["sampling_params"]["temperature"] == 0.5
        assert item["cache_salt"] == "t1"
        # Generating from the rendered ids gives what generating from the text gives.
        by_text = oai.completions.create(model="demo", prompt=text, max_tokens=6, temperature=0)
        by_ids = oai.completions.create(model="demo", prompt=item["token_ids"], max_tokens=6, temperature=0)
        assert by_ids.choices[0].text == by_text.choices[0].text
        assert by_text.usage.prompt_tokens == len(item["token_ids"])
    status, (only,) = _post(f"{served.http}/v1/completions/render", {"prompt": [5, 6, 7]})
    assert status == 200 and only["token_ids"] == [5, 6, 7]


def test_chat_render_gives_the_ids_generation_runs(served, oai):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    status, item = _post(f"{served.http}/v1/chat/completions/render", {"messages": messages, "max_tokens": 6})
    assert status == 200 and isinstance(item, dict) and item["request_id"].startswith("chatcmpl-")
    chat = oai.chat.completions.create(model="demo", messages=messages, max_tokens=6, temperature=0)
    assert chat.usage.prompt_tokens == len(item["token_ids"])
    by_ids = oai.completions.create(model="demo", prompt=item["token_ids"], max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == chat.choices[0].message.content
    _, tok = _post(f"{served.http}/tokenize", {"messages": messages})
    assert tok["tokens"] == item["token_ids"]


def test_render_refuses_what_generation_refuses(served):
    status, body = _post(f"{served.http}/v1/completions/render", {"model": "other", "prompt": "x"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = _post(f"{served.http}/v1/completions/render", {"prompt": []})
    assert status == 400 and body["error"]["param"] == "prompt"
    status, body = _post(f"{served.http}/v1/chat/completions/render", {"messages": []})
    assert status == 400
    # The engine keeps serving.
    status, (item,) = _post(f"{served.http}/v1/completions/render", {"prompt": "still here"})
    assert status == 200 and item["token_ids"]
