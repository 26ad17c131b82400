"""Which rows each rank trains on, in which order: deterministic, shardable, resumable.

The order is a pure function of (seed, epoch, position), so a resumed run needs only the count of
micro-batches already consumed, and one process with micro-batch B*N sees exactly the rows that
N ranks with micro-batch B see together (what the parity tests compare).
"""

from __future__ import annotations

import torch

from homelab_ft.errors import UserError


class MicroBatchSampler:
    """Yields this rank's row indices for each global micro-batch, epoch after epoch.

    A global micro-batch is `micro_batch_size * world_size` consecutive rows of the epoch's
    permutation; rank r takes the r-th slice. The last incomplete global batch of an epoch is
    dropped, so every rank runs the same number of forward passes (FSDP's collectives need it).
    """

    def __init__(self, num_rows: int, *, micro_batch_size: int, seed: int, rank: int, world_size: int, shuffle: bool):
        self.num_rows = num_rows
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.global_batch = micro_batch_size * world_size
        self.batches_per_epoch = num_rows // self.global_batch
        if self.batches_per_epoch == 0:
            raise UserError(
                f"the training split has {num_rows} rows, fewer than one global micro-batch "
                f"(train.micro_batch_size {micro_batch_size} x {world_size} ranks); lower train.micro_batch_size or add data"
            )
        self.consumed = 0  # global micro-batches drawn so far
        self._epoch = -1
        self._order: torch.Tensor | None = None

    @property
    def epoch(self) -> int:
        return self.consumed // self.batches_per_epoch

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + epoch)
                self._order = torch.randperm(self.num_rows, generator=gen)
            else:
                self._order = torch.arange(self.num_rows)
            self._epoch = epoch
        return self._order

    def next_indices(self) -> list[int]:
        epoch, index = divmod(self.consumed, self.batches_per_epoch)
        order = self._epoch_order(epoch)
        start = index * self.global_batch + self.rank * self.micro_batch_size
        self.consumed += 1
        return order[start : start + self.micro_batch_size].tolist()

    def state_dict(self) -> dict:
        # Rows rather than batches, so a run resumed on another number of ranks continues at the
        # same place in the data (rounded down to a whole global batch).
        return {"rows_consumed": self.consumed * self.global_batch, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = state["rows_consumed"] // self.global_batch
