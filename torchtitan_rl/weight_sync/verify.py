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
    """Engine-owned tensors still hold their required value, every element.

    One concatenation and comparison per (dtype, value) and one host sync:
    checking tensor by tensor was a few launches per attention layer on the
    critical path of each sync.
    """
    if not constants:
        return 0
    groups: dict[tuple[torch.dtype, float], list[tuple[str, torch.Tensor]]] = {}
    for name, (tensor, value) in constants.items():
        groups.setdefault((tensor.dtype, value), []).append((name, tensor))
    wrong = torch.stack([(torch.cat([t.reshape(-1) for _, t in g]) != v).any() for (_, v), g in groups.items()])
    if bool(wrong.any()):
        names = [n for (_, v), g in groups.items() for n, t in g if not bool((t == v).all())]
        raise RuntimeError(f"weight_sync: engine-owned tensors changed: {names}")
    return len(constants)
