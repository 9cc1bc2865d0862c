"""Weight sync, generator side: receive the trainer's NCCL broadcasts into the generator's tensors.

Engine side (``NcclReceiver.receive``, on every replica alike): wait for a header, gate the
generator (``begin_sync``: generate() waits), post the receives of the first
two buckets and the verdict; on a clean verdict unpack each bucket as it lands
with one ``torch._foreach_copy_`` into the plan's destination views while the
next one arrives (a rejected one is received and dropped, and the old version
stays published). Then compare the checksums with its own tensors, check the
engine-owned constants, and only then publish the version (``finish_sync``).
A failed check marks the generator unservable (``abort_sync``) rather than
serving mixed weights; a failure before the first write (a trainer that died
while the lead buckets were in flight) leaves the previous version published.

Ordering on CUDA: see nccl_sender.py.
"""

import json
import threading
import time

import torch
import torch.distributed as dist

from torchtitan_rl.distributed.world import STORE_PREFIX, World, broadcast
from torchtitan_rl.engine.engine import PrefixCacheKept
from torchtitan_rl.weight_sync.buckets import LEAD, Buckets, aligned, checksum
from torchtitan_rl.weight_sync.plan import SyncPlan, build_plan
from torchtitan_rl.weight_sync.store import get_text
from torchtitan_rl.weight_sync.sync import SyncStats
from torchtitan_rl.weight_sync.target import SyncTarget
from torchtitan_rl.weight_sync.verify import pick_entries, verify_constants


