"""AWQ and GPTQ checkpoints made by hand, and a dequantizer of them, both from the formats' documentation.

Nothing here imports noria's converters. Packing follows AutoAWQ's WQLinear_GEMM.from_linear (eight
4-bit values per int32 word along the output features, value c*8 + ORDER[i] in bits 4i..4i+3)
and AutoGPTQ's QuantLinear.pack (32/bits values per word along the input features for qweight,
along the output features for qzeros, feature j of a word at bits j*bits; the v1 format stores
each zero point minus one). The dequantizer reads the packed words back one bit field at a time
in float64: W[n, k] = scale[group(k), n] * (q[k, n] - zero[group(k), n]).

Quantization is round-to-nearest per group (min/max for zero points, absmax for symmetric, as
GPTQ's quantizer sets its grid): what these tests check is the layout, not the algorithm that
chose the values. Activation order: one permutation of the input features per group of modules
that share an input (GPTQ orders by the Hessian's diagonal, which those modules share), groups
taken over consecutive features of it, g_idx[perm[j]] = j // group.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# The modules that see one input (and so share one activation order).
INPUTS = {"self_attn.q_proj": "qkv", "self_attn.k_proj": "qkv", "self_attn.v_proj": "qkv",
          "self_attn.o_proj": "o", "mlp.gate_proj": "gate_up", "mlp.up_proj": "gate_up", "mlp.down_proj": "down"}


@dataclass(frozen=True)
class Variant:
    method: str  # "awq" or "gptq"
    bits: int = 4
    group: int = 128  # -1: per channel
    desc_act: bool = False
    sym: bool = True
    fmt: str = "gptq"  # GPTQ's checkpoint_format: "gptq" (v1, zero - 1) or "gptq_v2"

    def config(self) -> dict[str, Any]:
        if self.method == "awq":
            return {"quant_method": "awq", "bits": self.bits, "group_size": self.group, "zero_point": True,
                    "version": "gemm", "modules_to_not_convert": None}
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group, "desc_act": self.desc_act,
                "sym": self.sym, "checkpoint_format": self.fmt, "damp_percent": 0.01, "true_sequential": True}


def quantize(w: torch.Tensor, bits: int, group: int, sym: bool,
             g_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> values q [K, N] in [0, 2^b - 1], f16 scales [G, N], zero points [G, N] (int64)."""
    n, k = w.shape
    top = (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    scale, zero = torch.empty(groups, n, dtype=torch.float16), torch.empty(groups, n, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g].double()
        if sym:
            s = cols.abs().amax(1) * 2 / top
            z = torch.full((n,), 1 << (bits - 1), dtype=torch.int64)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = (hi - lo) / top
        scale[g] = s.clamp(min=1e-6).to(torch.float16)
        if not sym:
            z = (-lo / scale[g].double()).round().clamp(0, top).long()
        zero[g] = z
    s_k, z_k = scale.double()[g_idx], zero[g_idx]  # [K, N]
    q = (w.double().t() / s_k).round().long() + z_k
    return q.clamp(0, top), scale, zero


def _words(fields: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> int32 words of the same bits."""
    return torch.where(fields >= 1 << 31, fields - (1 << 32), fields).to(torch.int32)


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """[R, C] 4-bit values -> int32 [R, C / 8], AutoAWQ's interleaved order."""
    out = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for c in range(out.shape[1]):
        for i in range(8):
            out[:, c] |= q[:, c * 8 + AWQ_ORDER[i]] << (4 * i)
    return _words(out)


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] -> int32 [K * bits / 32, N], consecutive rows in one word (GPTQ's qweight)."""
    per = 32 // bits
    out = torch.zeros(q.shape[0] // per, q.shape[1], dtype=torch.int64)
    for j in range(per):
        out |= q[j::per] << (bits * j)
    return _words(out)


def pack_columns(z: torch.Tensor, bits: int) -> torch.Tensor:
    """[G, N] -> int32 [G, N * bits / 32], consecutive columns in one word (GPTQ's qzeros)."""
    return pack_rows(z.t().contiguous(), bits).t().contiguous()


def _field(words: torch.Tensor, shift: int, bits: int) -> torch.Tensor:
    return (words.long() & 0xFFFFFFFF) >> shift & ((1 << bits) - 1)


def dequantize(tensors: dict[str, torch.Tensor], variant: Variant) -> torch.Tensor:
    """A module's float64 weight [N, K] from its stored tensors, read field by field."""
    scales = tensors["scales"].double()
    n = scales.shape[1]
    if variant.method == "awq":
        qw, qz = tensors["qweight"], tensors["qzeros"]
        q = torch.empty(qw.shape[0], n, dtype=torch.int64)
        z = torch.empty(qz.shape[0], n, dtype=torch.int64)
        for c in range(n // 8):
            for i in range(8):
                q[:, c * 8 + AWQ_ORDER[i]] = _field(qw[:, c], 4 * i, 4)
                z[:, c * 8 + AWQ_ORDER[i]] = _field(qz[:, c], 4 * i, 4)
        k = q.shape[0]
        g_idx = torch.arange(k) // (k // scales.shape[0])
    else:
        b, per = variant.bits, 32 // variant.bits
        qw, qz, g_idx = tensors["qweight"], tensors["qzeros"], tensors["g_idx"].long()
        q = torch.stack([_field(qw[r // per], (r % per) * b, b) for r in range(qw.shape[0] * per)])
        z = torch.stack([_field(qz[:, c // per], (c % per) * b, b) for c in range(n)], 1)
        if variant.fmt == "gptq":
            z = z + 1
    return ((q - z[g_idx]) * scales[g_idx]).t().contiguous()


def act_orders(model: Any, group: int, seed: int = 5) -> dict[tuple[int, str], torch.Tensor]:
    """Per (layer, input): the g_idx of an activation order, a seeded permutation's groups."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, layer in enumerate(model.model.layers):
        for name, key in INPUTS.items():
            if (i, key) not in out:
                k = _module(layer, name).in_features
                perm = torch.randperm(k, generator=gen)
                g_idx = torch.empty(k, dtype=torch.int32)
                g_idx[perm] = (torch.arange(k) // group).int()
                out[i, key] = g_idx
    return out


def _module(layer: Any, name: str) -> Any:
    part, proj = name.split(".")
    return getattr(getattr(layer, part), proj)


def save(model: Any, path: Path, variant: Variant) -> Path:
    """`model` (a tiny transformers Llama) quantized and saved in `variant`'s layout; its linear
    weights are replaced by the dequantized ones, so that it is the reference of the files."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    orders = act_orders(model, variant.group) if variant.desc_act else {}
    for i, layer in enumerate(model.model.layers):
        for name in LINEARS:
            lin = _module(layer, name)
            w = lin.weight.data
            k = w.shape[1]
            group = k if variant.group == -1 else variant.group
            g_idx = orders.get((i, INPUTS[name]), (torch.arange(k) // group).int())
            q, scale, zero = quantize(w, variant.bits, group, variant.sym and variant.method == "gptq", g_idx)
            prefix = f"model.layers.{i}.{name}."
            del tensors[prefix + "weight"]
            files = {"scales": scale}
            if variant.method == "awq":
                files |= {"qweight": pack_awq(q), "qzeros": pack_awq(zero)}
            else:
                stored = zero - 1 if variant.fmt == "gptq" else zero
                files |= {"qweight": pack_rows(q, variant.bits),
                          "qzeros": pack_columns(stored & ((1 << variant.bits) - 1), variant.bits), "g_idx": g_idx.clone()}
            tensors |= {prefix + key: value for key, value in files.items()}
            lin.weight.data = dequantize(files, variant).float()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(str(path))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = variant.config()
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def edit(path: Path, change: Any) -> Path:
    """Rewrite the checkpoint's tensors through `change(dict)` (for the refusal tests)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
