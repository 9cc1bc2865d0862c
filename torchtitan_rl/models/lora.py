"""LoRA on torchtitan's decoder (both families), the same on the trainer and in the generator.

An adapted linear keeps its base parameter under its own name (``wo.weight``)
and gains ``wo.lora_a`` [r, in] and ``wo.lora_b`` [out, r]; its output is
``base(x) + (dropout(x) @ A.T @ B.T) * alpha / r``. Base names never change,
so checkpoints, HF loading and the base part of the sync plan are those of
the plain model. The adapter is never merged into a base tensor: the
generator either applies it unmerged (sync="adapter") or receives
``W + scale * B @ A`` freshly computed from the trainer's untouched W
(sync="merged"). No base tensor ever holds W + BA, so nothing can add BA
twice, whatever order syncs and resumes come in.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_rl.config import LoRAConfig
from torchtitan_rl.distributed.dtensor import full
from torchtitan_rl.kernels.batch_invariant import bi_linear

LORA_SUFFIXES = (".lora_a", ".lora_b")


def is_lora_key(name: str) -> bool:
    return name.endswith(LORA_SUFFIXES)


def target_linears(model: nn.Module, config: LoRAConfig) -> list[tuple[str, nn.Linear]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in config.target_modules
    ]


def _lora_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = self._lora_base_forward(x)
    a, b = self.lora_a, self.lora_b
    h = self.lora_dropout(x).to(a.dtype)
    if getattr(self, "batch_invariant", False):
        delta = bi_linear(bi_linear(h, a), b)
    else:
        delta = F.linear(F.linear(h, a), b)
    return out + (delta * self.lora_scale).to(out.dtype)


def apply_lora(model: nn.Module, config: LoRAConfig, *, flat: bool = False, train: bool = True) -> None:
    """Give every target linear an adapter (in place).

    train: freeze everything else, init A ~ kaiming-uniform and B = 0 (the
    adapted model starts equal to the base). flat: allocate all adapter
    tensors as views of one buffer, so an adapter sync is one copy.
    """
    targets = target_linears(model, config)
    assert targets, f"no linear named {config.target_modules}"
    r = config.rank
    shapes = [((r, m.in_features), (m.out_features, r)) for _, m in targets]
    buffer = None
    if flat:
        ref = targets[0][1].weight
        total = sum(math.prod(sa) + math.prod(sb) for sa, sb in shapes)
        buffer = torch.zeros(total, dtype=ref.dtype, device=ref.device)
    offset = 0
    for (_, m), (shape_a, shape_b) in zip(targets, shapes):
        tensors = []
        for shape in (shape_a, shape_b):
            n = math.prod(shape)
            if buffer is not None:
                t = buffer[offset : offset + n].view(shape)
                offset += n
            else:
                t = torch.zeros(shape, dtype=m.weight.dtype, device=m.weight.device)
            tensors.append(t)
        a, b = tensors
        if train:
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        m.lora_a = nn.Parameter(a, requires_grad=train)
        m.lora_b = nn.Parameter(b, requires_grad=train)
        m.lora_scale = config.alpha / r
        m.lora_dropout = nn.Dropout(config.dropout) if train and config.dropout else nn.Identity()
        m._lora_base_forward = m.forward
        m.forward = _lora_forward.__get__(m)
    if train:
        for name, p in model.named_parameters():
            p.requires_grad_(is_lora_key(name))


def merged_state(state: dict[str, torch.Tensor], config: LoRAConfig) -> dict[str, torch.Tensor]:
    """The adapted model as plain weights: W + scale * B @ A, adapters dropped.

    Computed from the trainer's untouched base, in fp32; sharded DTensors are
    gathered (collectively, the same keys in the same order on every rank).
    """
    scale = config.alpha / config.rank
    merged = {}
    for name, t in state.items():
        if is_lora_key(name):
            continue
        prefix = name[: -len(".weight")] if name.endswith(".weight") else None
        if prefix is not None and f"{prefix}.lora_a" in state:
            w, a, b = (full(state[k]) for k in (name, f"{prefix}.lora_a", f"{prefix}.lora_b"))
            merged[name] = w.float() + scale * (b.float() @ a.float())
        else:
            merged[name] = t
    return merged