class NcclReceiver:
    """Engine side (one per replica): builds the plan from the trainer's metadata; ``receive`` applies one sync.

    Every replica receives the same broadcasts; each answers for itself
    (``plan/<replica>``, ``ack/<sync>/<replica>`` in the store).

    ``receive`` may run on the thread that generates (between generate calls)
    or on a background thread: it holds ``lock`` from the header to the
    published version, so a caller that wraps its generate calls in ``lock``
    never has a sync start under a running generation. generate() calls made
    after the sync began wait in the generator's own gate (they need
    ``generator.wait_for_weights_s`` > 0 to wait rather than raise).
    ``timeout_s`` bounds the wait for the trainer's tensor list; None waits
    as long as it takes.
    """

    def __init__(self, *, generator: SyncTarget, world: World, name: str = "weights", timeout_s: float | None = None):
        assert world.role == "generator"
        self.generator, self.world = generator, world
        self.replica = world.replica
        self.store = dist.PrefixStore(f"{STORE_PREFIX}/{name}", world.store)
        sources = get_text(self.store, "sources", timeout_s)
        if sources is None:
            raise RuntimeError(f"weight_sync: no tensor list from the trainer within {timeout_s} s (did it start?)")
        self.plan = self._build_plan(json.loads(sources))
        self.entries = {e.source: e for e in self.plan.entries}
        self.keys = [e.source for e in self.plan.entries]
        # Wire layout as the destinations' shapes (same elements as the trainer's): the unpack needs no reshape.
        self.layout = {e.source: (e.dest.dtype, e.dest.shape) for e in self.plan.entries}
        self.nbytes = {k: aligned(s.numel() * d.itemsize) for k, (d, s) in self.layout.items()}
        self.buffers = Buckets(world.device, self.layout, self.nbytes)
        self.syncs = 0
        self._wrote = False
        """Whether the current sync has written into the generator's tensors yet."""
        self.lock = threading.Lock()
        self.syncing = threading.Event()
        """Set from the header until the version is published (or the sync failed)."""

    def _build_plan(self, meta: dict) -> SyncPlan:
        """The plan and its coverage proof from metadata only: a stand-in tensor per trainer key.

        A stand-in has the trainer tensor's shape and dtype and its own storage
        (a 0-d tensor expanded); tied keys share their primary's stand-in, so
        build_plan sees exactly the trainer's shapes and ties.
        """
        sources: dict[str, torch.Tensor] = {}
        for key, shape, dtype in meta["keys"]:
            primary = meta["aliases"].get(key)
            sources[key] = sources[primary] if primary else torch.empty((), dtype=getattr(torch, dtype)).expand(shape)
        model = self.generator.model
        try:
            plan = build_plan(
                sources=sources, destinations=model.sync_targets(),
                generator_tensors=model.all_tensors(), constants=model.engine_constants(),
            )
        except ValueError as e:
            self.store.set(f"plan/{self.replica}", json.dumps({"error": str(e)}))
            raise
        with torch.no_grad():
            for tensor, value in plan.constants.values():
                tensor.fill_(value)
        self.store.set(f"plan/{self.replica}", json.dumps(
            {"dtypes": {e.source: str(e.dest.dtype).removeprefix("torch.") for e in plan.entries}}
        ))
        return plan

    def pending(self) -> bool:
        """Whether the next sync's header has arrived (no wait: a poll that the store does not log)."""
        return self.store.check([f"header/{self.syncs + 1}"])

    @torch.no_grad()
    def receive(self, timeout_s: float | None = None) -> SyncStats | None:
        """Apply the next sync; None if no header came within ``timeout_s`` (None: wait for it)."""
        n = self.syncs + 1
        header = get_text(self.store, f"header/{n}", timeout_s)
        if header is None:
            return None
        start = time.perf_counter()
        info = json.loads(header)
        version = info["version"]
        keys = [k for k, bit in zip(self.keys, info["moved"]) if bit == "1"]
        check = pick_entries(keys, info["verify"], info["samples"], version)
        gen = self.generator
        self._wrote = False
        with self.lock:
            previous = gen.weight_version
            gen.begin_sync()
            self.syncing.set()
            try:
                verified = self._receive(keys, check, info["bucket_bytes"])
                if verified is not None:
                    verified += verify_constants(self.plan.constants)
                if self.world.device.type == "cuda":
                    torch.cuda.current_stream().synchronize()  # every unpack has landed
                gen.finish_sync(version if verified is not None else previous)
            except BaseException as e:
                if self._wrote:
                    gen.abort_sync()  # some tensors hold the new version, some the old: serve nothing
                elif not isinstance(e, PrefixCacheKept):  # (that one withdrew the version itself)
                    # e.g. the trainer died before the verdict: nothing was written, the old version stands
                    gen.finish_sync(previous)
                self.syncing.clear()
                self.syncs = n
                self.store.set(f"ack/{n}/{self.replica}", f"{type(e).__name__}: {e}")
                raise
            self.syncing.clear()
        self.syncs = n
        self.store.set(f"ack/{n}/{self.replica}", "ok" if verified is not None else "rejected")
        if verified is None:  # the trainer raises the ValueError that names the tensors
            return SyncStats(previous, time.perf_counter() - start, 0, 0, rejected=True)
        return SyncStats(version, time.perf_counter() - start, sum(self.nbytes[k] for k in keys), verified)

    def _receive(self, keys: list[str], check: set[str], limit: int) -> int | None:
        """Tensors checksummed; None if the trainer's verdict rejected the sync (nothing written)."""
        buckets = self.buffers.get(keys, limit)
        group = self.world.group
        works = [None] * len(buckets)

        def post(i: int) -> None:
            works[i] = broadcast(group, buckets[i].flat[i % 2], root=0)

        lead = min(LEAD, len(buckets))
        for i in range(lead):
            post(i)
        verdict = torch.zeros(1, dtype=torch.uint8, device=self.world.device)
        broadcast(group, verdict, root=0).wait()
        if verdict.item():  # one host sync; the buckets in flight are not unpacked
            for i in range(lead, len(buckets)):
                post(i)
            if check:  # the sender's checksums of the tensors it packed
                broadcast(group, torch.empty(len(check), 2, dtype=torch.float64, device=self.world.device),
                           root=0).wait()
            for w in works:
                w.wait()
            return None
        for i, bucket in enumerate(buckets):
            works[i].wait()
            if bucket.dests is None:
                bucket.dests = [self.entries[k].dest for k in bucket.keys]
            self._wrote = True
            torch._foreach_copy_(bucket.dests, bucket.views[i % 2])
            if i + 2 < len(buckets):
                post(i + 2)  # the process group orders it after the unpack just queued
        if not check:
            return 0
        checked = [k for k in keys if k in check]  # the sender's order: plan order within buckets
        theirs = torch.empty(len(checked), 2, dtype=torch.float64, device=self.world.device)
        broadcast(group, theirs, root=0).wait()
        mine = torch.stack([checksum(self.entries[k].dest) for k in checked])
        # Same bytes, same kernels: equal up to float64 summation order; a one-ulp
        # change of a single bf16 element moves the sum by far more than this.
        # NaN compares false, so a NaN left in the generator fails the "<=".
        bad = (~((mine - theirs).abs() <= 1e-12 * theirs[:, 1:2])).any(dim=1).tolist()
        if any(bad):
            raise RuntimeError(
                f"weight_sync: checksums differ after the sync: {[k for k, b in zip(checked, bad) if b]}"
            )
        return len(checked)
