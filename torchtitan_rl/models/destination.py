"""Where one trainer tensor lands in the generator: the type engine/vllm_model.py hands to weight_sync/plan.py.

It lives in models/, the lower of the two packages, so that the model adapter does not import weight_sync.
"""

from typing import NamedTuple

import torch


class Destination(NamedTuple):
    """A view into generator memory and the shape the trainer's tensor has."""

    view: torch.Tensor
    source_shape: torch.Size
