"""Weight sync, trainer side, to generators on their own devices: NCCL broadcasts (gloo on CPU).

One sync, trainer side (``NcclSender.sync``, called on every trainer rank):
skip frozen tensors unchanged since they last moved, check names and shapes
(host only, the same on every rank: an error there sends nothing); publish a
header (version, which tensors, bucket size); then per bucket: gather the
shards (every rank), cast them into one flat send buffer in plan order (rank
0), broadcast it. Two send buffers: bucket i+1 is gathered and packed while
bucket i is in flight. The NaN/inf (and tie) scan of the fp32 masters runs on
a side stream while the first two buckets are packed and sent, and its verdict
(all-reduced over the trainer ranks) follows them: the generator has written
nothing by then, so a rejected sync still leaves it on its previous weights,
and the scan costs no time on the wire's critical path. A float64 checksum
(sum, sum of |x|) of some tensors as cast (the same choice as
``verify``/``verify_samples``) follows the last bucket. The call returns once
every replica has answered; a rejected state dict raises ValueError (naming
the tensors) on every trainer rank, a failure on any replica RuntimeError.

Ordering on CUDA: the broadcasts run on the process group's NCCL stream, the
packing/unpacking on the current stream. Each broadcast waits (an event the
process group records) for what the current stream has queued before it;
``work.wait()`` makes the current stream wait for a broadcast before the
buffer it used is packed (trainer) or read (generator) again. No host sync
inside the loop.
"""

import json
import time

import torch
import torch.distributed as dist

from torchtitan_rl.config import WeightSyncConfig
from torchtitan_rl.distributed.world import STORE_PREFIX, World, broadcast
from torchtitan_rl.weight_sync.buckets import LEAD, Bucket, Buckets, aligned, bucket_keys, checksum
from torchtitan_rl.weight_sync.store import answers, who
from torchtitan_rl.weight_sync.sync import SyncStats, WeightSync
from torchtitan_rl.weight_sync.verify import pick_entries


