"""Activations that test a dot kernel's float32 -> bf16 rounding (torch's rule), each value at
positions that land in a vector of the rounding loop and in its scalar tail."""

from __future__ import annotations

import torch

K = 33  # two 16-value vectors and a tail of one, padded to a pair
VALUES = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-9), 3.0e38, -3.3e38, float("inf"), 1e-40, float("nan"), 0.1]
POSITIONS = [0, 5, 15, 16, 30, 32]
SIGNALING_NAN = 0x7F800001  # its top half alone would be an infinity: the rounding must keep it a NaN


def rounding_rows() -> torch.Tensor:
    """[(len(VALUES) + 1) * len(POSITIONS), K]: one value per row, zeros around it."""
    x = torch.zeros((len(VALUES) + 1) * len(POSITIONS), K)
    for i, (v, p) in enumerate((v, p) for v in VALUES for p in POSITIONS):
        x[i, p] = v
    for j, p in enumerate(POSITIONS):  # written as bits: a Python float would come back quiet
        x.view(torch.int32)[len(VALUES) * len(POSITIONS) + j, p] = SIGNALING_NAN
    return x


def check_rounded(x: torch.Tensor, got: torch.Tensor) -> None:
    """`got`: x times a column of ones, through the kernel: each row's value as torch rounds it."""
    want = x.sum(dim=1).to(torch.bfloat16).float()
    assert torch.equal(got.isnan(), want.isnan())
    keep = ~want.isnan() & (want.abs() >= 2.0**-126)  # vdpbf16ps flushes subnormals to zero
    assert torch.equal(got[keep], want[keep])
