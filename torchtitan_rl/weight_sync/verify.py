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

    One concatenation and one comparison per dtype: checking tensor by tensor
    was a few launches per attention layer on the critical path of each sync.
    """
    groups: dict[torch.dtype, list[tuple[str, torch.Tensor, float]]] = {}
    for name, (tensor, value) in constants.items():
        groups.setdefault(tensor.dtype, []).append((name, tensor, value))
    for group in groups.values():
        values = torch.cat([t.reshape(-1) for _, t, _ in group])
        expected = torch.cat([torch.full((t.numel(),), v, dtype=t.dtype) for _, t, v in group])  # host, tiny
        if not torch.equal(values, expected.to(values.device)):
            wrong = [name for name, t, v in group if not bool((t == v).all())]
            raise RuntimeError(f"weight_sync: engine-owned tensors changed: {wrong}")
    return len(constants)
