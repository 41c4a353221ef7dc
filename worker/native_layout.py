"""The ctypes mirror of worker/csrc/decoder_f32.c's structs, checked against the C side.

The driver reads these structs by offset; `check` compares each struct's size and each
field's offset here with what the compiled library reports by name (`decoder_layout_names`,
`decoder_layout`), so a field added, moved or resized on one side only fails at load, named.
"""

from __future__ import annotations

import ctypes

P, I64 = ctypes.c_void_p, ctypes.c_int64


class Kernels(ctypes.Structure):
    _fields_ = [("gemm", P), ("norm", P), ("rope", P), ("silu", P), ("attn", P), ("qk_rope", P),
                ("rope_partial", P), ("gelu_tanh", P), ("attn_capped", P), ("attn_scaled", P)]


class Layer(ctypes.Structure):
    _fields_ = [(name, P) for name in ("qkv", "qkv_bias", "o", "o_bias", "gate_up", "gate_up_bias", "down",
                                       "down_bias", "input_norm", "post_norm", "k_cache", "v_cache")]
    _fields_ += [("window", I64), ("q_norm", P), ("k_norm", P)]
    _fields_ += [("post_attn_norm", P), ("post_mlp_norm", P), ("soft_cap", ctypes.c_float),
                 ("geglu", ctypes.c_int32), ("local_rope", I64)]
    _fields_ += [("moe", P), ("index", I64), ("k_scale", ctypes.c_float), ("v_scale", ctypes.c_float)]


class Shape(ctypes.Structure):
    _fields_ = [(name, I64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "block_size")]
    _fields_ += [("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class Step(ctypes.Structure):
    _fields_ = [("tokens", I64), ("max_blocks", I64)]
    _fields_ += [(name, P) for name in ("cos", "sin", "tables", "lens", "slots", "normed", "qkv", "q", "k", "v",
                                        "attn", "gate_up", "act")]
    _fields_ += [("num_threads", ctypes.c_int), ("residual", ctypes.c_int), ("rotary_dim", I64)]
    _fields_ += [("cos_local", P), ("sin_local", P)]


STRUCTS: tuple[type[ctypes.Structure], ...] = (Kernels, Layer, Shape, Step)


def mirror() -> dict[str, int]:
    """Each struct's size and each field's offset here, by the C side's names."""
    out: dict[str, int] = {}
    for struct in STRUCTS:
        out[f"sizeof({struct.__name__})"] = ctypes.sizeof(struct)
        out |= {f"{struct.__name__}.{name}": getattr(struct, name).offset for name, _ in struct._fields_}
    return out


def check(dll: ctypes.CDLL) -> None:
    """Raise RuntimeError naming the first size or offset where the mirror and the library differ,
    or a field only one side has."""
    names_fn, values_fn = dll.decoder_layout_names, dll.decoder_layout
    names_fn.argtypes, names_fn.restype = [], ctypes.c_char_p
    values_fn.argtypes, values_fn.restype = [ctypes.POINTER(I64), I64], I64
    names = (names_fn() or b"").decode().split()
    values = (I64 * len(names))()
    if values_fn(values, len(names)) != len(names):
        raise RuntimeError("decoder_f32.c's layout names and values disagree in number")
    c_side = dict(zip(names, values, strict=True))
    here = mirror()
    for name, value in c_side.items():
        if here.get(name) != value:
            python = here.get(name, "absent")
            raise RuntimeError(f"worker/native_layout.py's mirror of decoder_f32.c differs at {name}: "
                               f"{python} in Python, {value} in C")
    extra = sorted(here.keys() - c_side.keys())
    if extra:
        raise RuntimeError(f"worker/native_layout.py's mirror has {extra[0]}, which decoder_f32.c's structs lack")
