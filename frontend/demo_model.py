"""The embedded `demo` model: a tiny Llama with seeded random weights and a real
byte-level BPE tokenizer, written as a normal Hugging Face checkpoint folder into
the user's cache on first use, with no network.

Weights are drawn with numpy (the frontend does not import torch) and written
with safetensors, so the worker loads them through the ordinary loading code.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from noria.protocol import switches

DEMO_VERSION = 1
DEMO_NAME = "demo"

_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "float32",
}

_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# A small corpus so the BPE learns real English merges; the text is ours.
_CORPUS = """
A water wheel turns in the stream. Its buckets fill at the bottom and empty at the top,
and no bucket waits for the others. The mill grinds grain all day while the river runs.
Continuous batching works the same way: every step, finished sequences leave the batch
and waiting ones board, so the accelerator never idles while a slow request finishes.
The quick brown fox jumps over the lazy dog. Hello, world! How are you today?
Language models predict the next token from the tokens before it. A token may be a word,
a piece of a word, a number such as 42 or 3.14159, or punctuation like commas, periods,
question marks and quotes. Caches keep keys and values for every token already seen.
Once upon a time there was a small village by a river. The people of the village built
a wheel of wood and iron, and the wheel lifted water into the fields of wheat and barley.
Servers answer requests from many clients at once; each request streams its tokens back
as soon as they are ready, and each ends with exactly one final message.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 2025 2026. Letters: a b c d e f g h i j k l m
n o p q r s t u v w x y z. Unicode: café, naïve, façade, 東京, 你好, Привет, 🙂, ✓.
"""


def cache_root() -> Path:
    return switches.cache_dir()


def demo_path() -> Path:
    return cache_root() / f"demo-v{DEMO_VERSION}"


def resolve_model(model: str) -> str:
    """Turn a model argument into a local checkpoint folder (building `demo`, or a GGUF file's
    view, if needed)."""
    if model == DEMO_NAME:
        return str(ensure_demo())
    if model.lower().endswith(".gguf"):  # a folder view of the file (frontend/gguf_view.py)
        from noria.frontend.gguf_view import gguf_view

        return str(gguf_view(model))
    if os.path.isdir(model):
        return os.path.abspath(model)
    raise FileNotFoundError(
        f"model {model!r} is not a local checkpoint folder (config.json, *.safetensors, "
        "tokenizer files) and this machine cannot download from a model hub"
    )


def ensure_demo() -> Path:
    path = demo_path()
    if (path / "complete").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so concurrent builders never see half a folder.
    tmp = Path(tempfile.mkdtemp(prefix="demo-build-", dir=path.parent))
    try:
        _build(tmp)
        (tmp / "complete").write_text("ok\n")
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / "complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _build(out: Path) -> None:
    vocab_size = _build_tokenizer(out)
    config = dict(_CONFIG, vocab_size=vocab_size, bos_token_id=0, eos_token_id=1)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": [1, 4]}, indent=2)
    )
    _write_weights(out, config)


def _build_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|end_of_text|>",
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return tok.get_vocab_size()


def _write_weights(out: Path, cfg: dict) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(20261121)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": np.ones(h, np.float32)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(h, h),
            p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.o_proj.weight": w(h, h),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
        }
    # A sharper head than 0.02 so greedy text is not dominated by ties.
    tensors["lm_head.weight"] = (rng.standard_normal((v, h)) * 0.5).astype(np.float32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
