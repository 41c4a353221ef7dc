"""The mutation check: every injected attention-kernel bug makes the kernel tests fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from noria.kernels import mutate
from noria.kernels.options import SOURCE_DIR

# The bug classes the kernel tests must be shown to catch.
REQUIRED = {
    "removed `__syncthreads`",
    "wrong GQA head mapping",
    "off-by-one in the block index",
    "reduction one level short",
    "skipped block table lookup",
    "wrong softmax scale",
    "off-by-one past the end",  # caught only by the emulator's memory check
}


def test_catalogue_covers_the_required_bug_classes() -> None:
    bugs = [m.bug for m in mutate.MUTANTS]
    for required in REQUIRED:
        assert any(b.startswith(required) for b in bugs), required


@pytest.mark.parametrize("mutant", mutate.MUTANTS, ids=lambda m: m.name)
def test_mutant_applies_to_exactly_one_place(mutant: mutate.Mutant, tmp_path: Path) -> None:
    mutate.apply(mutant, SOURCE_DIR, tmp_path)
    assert (tmp_path / mutant.source).read_text() != (SOURCE_DIR / mutant.source).read_text()


def test_every_mutant_is_caught() -> None:
    outcomes = mutate.run_all(per_schedule=False)
    assert all(o.caught for o in outcomes), "\n" + mutate.table(outcomes, per_schedule=False)
