"""Did the bytes arrive? Cheap checks run on every sync.

``sampled`` compares a few tensors per sync, rotating so that every tensor is
compared within len(keys) / samples syncs; ``full`` compares all of them.
The comparison is exact: the generator's tensor must equal the trainer's
tensor cast to the generator dtype, bit for bit.
"""

import torch


def pick_entries(keys: list[str], level: str, samples: int, version: int) -> set[str]:
    if level == "off" or not keys:
        return set()
    if level == "full":
        return set(keys)
    start = (version * samples) % len(keys)
    return {keys[(start + i) % len(keys)] for i in range(min(samples, len(keys)))}


def verify_constants(constants: dict[str, tuple[torch.Tensor, float]]) -> int:
    """Engine-owned tensors still hold their required value (one fused check)."""
    if not constants:
        return 0
    names = list(constants)
    values = torch.stack([constants[n][0].float().reshape(-1)[0] for n in names])
    expected = torch.tensor([constants[n][1] for n in names], device=values.device)
    wrong = (values != expected).tolist()
    if any(wrong):
        raise RuntimeError(
            f"weight_sync: engine-owned tensors changed: {[n for n, w in zip(names, wrong) if w]}"
        )
    return len(names)
