"""GGUF files for tests, written as llama.cpp's converter writes them, by the gguf package's writer.

A tiny seeded transformers model (tests/tiny_models.py) is converted tensor by tensor: Llama's q/k
rows permuted and Gemma's norms stored as 1 + w (as llama.cpp's convert_hf_to_gguf does), each
linear weight stored in the type asked for. Q8_0, Q4_0, BF16 are quantized by the gguf package; it has
no Q4_K / Q6_K quantizer, so those blocks are packed here from ggml's documented layouts
(block_q4_K, block_q6_K) with a simple range quantizer, and tests check the packing against the
gguf package's dequantizer. The tokenizer is the demo model's byte-level BPE, written as
llama.cpp writes a "gpt2" vocabulary (tokens, token types, merges, ids, chat template).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from tests.gguf_kquants import PACKERS
from tests.tiny_models import make_model

ARCH_OF = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
           "gemma3": "gemma3"}
# Sizes whose every linear layer has K a multiple of 256 (the K-quants' block). Gemma's attention
# scale is llama.cpp's for a GGUF file (1 / sqrt(head_dim), which GGUF does not store), its
# soft-caps not transformers' defaults (only the metadata carries them).
SIZES: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                         "num_key_value_heads": 2}
OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen3": {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128},
    "gemma2": {"head_dim": 64, "query_pre_attn_scalar": 64, "attn_logit_softcapping": 20.0,
               "final_logit_softcapping": 5.0, "sliding_window": 4096, "layer_types": None,
               "num_hidden_layers": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "gemma3": {"head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 512, "layer_types": None,
               "num_hidden_layers": 2, "final_logit_softcapping": None,
               "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
}
_HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_LLAMA_NORMS = {"post_attention_layernorm": "ffn_norm"}
_GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def tiny_model(arch: str, vocab: int, **overrides: Any) -> Any:
    return make_model(arch, **{**SIZES, "vocab_size": vocab, **OVERRIDES.get(arch, {}), **overrides})


# -- Q4_K and Q6_K, packed from ggml's layouts ------------------------------------------------


def pack_q4_k(w: np.ndarray) -> np.ndarray:
    """Q4_K blocks of w [rows, K]: per 32 values a 6-bit scale and minimum of the block's f16 d
    and dmin, values q in [0, 15], w ~ d * sc * q - dmin * m."""
    rows = w.shape[0]
    g = w.reshape(rows, -1, 8, 32).astype(np.float32)
    mn = np.maximum(-g.min(-1), 0)
    scale = (g.max(-1) + mn) / 15
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mn.max(-1) / 63).astype(np.float16)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(np.divide(mn, dminf, out=np.zeros_like(mn), where=dminf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.rint(np.divide(g + (dminf * m)[..., None], step, out=np.zeros_like(g), where=step > 0))
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(rows, -1, 4, 2, 32)  # 4 chunks of 64: low, high halves
    scales = np.concatenate([(sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
                             (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)], axis=-1)
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(rows, -1, 128)
    blocks = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), scales, qs], axis=-1)
    return blocks.reshape(rows, -1)


def pack_q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K blocks of w [rows, K]: per 16 values an int8 sub-scale of the block's f16 d, values
    q in [-32, 31], w ~ d * sc * q."""
    rows = w.shape[0]
    g = w.reshape(rows, -1, 16, 16).astype(np.float32)
    scale = np.abs(g).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), -128, 127)
    step = (df * sc)[..., None]
    q = np.clip(np.rint(np.divide(g, step, out=np.zeros_like(g), where=step > 0)), -32, 31)
    u = (q + 32).astype(np.uint8).reshape(rows, -1, 2, 4, 32)  # halves of 128, quarters of 32
    ql = np.concatenate([(u[..., 0, :] & 0x0F) | ((u[..., 2, :] & 0x0F) << 4),
                         (u[..., 1, :] & 0x0F) | ((u[..., 3, :] & 0x0F) << 4)], axis=-1).reshape(rows, -1, 128)
    qh = ((u[..., 0, :] >> 4) | ((u[..., 1, :] >> 4) << 2) | ((u[..., 2, :] >> 4) << 4)
          | ((u[..., 3, :] >> 4) << 6)).reshape(rows, -1, 64)
    blocks = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d[..., None].view(np.uint8)], axis=-1)
    return blocks.reshape(rows, -1)


def encode(w: np.ndarray, kind: str) -> tuple[np.ndarray, GGMLQuantizationType]:
    """w in GGUF type `kind`: the bytes (or float array) and the type for the writer."""
    qtype = GGMLQuantizationType[kind]
    if kind == "F32":
        return w.astype(np.float32), qtype
    if kind == "F16":
        return w.astype(np.float16), qtype
    if kind == "Q4_K":
        return pack_q4_k(w), qtype
    if kind == "Q6_K":
        return pack_q6_k(w), qtype
    if kind in PACKERS:
        return PACKERS[kind](w), qtype
    return quantize(w.astype(np.float32), qtype), qtype


