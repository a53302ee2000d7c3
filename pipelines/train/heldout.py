"""The held-out rows as blocks in the object store, each worker reading only its own.

The driver materialises the held-out rows once (up to ``train.eval_samples``) and hands the
workers the blocks' references and sizes, never the rows. Every worker deals the blocks out
by size with the same rule (``take_turn``: the least loaded worker takes the next block), so
all of them agree on the owners without talking, and each fetches only the blocks it owns;
the evaluation sums are then all-reduced. Batches never cross a block, so the batches -- and
the anchors drawn from their sample ids -- are the same whatever the world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class HeldOut:
    """References to the held-out blocks and what each costs to evaluate (its bytes)."""

    blocks: tuple  # ray.ObjectRef of one block each
    costs: tuple[int, ...]
    rows: int
    spans: tuple = ()  # (start, end) rows of each block that belong to the set (a limit cuts the last)

    def owned(self, rank: int, world: int) -> list[int]:
        """The blocks ``rank`` evaluates among ``world`` workers."""
        load = [0] * world
        return [i for i, cost in enumerate(self.costs) if take_turn(load, cost) == rank]

    def batches(self, indices: list[int], batch_size: int) -> Iterator:
        """Arrow batches of at most ``batch_size`` rows from the blocks ``indices``, fetched one
        block at a time."""
        import ray
        from ray.data.block import BlockAccessor

        for i in indices:
            table = BlockAccessor.for_block(ray.get(self.blocks[i])).to_arrow()
            if self.spans:
                lo, hi = self.spans[i]
                table = table.slice(lo, hi - lo)
            for start in range(0, table.num_rows, batch_size):
                yield table.slice(start, batch_size)


def held_out_blocks(ds) -> HeldOut:
    """A materialised dataset's blocks as a :class:`HeldOut`, read from block metadata only
    (the driver fetches no row)."""
    refs, costs, spans = [], [], []
    for bundle in ds.iter_internal_ref_bundles():
        for entry, cut in zip(bundle.blocks, bundle.slices or [None] * len(bundle.blocks)):
            total = int(entry.metadata.num_rows or 0)
            lo, hi = (cut.start_offset, cut.end_offset) if cut is not None else (0, total)
            if hi <= lo:
                continue
            refs.append(entry.ref)
            costs.append(max(1, int((entry.metadata.size_bytes or total) * (hi - lo) / max(total, 1))))
            spans.append((lo, hi))
    return HeldOut(tuple(refs), tuple(costs), sum(hi - lo for lo, hi in spans), tuple(spans))


def take_turn(load: list[int], cost: int) -> int:
    """The worker that evaluates the next block: the least loaded so far (the lowest rank on
    ties), charged ``cost``. With long-context rows of 1K-8K tokens, turn-taking by index
    left one worker idle while the other ran every long batch."""
    owner = min(range(len(load)), key=load.__getitem__)
    load[owner] += cost
    return owner
