"""The mutation catalogue of `python -m noria.kernels.mutate`: one-line edits of the kernel
sources, each a known bug class, with the oracle tests that must catch it. One file per kernel
family; the order here is the order of the mutation table in kernels/README.md."""

from __future__ import annotations

from noria.kernels.mutants.cuda_core import CUDA_CORE, DECODE_TESTS, PREFILL_TESTS
from noria.kernels.mutants.fp8 import FP8
from noria.kernels.mutants.fused import FUSED
from noria.kernels.mutants.gemm_w4a16 import GEMM_W4A16
from noria.kernels.mutants.mutant import ROOT, TESTS, Mutant
from noria.kernels.mutants.tensor_core import TENSOR_CORE
from noria.kernels.mutants.window import WINDOW

__all__ = ["CONTROL", "MUTANTS", "ROOT", "TESTS", "Mutant"]

MUTANTS: tuple[Mutant, ...] = (*CUDA_CORE, *TENSOR_CORE, *WINDOW, *FUSED, *GEMM_W4A16, *FP8)

# Not a bug: the unmodified sources through the same machinery must pass, which shows the
# oracle tests are green on correct code and the forked runs themselves work.
CONTROL = Mutant(
    "control", "none (unmodified sources)", "common.cuh", "", "", DECODE_TESTS + PREFILL_TESTS
)