# -- the file ------------------------------------------------------------------------------------

TypeRule = Callable[[str], str]  # GGUF tensor name -> GGUF type


def q4_k_m(name: str) -> str:
    """llama.cpp's Q4_K_M in small: Q6_K for attn_v, ffn_down and the output, Q4_K elsewhere."""
    if "norm" in name:
        return "F32"
    return "Q6_K" if name == "output.weight" or any(p in name for p in ("attn_v", "ffn_down")) else "Q4_K"


# llama-quantize's types for a tensor whose rows are not a multiple of 256 (llama-quant.cpp).
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q3_K": "IQ4_NL", "Q2_K": "IQ4_NL"}


def k_mix(main: str, rows: dict[str, int]) -> TypeRule:
    """llama.cpp's Q4_K_M (main "Q4_K") or Q5_K_M ("Q5_K") in small: Q6_K for attn_v, ffn_down
    and the output, `main` elsewhere, each falling back as llama-quantize does where the tensor's
    row length (`rows`, by GGUF name) is not a multiple of 256."""
    def rule(name: str) -> str:
        if "norm" in name:
            return "F32"
        kind = "Q6_K" if name == "output.weight" or any(p in name for p in ("attn_v", "ffn_down")) else main
        return FALLBACK[kind] if rows[name] % 256 else kind
    return rule


def every(kind: str, embedding: str = "F32") -> TypeRule:
    def rule(name: str) -> str:
        if "norm" in name or name.endswith(".bias"):
            return "F32"
        return embedding if name == "token_embd.weight" else kind
    return rule


def row_lengths(model: Any, arch: str) -> dict[str, int]:
    """Each GGUF tensor's row length (its input features), by GGUF name."""
    return {g: int(t.shape[-1]) for hf, t in model.state_dict().items()
            if (g := _gguf_name(hf, ARCH_OF[arch])) is not None}


def write_gguf(model: Any, path: Path, arch: str, types: TypeRule, tokenizer: Path,
               name: str = "tiny", metadata: Callable[[GGUFWriter], None] | None = None) -> Path:
    """`model` (a tiny transformers model of `arch`, tests/tiny_models.py's names) as a GGUF file."""
    cfg = model.config
    garch = ARCH_OF[arch]
    w = GGUFWriter(str(path), garch)
    w.add_name(name)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(float((rope.get("full_attention") or rope)["rope_theta"]))
    if garch == "llama":
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if garch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg.sliding_window)
    if garch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    _tokenizer(w, tokenizer)
    if metadata is not None:  # what a test adds: keys, or tensors such as rope_freqs
        metadata(w)
    for hf, tensor in model.state_dict().items():
        gname = _gguf_name(hf, garch)
        if gname is None or (gname == "output.weight" and cfg.tie_word_embeddings):
            continue  # a tied model's state_dict names its embedding twice; llama.cpp writes it once
        data = tensor.detach().float().numpy()
        if garch == "llama" and (".attn_q." in gname or ".attn_k." in gname):
            heads = cfg.num_attention_heads if ".attn_q." in gname else cfg.num_key_value_heads
            data = _permute(data, heads)
        if garch in ("gemma2", "gemma3") and gname.endswith("norm.weight"):
            data = data + 1
        blob, qtype = encode(data, "F32" if data.ndim == 1 else types(gname))
        w.add_tensor(gname, blob, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_name(hf: str, arch: str) -> str | None:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    if parts[:2] != ["model", "layers"]:
        return None
    module, suffix = ".".join(parts[3:-1]), parts[-1]
    norms = _GEMMA_NORMS if arch.startswith("gemma") else _LLAMA_NORMS
    g = _HF_TO_GGUF.get(module) or norms.get(module)
    return None if g is None else f"blk.{parts[2]}.{g}.{suffix}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer(w: GGUFWriter, folder: Path) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's "gpt2" vocabulary."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    special = {a["content"]: a["id"] for a in tok["added_tokens"]}
    vocab.update(special)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == max(vocab.values()) + 1, "the vocabulary has holes"
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control, 1: normal
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[config["bos_token"]])
    w.add_eos_token_id(vocab[config["eos_token"]])
    w.add_eot_token_id(vocab["<|eot_id|>"])
    w.add_add_bos_token(True)
    w.add_chat_template(config.get("chat_template") or _chat_template(folder))


def _chat_template(folder: Path) -> str:
    jinja = folder / "chat_template.jinja"
    return jinja.read_text() if jinja.is_file() else ""


def reference(path: Path, config: Any = None) -> Any:
    """transformers' own GGUF loading of the file (float32): its config derived from the metadata,
    its weights dequantized by its GGUF loader (load_gguf_checkpoint, what from_pretrained calls
    for these architectures; from_pretrained itself needs accelerate, not installed here).
    `config`: the config of the model the file was written from, where the file's metadata says
    more than transformers reads from it (rope scaling, Gemma's soft-caps and attention scale)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = config or AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config.eos_token_id = None
    return model.eval()
