"""AWQ and GPTQ tensors (protocol/quant_awq_gptq.py describes their layouts) into a QuantLinear's form.

Every converter turns one checkpoint tensor of one module into the layer's own form for all of
that module's output rows: values int8 [N, K] (4-bit ones offset to [-8, 7], 8-bit ones to
[-128, 127]), scales float32 [N, G], zero points int8 [N, G] offset the same way. A fused layer's
parts and a tensor-parallel rank's rows or columns are then cut from them as from
compressed-tensors' (worker/models/weights.py). Each converter checks the dtype and shape of what
it reads and names the tensor when they are wrong.

GPTQ's activation order (desc_act): g_idx gives each input feature's group, and a group's members
are scattered over K. The layer keeps the weight's columns sorted by g_idx, so that its groups
are contiguous as every kind expects, and permutes its input the same way (`input_perm`). The
modules fused into one layer see the same input, so they must share one g_idx. The permutation
is known only once g_idx is read, which may be after the values: values read before it are
permuted in place then (rows not loaded yet are garbage, and overwritten later).
"""

from __future__ import annotations

import torch

from noria.worker.models.linear import CheckpointTensor, Convert
from noria.worker.models.quant_linear import QuantLinear, unpack_words

# AutoAWQ packs output features c*8 + ORDER[i] into nibble i of word c; REVERSE undoes it.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE = tuple(AWQ_ORDER.index(j) for j in range(8))


def checkpoint_tensors(layer: QuantLinear) -> list[CheckpointTensor]:
    s, k = layer.scheme, layer.checkpoint_in_features
    groups = s.groups(k)
    per_column = 0 if s.group is None else s.group  # one scale per row: every rank's
    out = [CheckpointTensor("scales", layer.weight_scale, _scales(groups), per_column)]
    if s.layout == "awq":
        out += [CheckpointTensor("qweight", layer.qweight, _awq_values(k)),
                CheckpointTensor("qzeros", layer.weight_zero, _awq_zeros(groups), per_column)]
    else:
        order = _ActOrder(layer, k) if s.act_order else None
        if order is not None and getattr(layer, "tp", None) is not None and layer.tp.size > 1:
            raise ValueError("GPTQ desc_act (activation-ordered groups) on a row-parallel layer (o_proj, "
                             "down_proj) is not supported with tensor parallelism: its ranks' groups would "
                             "interleave; use --tensor-parallel-size 1 or a checkpoint without desc_act")
        out.append(CheckpointTensor("qweight", layer.qweight, _gptq_values(s.bits, k, order)))
        v1 = s.layout == "gptq"  # stores z - 1
        zeros = _gptq_zeros(s.bits, groups, v1, s.symmetric)
        out.append(CheckpointTensor("qzeros", layer.weight_zero, zeros, per_column))
        if order is not None:
            # An empty [N, 0] stand-in: it is never read, but its slot reports a missing g_idx.
            marker = torch.empty(layer.out_features, 0, device=layer.qweight.device)
            out.append(CheckpointTensor("g_idx", marker, order.read_g_idx, 0))
        else:
            out.append(CheckpointTensor("g_idx", None, _plain_g_idx(k, s.group or k)))
    if layer.bias is not None:
        out.append(CheckpointTensor("bias", layer.bias, None, 0))
    else:  # AutoGPTQ's and AutoAWQ's layers save a bias buffer even where the model has none: zeros
        out.append(CheckpointTensor("bias", None, _zero_bias))
    return out


def _zero_bias(t: torch.Tensor, rows: int, what: str) -> torch.Tensor:
    if t.numel() != rows or bool(t.float().abs().max() > 0):
        raise ValueError(f"checkpoint tensor {what!r} is a bias of {list(t.shape)} with non-zero values, "
                         "for a layer this model computes without one")
    return t


def _expect(t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], what: str,
            meaning: str) -> None:
    if t.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"checkpoint tensor {what!r} is {str(t.dtype).removeprefix('torch.')}, expected {names}")
    if tuple(t.shape) != shape:
        raise ValueError(f"checkpoint tensor {what!r} has shape {tuple(t.shape)}, expected {shape} ({meaning})")


def _scales(groups: int) -> Convert:
    def convert(t: torch.Tensor, rows: int, what: str) -> torch.Tensor:
        if not t.is_floating_point():
            raise ValueError(f"checkpoint tensor {what!r} is {t.dtype}, expected floating-point scales")
        _expect(t, (groups, rows), (t.dtype,), what, "groups x output features")
        return t.to(torch.float32).t().contiguous()
    return convert


def _awq_columns(t: torch.Tensor, count: int) -> torch.Tensor:
    """int32 words [R, count/8] of AutoAWQ's interleaved nibbles -> int8 [R, count], offset by -8."""
    values = unpack_words(t, 4, count, 1)
    return values.view(t.shape[0], -1, 8)[..., list(AWQ_REVERSE)].reshape(t.shape[0], count)