class NcclSender:
    """Trainer side: every trainer rank builds one and calls ``sync`` together.

    ``reference`` fixes keys, shapes and tied keys as for WeightSync. The
    constructor sends only metadata and returns once every generator replica
    has built its plan (a plan error raises here, with that replica's message).
    ``bucket_bytes`` overrides ``config.bucket_mb`` (tests use a few KiB to get
    many buckets out of a tiny model); it may be changed between syncs.
    ``timeout_s`` bounds the wait for the replicas' plans (their engines start
    meanwhile) and for their answers to each sync; None waits as long as it takes.
    """

    def __init__(self, config: WeightSyncConfig, *, reference: dict[str, torch.Tensor], world: World,
                 name: str = "weights", bucket_bytes: int | None = None, timeout_s: float | None = None):
        assert world.role == "trainer"
        self.config, self.world = config, world
        self.ws = WeightSync(config, reference=reference)
        """Validation, key order, tied keys and the unchanged-buffer skip, as in place."""
        self.store = dist.PrefixStore(f"{STORE_PREFIX}/{name}", world.store)
        self.bucket_bytes = bucket_bytes or config.bucket_mb << 20
        self.timeout_s = timeout_s
        self.syncs = 0
        """Syncs published so far (rejected ones are not)."""
        if world.sender:
            self.store.set("sources", json.dumps({
                "keys": [[k, list(t.shape), str(t.dtype).removeprefix("torch.")] for k, t in reference.items()],
                "aliases": self.ws.aliases,
            }))
        # Each replica proves coverage on its own model; all must accept before anything moves.
        replies = [json.loads(a) for a in answers(self.store, "plan", world.replicas, timeout_s,
                                                  what="plan", hint=" (did it start?)")]
        for r, reply in enumerate(replies):
            if "error" in reply:
                raise ValueError(f"weight_sync: {who(r, world.replicas)} rejected the plan: {reply['error']}")
        reply = replies[0]
        # One broadcast feeds every replica, so all must want the same wire dtypes (same config, same model).
        assert all(r["dtypes"] == reply["dtypes"] for r in replies), "replicas disagree on the wire dtypes"
        self.layout = {
            k: (getattr(torch, reply["dtypes"][k]), reference[k].shape) for k in self.ws.keys
        }
        self.nbytes = {k: aligned(s.numel() * d.itemsize) for k, (d, s) in self.layout.items()}
        self.buffers = Buckets(world.device, self.layout, self.nbytes)
        self._side = torch.cuda.Stream(world.device) if world.device.type == "cuda" else None

    @torch.no_grad()
    def sync(self, state: dict[str, torch.Tensor], *, version: int) -> SyncStats:
        start = time.perf_counter()
        ws = self.ws
        ws.check_structure(state)  # the same verdict on every trainer rank; nothing was sent
        unchanged = ws.unchanged(state, ws.keys)
        keys = [k for k in ws.keys if k not in unchanged]
        self.syncs += 1
        n, limit = self.syncs, self.bucket_bytes
        check = pick_entries(keys, self.config.verify, self.config.verify_samples, version)
        if self.world.sender:
            moved = set(keys)
            self.store.set(f"header/{n}", json.dumps({
                "version": version, "moved": "".join("1" if k in moved else "0" for k in ws.keys),
                "bucket_bytes": limit, "verify": self.config.verify, "samples": self.config.verify_samples,
            }))
        flags = self._send(state, keys, check, limit)
        replies = answers(self.store, f"ack/{n}", self.world.replicas, self.timeout_s, what=f"answer to sync {n}")
        failed = [(r, a) for r, a in enumerate(replies) if a not in ("ok", "rejected")]
        if failed:
            ws.forget_moved()  # that replica serves nothing now
            r, answer = failed[0]
            raise RuntimeError(
                f"weight_sync: {who(r, self.world.replicas)} failed sync {n} (version {version}): {answer}"
            )
        if "rejected" in replies:
            # One verdict, broadcast to all: every replica dropped the sync and kept its version.
            assert set(replies) == {"rejected"}, replies
            ws.raise_problems(flags, keys)  # every rank holds the reduced flags: all raise alike
            raise AssertionError("the generator rejected a sync whose scan was clean")
        ws.mark_moved(state, keys)
        return SyncStats(version, time.perf_counter() - start, sum(self.nbytes[k] for k in keys), len(check))

    def _scan(self, state: dict[str, torch.Tensor], keys: list[str]) -> torch.Tensor:
        """This rank's problem flags, queued on a side stream (CUDA) so that packing starts meanwhile."""
        if self.world.device.type != "cuda":
            return self.ws.problem_flags(state, keys)
        current = torch.cuda.current_stream()
        self._side.wait_stream(current)  # the scan sees the optimizer's last writes
        with torch.cuda.stream(self._side):
            return self.ws.problem_flags(state, keys)

    def _verdict(self, flags: torch.Tensor):
        """Reduce the flags over the trainer ranks; the sender broadcasts 1 if any is set."""
        if self.world.device.type == "cuda":
            # Also orders the next optimizer step after the scan's reads.
            torch.cuda.current_stream().wait_stream(self._side)
        if dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if not self.world.sender:
            return None
        verdict = flags.amax(dim=0, keepdim=True) if flags.numel() else flags.new_zeros(1)
        return broadcast(self.world.group, verdict, root=0), verdict  # keep it alive until sent

    def _send(self, state: dict[str, torch.Tensor], keys: list[str], check: set[str], limit: int) -> torch.Tensor:
        """Buckets, the scan's verdict after the first two, checksums; returns the reduced problem flags."""
        sender = self.world.sender
        if sender:
            buckets = self.buffers.get(keys, limit)
        else:
            buckets = [Bucket(g, (), ()) for g in bucket_keys(keys, self.nbytes, limit)]
        works, sums, flags, verdict = [None, None], [], None, None
        for i, bucket in enumerate(buckets):
            if i == LEAD:
                verdict = self._verdict(flags)
            # Every trainer rank joins the gathers (FSDP shards cast to the wire dtype first).
            sources = self.ws.sources(state, bucket.keys, [self.layout[k][0] for k in bucket.keys])
            if sender:
                slot = i % 2
                if works[slot] is not None:
                    works[slot].wait()  # bucket i-2 has left this buffer
                torch._foreach_copy_(bucket.views[slot], sources)  # the cast to the generator's dtype happens here
                works[slot] = broadcast(self.world.group, bucket.flat[slot], root=0)
                sums += [checksum(v) for k, v in zip(bucket.keys, bucket.views[slot]) if k in check]
            if i == 0:  # queued behind the first bucket: its host time overlaps the wire
                flags = self._scan(state, keys)
        if flags is None:
            flags = self._scan(state, keys)
        if len(buckets) <= LEAD:
            verdict = self._verdict(flags)
        if sender:
            works.append(verdict[0])
            if sums:
                works.append(broadcast(self.world.group, torch.stack(sums), root=0))
            for w in works:
                if w is not None:
                    w.wait()
        return flags
