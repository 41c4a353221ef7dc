"""Checkpoints derived from a benchmark model for `noria bench spec`'s draft-model rows, made once
beside it in the cache.

- `head_checkpoint(model, L)`: the model's embedding, first L layers, final norm and lm_head: a
  draft of the same family at L / num_layers of the layers' cost.
- `inert_checkpoint(model, L)`: the model with every layer from L on made to add nothing to
  the residual stream (its attention and MLP output projections zero). It still computes every
  layer at full cost, but its greedy tokens are those of its first L layers, so
  `head_checkpoint(model, L)` drafts it with every proposal right: the upper bound of a draft
  that size. (Random weights give a real head of a real model next to no agreement; trained
  models fall between the two.)
- `eagle3_checkpoint(model)`: a seeded random EAGLE-3 head for the model, in the layout SpecForge
  and the EAGLE authors publish (`write_eagle3_head`, which the tests use too). No trained head
  exists for a random model, and none can be constructed that agrees with it (one trained on
  the model's own greedy outputs learned its training prompts' loop tokens and kept no proposal
  on W1's): its row measures what a head costs when it is always wrong.
- `mimo_checkpoint(model)`: the model as a MiMo checkpoint with a seeded random MTP layer beside
  it (`add_mtp_layer`, which the tests use too): the same measure for an MTP layer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from noria.bench.workloads import write_checkpoint

_OUTPUTS = (".self_attn.o_proj.", ".mlp.down_proj.")


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else None


def _derive(model: Path, name: str, layers: int, keep: bool) -> Path:
    from safetensors.torch import save_file

    from noria.worker.loader import checkpoint_files, iter_weights

    path = model.with_name(f"{model.name}-{name}{layers}")
    if (path / "complete").exists():
        return path
    config = json.loads((model / "config.json").read_text())
    if not 0 < layers < config["num_hidden_layers"]:
        raise SystemExit(f"{model.name} has {config['num_hidden_layers']} layers: {name}{layers} needs fewer")

    def save(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        weights = {}
        for key, value in iter_weights(checkpoint_files(model)):
            index = _layer(key)
            if index is not None and index >= layers:
                if not keep:
                    continue
                if any(part in key for part in _OUTPUTS):
                    value = value.new_zeros(value.shape)
            weights[key] = value.contiguous()
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        if not keep:
            config["num_hidden_layers"] = layers
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for extra in ("generation_config.json",):
            if (model / extra).exists():
                shutil.copy(model / extra, tmp / extra)

    return write_checkpoint(path, save, model)


def head_checkpoint(model: Path, layers: int) -> Path:
    return _derive(model, "head", layers, keep=False)


def inert_checkpoint(model: Path, layers: int) -> Path:
    return _derive(model, "inert", layers, keep=True)


def write_eagle3_head(target: Path, path: Path, *, seed: int = 0, draft_vocab: int | None = None,
                      own_embed: bool = False, prefix: str = "midlayer.", fmt: str = "safetensors",
                      aux: list[int] | None = None, **config: Any) -> Path:
    """A random EAGLE-3 head for `target` (its widths, heads and vocabulary), as the published
    exports save it: `prefix` "midlayer." (SpecForge, the EAGLE authors) or "layers.0.", `fmt`
    safetensors or "bin" (the authors' pytorch_model.bin); `config` overrides config.json keys."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((target / "config.json").read_text())
    h, vocab, heads = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    kv, inter = cfg.get("num_key_value_heads") or heads, cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // heads
    draft_vocab = draft_vocab or vocab
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, std: float = 0.15) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    a = prefix + "self_attn."
    tensors = {
        "fc.weight": w(h, 3 * h, std=0.1),
        # q and k large enough that attention is peaked: a key or a position out of place shows.
        a + "q_proj.weight": w(heads * hd, 2 * h, std=0.6), a + "k_proj.weight": w(kv * hd, 2 * h, std=0.6),
        a + "v_proj.weight": w(kv * hd, 2 * h), a + "o_proj.weight": w(h, heads * hd),
        prefix + "mlp.gate_proj.weight": w(inter, h), prefix + "mlp.up_proj.weight": w(inter, h),
        prefix + "mlp.down_proj.weight": w(h, inter),
        **{f"{prefix}{n}.weight": 1 + w(h, std=0.1) for n in ("input_layernorm", "hidden_norm",
                                                              "post_attention_layernorm")},
        "norm.weight": 1 + w(h, std=0.1), "lm_head.weight": w(draft_vocab, h, std=0.5),
        "d2t": ids - torch.arange(draft_vocab), "t2d": t2d,
    }
    if own_embed:
        tensors["embed_tokens.weight"] = w(vocab, h, std=0.5)
    n = cfg["num_hidden_layers"]
    head_cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
                "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
                "num_hidden_layers": 1, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-5), "vocab_size": vocab,
                "draft_vocab_size": draft_vocab, "max_position_embeddings": cfg.get("max_position_embeddings", 4096),
                "rope_theta": cfg.get("rope_theta", 10000.0), "hidden_act": "silu", "tie_word_embeddings": False,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux or [2, n // 2, n - 3]}, **config}
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(head_cfg, indent=2))
    if fmt == "bin":
        torch.save(tensors, path / "pytorch_model.bin")
    else:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def eagle3_checkpoint(model: Path) -> Path:
    """The benchmark's random head for `model` (a quarter of its vocabulary drafted, as
    Llama 3's EAGLE-3 heads draft 32k of 128k tokens), made once beside it."""
    path = model.with_name(f"{model.name}-eagle3")
    if (path / "complete").exists():
        return path
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    return write_checkpoint(path, lambda tmp: write_eagle3_head(model, tmp, draft_vocab=vocab // 4), model)


MTP = "model.mtp_layers.0."  # a MiMo checkpoint's first multi-token-prediction layer


def add_mtp_layer(path: Path, seed: int = 7) -> Path:
    """The checkpoint in `path` (Qwen2's layers: q/k/v biases) made a MiMo one, in place: its
    config renamed and an MTP layer of seeded random weights (MiMo's names and shapes) added in a
    shard of its own, named by the index."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((path / "config.json").read_text())
    cfg.update(architectures=["MiMoForCausalLM"], model_type="mimo", num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    layer = {"token_layernorm.weight": 1 + rand(h), "hidden_layernorm.weight": 1 + rand(h),
             "final_layernorm.weight": 1 + rand(h), "input_proj.weight": rand(h, 2 * h),
             "input_layernorm.weight": 1 + rand(h), "post_attention_layernorm.weight": 1 + rand(h),
             "self_attn.q_proj.weight": rand(q, h), "self_attn.q_proj.bias": rand(q),
             "self_attn.k_proj.weight": rand(kv, h), "self_attn.k_proj.bias": rand(kv),
             "self_attn.v_proj.weight": rand(kv, h), "self_attn.v_proj.bias": rand(kv),
             "self_attn.o_proj.weight": rand(h, q), "mlp.gate_proj.weight": rand(inter, h),
             "mlp.up_proj.weight": rand(inter, h), "mlp.down_proj.weight": rand(h, inter)}
    save_file({MTP + k: v.contiguous() for k, v in layer.items()}, path / "model-mtp.safetensors",
              metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
    else:
        data = {"metadata": {}, "weight_map": dict.fromkeys(_names(path / "model.safetensors"), "model.safetensors")}
    data["weight_map"].update(dict.fromkeys((MTP + k for k in layer), "model-mtp.safetensors"))
    index.write_text(json.dumps(data, indent=2))
    return path


def _names(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return list(f.keys())  # noqa: SIM118 - safe_open is not a mapping


def mimo_checkpoint(model: Path) -> Path:
    """`model` (a Llama) as a MiMo checkpoint, made once beside it: the same decoder with zero
    q/k/v biases (Qwen2's layer has them; adding zero is exact, so its outputs are the Llama's)
    and a seeded random MTP layer, which measures what an MTP layer costs when it is always wrong."""
    from safetensors.torch import save_file

    from noria.worker.loader import checkpoint_files, iter_weights

    path = model.with_name(f"{model.name}-mimo")
    if (path / "complete").exists():
        return path

    def save(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        weights = {}
        for key, value in iter_weights(checkpoint_files(model)):
            weights[key] = value.contiguous()
            if key.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                weights[key.removesuffix("weight") + "bias"] = value.new_zeros(value.shape[0])
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((model / "config.json").read_text())
        config.update(use_sliding_window=False, max_window_layers=config["num_hidden_layers"])
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        add_mtp_layer(tmp)

    return write_checkpoint(path, save, model)
