"""Persistent block tables: one row per live request, updated by diffs.

Plans carry only new block ids, so rows are appended to in place and a step's
[B, max_blocks] table is one row gather instead of a rebuild from Python lists.
Unused entries hold the KV cache's null block. Each row's block ids are mirrored in a
Python list (`ids`), so that a decode step finds its slots with list lookups instead of
half a dozen small tensor operations (ModelRunner._prepare).
"""

from __future__ import annotations

import torch


class BlockTables:
    def __init__(self, max_blocks_per_seq: int, null_block: int, initial_rows: int = 64) -> None:
        self.null_block = null_block
        self.table = torch.full((initial_rows, max(1, max_blocks_per_seq)), null_block, dtype=torch.long)
        self.num_blocks = [0] * initial_rows
        self.ids: list[list[int]] = [[] for _ in range(initial_rows)]  # row -> its block ids, as `table`
        self._free_rows = list(range(initial_rows - 1, -1, -1))

    def add(self, block_ids: list[int]) -> int:
        """Take a free row for a new request and fill it; returns the row."""
        if not self._free_rows:
            self._grow_rows()
        row = self._free_rows.pop()
        self.num_blocks[row] = 0
        self.ids[row] = []
        self.append(row, block_ids)
        return row

    def append(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = self.num_blocks[row]
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            self._grow_cols(end)
        self.table[row, start:end] = torch.tensor(block_ids, dtype=torch.long)
        self.num_blocks[row] = end
        self.ids[row].extend(block_ids)

    def free(self, row: int) -> None:
        self.table[row, : self.num_blocks[row]] = self.null_block
        self.num_blocks[row] = 0
        self.ids[row] = []
        self._free_rows.append(row)

    def gather(self, rows: list[int], num_cols: int) -> torch.Tensor:
        """[len(rows), num_cols] block table for one step (a fresh tensor)."""
        if num_cols > self.table.shape[1]:
            self._grow_cols(num_cols)
        return self.table[torch.tensor(rows, dtype=torch.long), :num_cols]

    def _grow_rows(self) -> None:
        old = self.table.shape[0]
        extra = torch.full_like(self.table, self.null_block)
        self.table = torch.cat([self.table, extra])
        self.num_blocks += [0] * old
        self.ids += [[] for _ in range(old)]
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    def _grow_cols(self, cols: int) -> None:
        extra = torch.full((self.table.shape[0], cols - self.table.shape[1]), self.null_block, dtype=torch.long)
        self.table = torch.cat([self.table, extra], dim=1)