def _awq_values(k: int) -> Convert:
    def convert(t: torch.Tensor, rows: int, what: str) -> torch.Tensor:
        _expect(t, (k, rows // 8), (torch.int32,), what, "input features x output features / 8")
        if rows % 8:
            raise ValueError(f"checkpoint tensor {what!r}: AWQ packs 8 output features per word, the module has {rows}")
        return _awq_columns(t, rows).t().contiguous()
    return convert


def _awq_zeros(groups: int) -> Convert:
    def convert(t: torch.Tensor, rows: int, what: str) -> torch.Tensor:
        _expect(t, (groups, rows // 8), (torch.int32,), what, "groups x output features / 8")
        return _awq_columns(t, rows).t().contiguous()
    return convert


def _gptq_values(bits: int, k: int, order: _ActOrder | None) -> Convert:
    per_word = 32 // bits

    def convert(t: torch.Tensor, rows: int, what: str) -> torch.Tensor:
        _expect(t, (k // per_word, rows), (torch.int32,), what, f"input features / {per_word} x output features")
        if k % per_word:
            raise ValueError(f"checkpoint tensor {what!r}: GPTQ packs {per_word} input features per word, "
                             f"the module has {k}")
        values = unpack_words(t, bits, k, 0).t()
        return (values if order is None else order.columns(values)).contiguous()
    return convert


def _gptq_zeros(bits: int, groups: int, v1: bool, symmetric: bool) -> Convert:
    per_word, mid = 32 // bits, 1 << (bits - 1)

    def convert(t: torch.Tensor, rows: int, what: str) -> torch.Tensor:
        _expect(t, (groups, rows // per_word), (torch.int32,), what, f"groups x output features / {per_word}")
        # Offset by -2^(b-1) as the values are; v1 stores z - 1 (a zero of 0 wraps to 2^b - 1).
        zeros = unpack_words(t, bits, rows, 1).to(torch.int16) + int(v1)
        if symmetric:
            if bool((zeros != 0).any()):
                found = int(zeros[zeros != 0][0]) + mid
                raise ValueError(f"checkpoint tensor {what!r} holds a zero point of {found}, but the config says "
                                 f"sym: every zero point of {bits}-bit values is {mid}")
            return t  # checked, not kept
        if int(zeros.max()) >= mid:
            raise ValueError(f"checkpoint tensor {what!r} holds a zero point of {int(zeros.max()) + mid}, past "
                             f"the {bits}-bit range (a v1 checkpoint's zero of 0)")
        return zeros.to(torch.int8).t().contiguous()
    return convert


def _plain_g_idx(k: int, group: int) -> Convert:
    def convert(t: torch.Tensor, rows: int, what: str) -> torch.Tensor:
        _expect(t, (k,), (torch.int32, torch.int64), what, "one group per input feature")
        if not torch.equal(t.long(), torch.arange(k) // group):
            raise ValueError(f"checkpoint tensor {what!r} orders the input features by activation, but the "
                             "config says desc_act false")
        return t
    return convert


class _ActOrder:
    """One layer's input permutation, from the first g_idx of its modules."""

    def __init__(self, layer: QuantLinear, k: int) -> None:
        self.layer, self.k = layer, k
        self.g_idx: torch.Tensor | None = None
        self.first = ""  # the name of the g_idx read first
        self.perm: torch.Tensor | None = None  # None while unknown, or where it is the identity
        self.early = False  # values read before g_idx, in the checkpoint's column order

    def columns(self, values: torch.Tensor) -> torch.Tensor:
        """A module's values [rows, K] with their columns in the layer's order."""
        if self.g_idx is None:
            self.early = True
            return values
        return values if self.perm is None else values.index_select(1, self.perm)

    def read_g_idx(self, t: torch.Tensor, rows: int, what: str) -> torch.Tensor:
        k, group = self.k, self.layer.group
        _expect(t, (k,), (torch.int32, torch.int64), what, "one group per input feature")
        g_idx = t.long()
        if self.g_idx is not None:
            if not torch.equal(g_idx, self.g_idx):
                raise ValueError(f"checkpoint tensor {what!r} orders the input features differently from "
                                 f"{self.first!r}, a module fused into the same layer (q/k/v, gate/up), which "
                                 "share one input and so one order")
            return torch.empty(rows, 0)
        perm = torch.sort(g_idx, stable=True).indices
        if not torch.equal(g_idx[perm], torch.arange(k) // group):
            raise ValueError(f"checkpoint tensor {what!r} does not put exactly {group} input features in each of "
                             f"its {k // group} groups")
        self.g_idx, self.first = g_idx, what
        if not torch.equal(perm, torch.arange(k)):
            self.perm = perm
            device = self.layer.qweight.device
            self.layer.input_perm = perm.to(device)
            if self.early:
                q = self.layer.qweight.data
                q.copy_(q.index_select(1, perm.to(device)))
        return torch.empty(rows, 0)
