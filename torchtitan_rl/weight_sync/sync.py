"""Colocated weight sync: the trainer's tensors into the generator's, in place.

One ``sync`` call: validate the whole state dict (names, shapes, finite
values) before anything is written, then move it bucket by bucket (gather
sharded DTensors, cast, copy into the generator's views), verify, and only
then publish the new weight version. Every trainer rank calls ``sync`` (the
gathers are collective); only the rank that holds the generator writes.
"""

import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan_rl.config import LoRAConfig, WeightSyncConfig
from torchtitan_rl.models.lora import is_lora_key, merged_state
from torchtitan_rl.distributed.dtensor import full_many, local as _local, needs_gather as _needs_gather
from torchtitan_rl.weight_sync.buckets import bucket_keys
from torchtitan_rl.weight_sync.plan import SyncPlan, build_plan, source_aliases
from torchtitan_rl.weight_sync.target import SyncTarget
from torchtitan_rl.weight_sync.verify import verify_constants, pick_entries


@dataclass
class SyncStats:
    version: int
    seconds: float
    bytes_written: int
    tensors_verified: int
    rejected: bool = False
    """The trainer's scan rejected the state dict; nothing was written (NCCL receiver)."""


class WeightSync:
    """Moves trainer state dicts into a colocated generator.

    ``reference`` is the trainer's state dict at startup: it fixes the key
    order, shapes and tied keys that every later ``sync`` must match. With
    LoRA in adapter mode the first sync moves everything and later ones only
    the adapter tensors (in the generator they are views of one flat buffer,
    written by one fused multi-tensor copy); in merged mode every sync moves
    ``W + scale * B @ A`` computed from the trainer's untouched base.
    """

    def __init__(
        self,
        config: WeightSyncConfig,
        *,
        reference: dict[str, torch.Tensor],
        generator: SyncTarget | None = None,
        lora: LoRAConfig | None = None,
        gather_device: torch.device | None = None,
    ):
        self.config = config
        self.generator = generator
        self.lora = lora if lora is not None and lora.rank > 0 else None
        self.gather_device = gather_device
        """Where FSDP shards are gathered; None: where they live (trainer.cpu_offload: the accelerator, not the CPU)."""
        reference = self._source(reference)
        self.aliases = source_aliases(reference)
        self.keys = [k for k in reference if k not in self.aliases]
        self.shapes = {k: t.shape for k, t in reference.items()}
        adapter_mode = self.lora is not None and self.lora.sync == "adapter"
        self.adapter_keys = [k for k in self.keys if is_lora_key(k)] if adapter_mode else []
        self.base_synced = False
        """Adapter mode: the base went over once in this process; later syncs move adapters only."""
        self.plan: SyncPlan | None = None
        if generator is not None:
            model = generator.model
            self.plan = build_plan(
                sources=reference,
                destinations=model.sync_targets(),
                generator_tensors=model.all_tensors(),
                constants=model.engine_constants(),
            )
            for tensor, value in self.plan.constants.values():
                tensor.fill_(value)
        self.sizes = {k: reference[k].numel() * reference[k].element_size() for k in self.keys}
        self.gathered = {k for k in self.keys if _needs_gather(reference[k])}
        """Keys whose shards live on several ranks (the layout is fixed at startup)."""
        self.wire: dict[str, torch.dtype] = {}
        """Gathered keys' dtypes in the generator (rank 0's plan, on every rank): shards are cast before their
        all-gather (half the bytes of fp32 masters), the same cast as after it, so the same bits arrive."""
        if self.gathered:  # every rank builds its WeightSync together (its syncs' gathers are collective)
            wire = [{e.source: e.dest.dtype for e in self.plan.entries if e.source in self.gathered}
                    if self.plan is not None else {}]
            dist.broadcast_object_list(wire, src=0)
            self.wire = wire[0]
        self._moved: dict[str, tuple[weakref.ref, int]] = {}
        """Frozen tensors as they were when last moved: (the tensor, its version counter)."""
        self._full_next = False
        """The generator dropped its weights (sleep level 2): the next sync moves, and verifies, every tensor."""

    def _source(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return merged_state(state, self.lora) if self.lora is not None and self.lora.sync == "merged" else state

    def _buckets(self, keys: list[str]) -> list[list[str]]:
        """Key groups of at most bucket_mb (trainer-side bytes); same on every rank."""
        return bucket_keys(keys, self.sizes, self.config.bucket_mb << 20)

    def validate(self, state: dict[str, torch.Tensor], keys: list[str] | None = None) -> None:
        """Reject a state dict before anything is written; the error names the tensor."""
        self.check_structure(state)
        self.check_values(state, self.keys if keys is None else keys)

    def check_values(self, state: dict[str, torch.Tensor], keys: list[str]) -> None:
        """Non-finite values and tied tensors that differ, over every rank's shards (``check_structure`` first)."""
        flags = self.problem_flags(state, keys)
        if dist.is_initialized() and any(isinstance(state[k], DTensor) for k in keys):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # a NaN in any rank's shard
        self.raise_problems(flags, keys)  # the one host sync of a clean validation

    def check_structure(self, state: dict[str, torch.Tensor]) -> None:
        """Names and shapes: host only, and the same verdict on every rank (shapes are global)."""
        missing = [k for k in self.shapes if k not in state]
        extra = [k for k in state if k not in self.shapes]
        if missing or extra:
            raise ValueError(f"weight_sync: state dict missing {missing}, unexpected {extra}")
        bad = [f"{k} {tuple(state[k].shape)} != {tuple(s)}" for k, s in self.shapes.items() if state[k].shape != s]
        if bad:
            raise ValueError(f"weight_sync: wrong shape: {bad}")

    def problem_flags(self, state: dict[str, torch.Tensor], keys: list[str]) -> torch.Tensor:
        """uint8 per key (non-finite) then per tied key (differs from its primary), on
        the gather device (else the tensors') and without a host sync: this rank's shards only.

        One fused multi-tensor max-|x| pass (the inf-norm): it cannot overflow,
        so only NaN (which it propagates, as clip_grad_norm_'s nonfinite check
        relies on) and inf make it non-finite; no second look is needed.
        """
        # trainer.cpu_offload: parameters on the CPU, buffers on the accelerator; the flags go where gathers run.
        device = self.gather_device or _local(state[self.keys[0]]).device
        parts = []
        if keys:
            norms = torch._foreach_norm([_local(state[k]) for k in keys], ord=float("inf"))
            if len({n.dtype for n in norms}) > 1:
                norms = [n.float() for n in norms]
            if len({n.device for n in norms}) > 1:
                norms = [n.to(device) for n in norms]
            parts.append((~torch.isfinite(torch.stack(norms))).to(device))
        for key, primary in self.aliases.items():
            a, b = _local(state[key]), _local(state[primary])
            same_storage = a.data_ptr() == b.data_ptr()
            parts.append(torch.zeros(1, dtype=torch.bool, device=device) if same_storage
                         else (a != b).any().view(1).to(device))
        if not parts:
            return torch.zeros(0, dtype=torch.uint8, device=device)
        return torch.cat(parts).to(torch.uint8)

    def raise_problems(self, flags: torch.Tensor, keys: list[str]) -> None:
        """ValueError naming the flagged tensors (``flags`` from problem_flags, reduced over ranks)."""
        bad = flags.tolist()
        nonfinite = [k for k, b in zip(keys, bad) if b]
        if nonfinite:
            raise ValueError(f"weight_sync: non-finite values (NaN/inf) in {nonfinite}")
        for (key, primary), b in zip(self.aliases.items(), bad[len(keys):]):
            if b:
                raise ValueError(f"weight_sync: {key} must equal its tied tensor {primary}")

    @torch.no_grad()
    def sync(self, state: dict[str, torch.Tensor], *, version: int) -> SyncStats:
        start = time.perf_counter()
        state = self._source(state)
        gen = self.generator
        # Every rank learns of a discard together (rollout/colocated.py sleeps them all): the keys stay collective.
        assert gen is None or not gen.weights_discarded or self._full_next, "weights_discarded() was not called"
        full = self._full_next
        keys = self.adapter_keys if self.adapter_keys and self.base_synced else self.keys
        self.check_structure(state)  # before anything indexes it: a missing key is a ValueError naming it
        unchanged = self.unchanged(state, keys)
        keys = [k for k in keys if k not in unchanged] if unchanged else keys
        self.check_values(state, keys)
        if gen is not None:
            gen.begin_sync()
        try:
            if full and self.plan is not None:
                for tensor, value in self.plan.constants.values():  # engine-owned, dropped with the rest
                    tensor.fill_(value)
            verified = self._move(state, keys, version, verify="full" if full else self.config.verify)
            if gen is not None:
                verified += verify_constants(self.plan.constants)
        except BaseException:
            if gen is not None:
                gen.abort_sync()
            raise
        if gen is not None:
            gen.finish_sync(version)
        self._full_next = False
        self.base_synced = True
        self.mark_moved(state, keys)
        return SyncStats(version, time.perf_counter() - start, sum(self.sizes[k] for k in keys), verified)

    def mark_moved(self, state: dict[str, torch.Tensor], keys: list[str]) -> None:
        """Remember which frozen tensors just reached the generator (``unchanged`` skips them next time)."""
        for k in keys:
            if not state[k].requires_grad:
                self._moved[k] = (weakref.ref(state[k]), _local(state[k])._version)

    def forget_moved(self) -> None:
        """The generator lost its weights: the next sync moves every tensor."""
        self._moved.clear()

    def weights_discarded(self) -> None:
        """The generator dropped its weights (sleep level 2), on every rank at once: the next sync moves every
        tensor of the plan (buffers, a LoRA run's base and the engine's constants included) and verifies all."""
        self.forget_moved()
        self.base_synced = False
        self._full_next = True

    def unchanged(self, state: dict[str, torch.Tensor], keys: list[str]) -> set[str]:
        """Frozen tensors (buffers such as the RoPE cache, a LoRA run's base) not
        modified since they last moved: the same tensor object with the same
        version counter, which every in-place write bumps. All ranks agree."""
        candidates = [k for k in keys if k in self._moved and not state[k].requires_grad]
        if not candidates:
            return set()
        same = [self._moved[k][0]() is state[k] and self._moved[k][1] == _local(state[k])._version for k in candidates]
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = _local(state[candidates[0]]).device  # NCCL reduces device tensors only
            flags = torch.tensor(same, dtype=torch.uint8, device=device)
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
            same = flags.tolist()
        return {k for k, s in zip(candidates, same) if s}

    def sources(self, state: dict[str, torch.Tensor], keys: list[str],
                dtypes: list[torch.dtype] | None = None) -> list[torch.Tensor]:
        """The whole tensors of ``keys``, collectively on every rank: one all-gather
        per bucket for FSDP shards (in ``dtypes`` when given), local tensors as they
        are when the startup layout had nothing to gather (decided once, not per tensor)."""
        if not self.gathered:  # trainer.cpu_offload on one rank: the shards come to the accelerator first
            return [_local(state[k]) if self.gather_device is None else _local(state[k]).to(self.gather_device)
                    for k in keys]
        return full_many([state[k] for k in keys], dtypes, self.gather_device)

    def _move(self, state: dict[str, torch.Tensor], keys: list[str], version: int, *, verify: str) -> int:
        entries = {e.source: e for e in self.plan.entries} if self.plan is not None else {}
        check = pick_entries(keys, verify, self.config.verify_samples, version)
        verified = 0
        for bucket in self._buckets(keys):
            sources = self.sources(state, bucket, [self.wire.get(k, state[k].dtype) for k in bucket])
            if self.plan is None:
                continue
            dests = [entries[k].dest for k in bucket]
            torch._foreach_copy_(dests, [s.view(d.shape) for s, d in zip(sources, dests)])
            verified += _verify(bucket, sources, dests, check)
        return verified


def _verify(keys, sources, dests, check: set[str]) -> int:
    verified = 0
    for key, src, dst in zip(keys, sources, dests):
        if key in check:
            if not torch.equal(dst, src.view(dst.shape).to(dst.device, dst.dtype)):  # trainer.cpu_offload: CPU
                raise RuntimeError(f"weight_sync: {key} did not arrive in the generator")
            verified += 1
    return verified
