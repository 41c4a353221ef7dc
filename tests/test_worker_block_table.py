"""BlockTables' Python mirror of each row (`ids`, read by the decode fast path of
ModelRunner._prepare) must always equal the tensor rows it mirrors."""

from __future__ import annotations

import random

from noria.worker.block_table import BlockTables


def _check(bt: BlockTables, live: dict[int, list[int]]) -> None:
    for row, blocks in live.items():
        assert bt.ids[row] == blocks
        assert bt.table[row, : len(blocks)].tolist() == blocks
        assert (bt.table[row, len(blocks) :] == bt.null_block).all()


def test_ids_mirror_the_table_through_add_append_free_and_growth() -> None:
    rng = random.Random(0)
    bt = BlockTables(max_blocks_per_seq=3, null_block=999, initial_rows=2)  # both axes must grow
    live: dict[int, list[int]] = {}
    for _ in range(400):
        op = rng.random()
        if op < 0.3 or not live:
            blocks = [rng.randrange(999) for _ in range(rng.randrange(0, 4))]
            live[bt.add(blocks)] = blocks
        elif op < 0.7:
            row = rng.choice(list(live))
            more = [rng.randrange(999) for _ in range(rng.randrange(1, 3))]
            bt.append(row, more)
            live[row] += more
        else:
            row = rng.choice(list(live))
            bt.free(row)
            del live[row]
        _check(bt, live)
    assert bt.table.shape[0] > 2 and bt.table.shape[1] > 3
