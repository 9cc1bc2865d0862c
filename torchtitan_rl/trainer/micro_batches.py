"""Micro-batches without compute on padding: rows sorted by length, cut by rows and by tokens.

A GRPO batch is right-padded to its longest row. Run as it comes, every
micro-batch computes on that padding. Here rows are sorted by length (longest
first, stable), grouped so that a group's rows x its longest row stays within a
token budget (and its row count within a row cap), and each micro-batch is cut
to its own longest row: the padding left is what rows of nearly equal length
differ by. Rows with nothing to score are left out altogether.

The GRPO loss is normalised by the global scored-token count, so the summed
micro-batch losses (and gradients) are those of the whole batch whatever the
grouping; a row's logprobs do not depend on its micro-batch beyond bf16
rounding (exactly not, in batch-invariant mode).
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MicroBatch:
    rows: torch.Tensor
    """long [b]: indices of this micro-batch's rows in the batch, longest first."""
    length: int
    """Columns kept: every row's scored positions lie in [0, length)."""


def row_lengths(score_BL: torch.Tensor) -> torch.Tensor:
    """long [B]: 1 + the last scored position of each row; 0 for a row with none."""
    B, L = score_BL.shape
    positions_BL = torch.arange(1, L + 1).expand(B, L)
    return torch.where(score_BL.bool().cpu(), positions_BL, 0).amax(dim=1)


def plan(lengths_B: torch.Tensor, *, max_rows: int, max_tokens: int) -> list[MicroBatch]:
    """Micro-batches over the rows of nonzero length: at most ``max_rows`` rows, and at most
    ``max_tokens`` padded tokens (rows x longest row) unless one row alone is longer (0: no
    token budget)."""
    assert max_rows > 0 and max_tokens >= 0, (max_rows, max_tokens)
    order = torch.argsort(lengths_B, descending=True, stable=True)
    order = order[lengths_B[order] > 0].tolist()
    lengths = lengths_B.tolist()
    out, start = [], 0
    while start < len(order):
        longest = lengths[order[start]]  # sorted: the first row of a group is its longest
        rows = max_rows if not max_tokens else min(max_rows, max(1, max_tokens // longest))
        group = order[start : start + rows]
        out.append(MicroBatch(torch.tensor(group, dtype=torch.long), longest))
        start += len(group)
    return out
