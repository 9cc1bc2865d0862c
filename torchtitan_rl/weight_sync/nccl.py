"""Weight sync to generators on their own GPUs: NCCL between processes (gloo on CPU).

The layout is one torchrun world of T + R processes: ranks 0..T-1 train, the
last R ranks each hold one generator replica (vLLM in process, on its own
device). ``init_world`` sets it up so that nothing in the trainer changes:

- the trainer ranks' *default* process group spans the trainer ranks only,
  so FSDP/ParallelDims (built on the default world), the trainer's own
  collectives and WeightSync's validation all-reduces run as they do
  without generator ranks; each generator's default group is itself alone,
  and vLLM builds its groups on that;
- trainer rank 0 and every generator rank share one group (``group``: R + 1
  ranks, built directly on the job's store) that carries the weights: each
  bucket is ONE broadcast from trainer rank 0 to all replicas, never one
  send per replica (NCCL pipelines it down a chain or tree: the sender's
  link carries the bytes once, whatever R);
- metadata goes through the job's TCP store: the trainer's key/shape/dtype
  list at startup (each replica builds its own sync plan and coverage proof
  from it, and answers with the dtype it wants each tensor in), one header
  per sync, read by every replica, and each replica's answer after it (the
  sender waits for all R). Nothing waits inside NCCL between syncs, so no
  NCCL timeout runs while the trainer trains.

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

Generator side (``NcclReceiver.receive``, on every replica alike): wait for a header, gate the
generator (``begin_sync``: generate() waits), post the receives of the first
two buckets and the verdict; on a clean verdict unpack each bucket as it lands
with one ``torch._foreach_copy_`` into the plan's destination views while the
next one arrives (a rejected one is received and dropped, and the old version
stays published). Then compare the checksums with its own tensors, check the
engine-owned constants, and only then publish the version (``finish_sync``).
A failed check marks the generator unservable (``abort_sync``) rather than
serving mixed weights; a failure before the first write (a trainer that died
while the lead buckets were in flight) leaves the previous version published.

Ordering on CUDA: the broadcasts run on the process group's NCCL stream, the
packing/unpacking on the current stream. Each broadcast waits (an event the
process group records) for what the current stream has queued before it;
``work.wait()`` makes the current stream wait for a broadcast before the
buffer it used is packed (trainer) or read (generator) again. No host sync
inside the loop.
"""

import json
import os
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from torchtitan_rl.config import WeightSyncConfig
from torchtitan_rl.weight_sync.plan import SyncPlan, build_plan
from torchtitan_rl.weight_sync.dtensor import local as _local
from torchtitan_rl.weight_sync.signed_store import ForgedMessage
from torchtitan_rl.weight_sync.sync import SyncStats, WeightSync
from torchtitan_rl.weight_sync.verify import pick_entries, verify_constants

_ALIGN = 16
"""Bytes; every tensor starts aligned in the flat buffers (vectorised copies, dtype views)."""
_LEAD = 2
"""Buckets sent before the validation verdict: the generator's two receive buffers hold them unwritten."""
_CHECKSUM_CHUNK = 1 << 25
"""Elements converted to float64 at a time by a checksum (256 MiB)."""
_PREFIX = "torchtitan_rl/weight_sync"


@dataclass
class World:
    """Where this process sits: a trainer rank or one of the generator replicas."""

    role: str
    """"trainer" or "generator"."""
    rank: int
    """torchrun rank (also the default-group rank on trainer ranks; 0 there on a generator)."""
    trainer_ranks: int
    device: torch.device
    store: dist.Store
    """The job's store (torchrun's), for metadata."""
    group: object | None
    """c10d backend of the weight broadcast: trainer rank 0 is its rank 0, replica r its rank 1 + r; None on
    the other trainer ranks."""
    replicas: int = 1
    """Generator replicas (the last ``replicas`` torchrun ranks)."""
    replica: int = 0
    """Generator side: this replica's index, 0..replicas-1 (its prompts block, its store keys)."""

    @property
    def sender(self) -> bool:
        return self.role == "trainer" and self.rank == 0


def init_world(device_type: str, *, replicas: int = 1, timeout_s: float = 3600.0) -> World:
    """Join torchrun's world as a trainer rank or as one of ``replicas`` generator ranks (the last ones).

    The trainer ranks' default process group spans the trainer ranks only: the
    Trainer then reuses it (``init_process_group`` keeps an existing group), so
    its meshes, FSDP and every default-group collective exclude the generators
    without a line of trainer code knowing. Each generator rank's default group
    is itself alone; its vLLM engine builds its groups on it. ``timeout_s``
    (trainer.collective_timeout_s) bounds each collective of the default groups.
    """
    assert not dist.is_initialized(), "init_world must create the process groups"
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if world_size < replicas + 1:
        raise ValueError(f"weight_sync.transport=nccl: needs >= {replicas + 1} ranks (trainers + {replicas} "
                         f"generator replicas), got {world_size}")
    trainers = world_size - replicas
    store, _, _ = next(dist.rendezvous("env://"))
    cuda = device_type == "cuda"
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    role = "generator" if rank >= trainers else "trainer"
    replica = rank - trainers if role == "generator" else 0
    # Trainer ranks: a default group of the trainer ranks. A generator: a default
    # group of its own, which vLLM then reuses. Left to vLLM, its one-rank
    # init_process_group("tcp://...") would, under torchrun
    # (TORCHELASTIC_USE_AGENT_STORE=1), connect as a client to a store nobody
    # serves and wait until its timeout (seen on 2 H200s).
    group_rank, group_size = (rank, trainers) if role == "trainer" else (0, 1)
    prefix = f"{_PREFIX}/trainer" if role == "trainer" else f"{_PREFIX}/generator/{replica}"
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=dist.PrefixStore(prefix, store),
        rank=group_rank, world_size=group_size, device_id=device if cuda else None,
        timeout=timedelta(seconds=timeout_s),
    )
    group = None
    if rank == 0 or role == "generator":
        group = broadcast_group(dist.PrefixStore(f"{_PREFIX}/weights", store), rank=0 if rank == 0 else 1 + replica,
                                size=1 + replicas, device=device)
    return World(role, rank, trainers, device, store, group, replicas=replicas, replica=replica)


def broadcast_group(store: dist.Store, *, rank: int, size: int, device: torch.device, timeout_s: float = 1800.0):
    """The c10d group of trainer rank 0 (rank 0) and ``size - 1`` generators (ranks 1..) on ``store``.

    Returns once every member joined and the communicator exists. It is
    created before the generators' vLLM engines where possible: vLLM's
    batch-invariant mode sets NCCL_PROTO=Simple, one channel, etc. in its
    process, and a communicator created after that would not match the
    trainer's (seen on 2 H200s: the first sync hung after two buckets).
    ``timeout_s`` bounds each collective: on gloo a peer that died mid-sync
    raises at once (its socket closes); on NCCL nothing notices before the
    timeout, and torch's NCCL watchdog then ends the process (nothing waits
    inside NCCL between syncs, so only a sync can time out).
    """
    if device.type == "cuda":
        try:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timedelta(seconds=timeout_s)
            group = dist.ProcessGroupNCCL(store, rank, size, opts)
        except TypeError:  # a torch without the Options overload
            group = dist.ProcessGroupNCCL(store, rank, size)
    else:
        group = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))
    _broadcast(group, torch.zeros(1, device=device), root=0).wait()
    return group


def pair_group(store: dist.Store, *, rank: int, device: torch.device, timeout_s: float = 1800.0):
    """``broadcast_group`` of trainer rank 0 (rank 0) and one generator (rank 1): the rollout server's."""
    return broadcast_group(store, rank=rank, size=2, device=device, timeout_s=timeout_s)


# ---------------------------------------------------------------- shared pieces


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _buckets(keys: list[str], nbytes: dict[str, int], limit: int) -> list[list[str]]:
    """Consecutive key groups of at most ``limit`` wire bytes (one tensor may exceed it alone)."""
    buckets, current, size = [], [], 0
    for key in keys:
        if current and size + nbytes[key] > limit:
            buckets.append(current)
            current, size = [], 0
        current.append(key)
        size += nbytes[key]
    if current:
        buckets.append(current)
    return buckets


def _views(buf: torch.Tensor, keys: list[str], layout: dict[str, tuple[torch.dtype, torch.Size]],
           nbytes: dict[str, int]) -> list[torch.Tensor]:
    """Each key's slice of a flat uint8 buffer, as its wire dtype and (trainer) shape."""
    out, offset = [], 0
    for k in keys:
        dtype, shape = layout[k]
        size = torch.Size(shape).numel() * dtype.itemsize
        out.append(buf[offset : offset + size].view(dtype).view(shape))
        offset += nbytes[k]
    return out


def _broadcast(group, tensor: torch.Tensor, root: int):
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = root, 0
    return group.broadcast([tensor], opts)


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """float64 [sum, sum |x|] of ``t`` in row-major order, in bounded chunks."""
    flat = t.reshape(-1)
    total = torch.zeros(2, dtype=torch.float64, device=t.device)
    for chunk in flat.split(_CHECKSUM_CHUNK):
        x = chunk.double()
        total += torch.stack([x.sum(), x.abs().sum()])
    return total


def store_value(store: dist.Store, key: str, timeout_s: float | None) -> bytes | None:
    """The value of ``key`` once set; None after ``timeout_s`` (None: wait forever).

    Waits in slices of at most 60 s: one store.wait with the whole timeout
    would hit the store's own default limit first. A forged value (a
    SignedStore's) is skipped: the genuine one, when it comes, overwrites it.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        wait = 60.0 if deadline is None else max(0.001, min(60.0, deadline - time.monotonic()))
        try:
            store.wait([key], timedelta(seconds=wait))
            return store.get(key)
        except (dist.DistStoreError, ForgedMessage) as e:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            if isinstance(e, ForgedMessage):
                time.sleep(0.05)


def _get(store: dist.Store, key: str, timeout_s: float | None) -> str | None:
    value = store_value(store, key, timeout_s)
    return None if value is None else value.decode()


def _who(replica: int, replicas: int) -> str:
    return "the generator" if replicas == 1 else f"generator replica {replica}"


def answers(store: dist.Store, key: str, replicas: int, timeout_s: float | None, *, what: str,
            hint: str = "") -> list[str]:
    """Each replica's value of ``key``/<replica>, in replica order, all within one ``timeout_s``.

    Raises RuntimeError naming the first replica that has not answered: the
    sender never goes on with fewer than all of them.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    out = []
    for r in range(replicas):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        value = _get(store, f"{key}/{r}", left)
        if value is None:
            raise RuntimeError(f"weight_sync: no {what} from {_who(r, replicas)} within {timeout_s} s{hint}")
        out.append(value)
    return out


@dataclass
class _Bucket:
    keys: list[str]
    flat: tuple[torch.Tensor, ...]
    """The bucket's bytes in send/receive buffer 0 and in buffer 1."""
    views: tuple[list[torch.Tensor], ...]
    """Each key's slice of ``flat[0]`` and of ``flat[1]``, as its wire dtype and layout shape."""
    dests: list[torch.Tensor] | None = None
    """Generator side: the plan's destination view per key, looked up on first use."""


class _Buckets:
    """Two flat uint8 buffers and, per (key list, bucket size), the buckets with their views.

    Built on the first sync that moves those keys and reused after: building
    ~300 views per sync on the host sat on the critical path of both sides.
    Growing the buffers drops the cached views (they would keep the old ones alive).
    """

    def __init__(self, device: torch.device, layout: dict[str, tuple[torch.dtype, torch.Size]],
                 key_bytes: dict[str, int]):
        self.device, self.layout, self.key_bytes = device, layout, key_bytes
        self.bufs: list[torch.Tensor] = []
        self._cache: dict[tuple[tuple[str, ...], int], list[_Bucket]] = {}

    def get(self, keys: list[str], limit: int) -> list[_Bucket]:
        cache_key = (tuple(keys), limit)
        if cache_key not in self._cache:
            groups = _buckets(keys, self.key_bytes, limit)
            sizes = [sum(self.key_bytes[k] for k in g) for g in groups]
            if max(sizes, default=0) > (self.bufs[0].numel() if self.bufs else 0):
                self._cache.clear()
                self.bufs = [torch.empty(max(sizes), dtype=torch.uint8, device=self.device) for _ in range(2)]
            self._cache[cache_key] = [
                _Bucket(g, tuple(b[:n] for b in self.bufs),
                        tuple(_views(b, g, self.layout, self.key_bytes) for b in self.bufs))
                for g, n in zip(groups, sizes)
            ]
        return self._cache[cache_key]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.bufs)


# ---------------------------------------------------------------- trainer side


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
        self.store = dist.PrefixStore(f"{_PREFIX}/{name}", world.store)
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
                raise ValueError(f"weight_sync: {_who(r, world.replicas)} rejected the plan: {reply['error']}")
        reply = replies[0]
        # One broadcast feeds every replica, so all must want the same wire dtypes (same config, same model).
        assert all(r["dtypes"] == reply["dtypes"] for r in replies), "replicas disagree on the wire dtypes"
        self.layout = {
            k: (getattr(torch, reply["dtypes"][k]), reference[k].shape) for k in self.ws.keys
        }
        self.nbytes = {k: _aligned(s.numel() * d.itemsize) for k, (d, s) in self.layout.items()}
        self.buffers = _Buckets(world.device, self.layout, self.nbytes)
        self._side = torch.cuda.Stream(world.device) if world.device.type == "cuda" else None

    @torch.no_grad()
    def sync(self, state: dict[str, torch.Tensor], *, version: int) -> SyncStats:
        start = time.perf_counter()
        ws = self.ws
        unchanged = ws._unchanged(state, ws.keys)
        keys = [k for k in ws.keys if k not in unchanged]
        ws.check_structure(state)  # the same verdict on every trainer rank; nothing was sent
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
            ws._moved.clear()  # that replica serves nothing now: the next sync moves everything
            r, answer = failed[0]
            raise RuntimeError(
                f"weight_sync: {_who(r, self.world.replicas)} failed sync {n} (version {version}): {answer}"
            )
        if "rejected" in replies:
            # One verdict, broadcast to all: every replica dropped the sync and kept its version.
            assert set(replies) == {"rejected"}, replies
            ws.raise_problems(flags, keys)  # every rank holds the reduced flags: all raise alike
            raise AssertionError("the generator rejected a sync whose scan was clean")
        for k in keys:
            if not state[k].requires_grad:
                ws._moved[k] = (weakref.ref(state[k]), _local(state[k])._version)
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
        return _broadcast(self.world.group, verdict, root=0), verdict  # keep it alive until sent

    def _send(self, state: dict[str, torch.Tensor], keys: list[str], check: set[str], limit: int) -> torch.Tensor:
        """Buckets, the scan's verdict after the first two, checksums; returns the reduced problem flags."""
        sender = self.world.sender
        if sender:
            buckets = self.buffers.get(keys, limit)
        else:
            buckets = [_Bucket(g, (), ()) for g in _buckets(keys, self.nbytes, limit)]
        works, sums, flags, verdict = [None, None], [], None, None
        for i, bucket in enumerate(buckets):
            if i == _LEAD:
                verdict = self._verdict(flags)
            # Every trainer rank joins the gathers (FSDP shards cast to the wire dtype first).
            sources = self.ws.sources(state, bucket.keys, [self.layout[k][0] for k in bucket.keys])
            if sender:
                slot = i % 2
                if works[slot] is not None:
                    works[slot].wait()  # bucket i-2 has left this buffer
                torch._foreach_copy_(bucket.views[slot], sources)  # the cast to the generator's dtype happens here
                works[slot] = _broadcast(self.world.group, bucket.flat[slot], root=0)
                sums += [_checksum(v) for k, v in zip(bucket.keys, bucket.views[slot]) if k in check]
            if i == 0:  # queued behind the first bucket: its host time overlaps the wire
                flags = self._scan(state, keys)
        if flags is None:
            flags = self._scan(state, keys)
        if len(buckets) <= _LEAD:
            verdict = self._verdict(flags)
        if sender:
            works.append(verdict[0])
            if sums:
                works.append(_broadcast(self.world.group, torch.stack(sums), root=0))
            for w in works:
                if w is not None:
                    w.wait()
        return flags


# -------------------------------------------------------------- generator side


class NcclReceiver:
    """Generator side (one per replica): builds the plan from the trainer's metadata; ``receive`` applies one sync.

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

    def __init__(self, *, generator, world: World, name: str = "weights", timeout_s: float | None = None):
        assert world.role == "generator"
        self.generator, self.world = generator, world
        self.replica = world.replica
        self.store = dist.PrefixStore(f"{_PREFIX}/{name}", world.store)
        sources = _get(self.store, "sources", timeout_s)
        if sources is None:
            raise RuntimeError(f"weight_sync: no tensor list from the trainer within {timeout_s} s (did it start?)")
        self.plan = self._build_plan(json.loads(sources))
        self.entries = {e.source: e for e in self.plan.entries}
        self.keys = [e.source for e in self.plan.entries]
        # Wire layout as the destinations' shapes (same elements as the trainer's): the unpack needs no reshape.
        self.layout = {e.source: (e.dest.dtype, e.dest.shape) for e in self.plan.entries}
        self.nbytes = {k: _aligned(s.numel() * d.itemsize) for k, (d, s) in self.layout.items()}
        self.buffers = _Buckets(world.device, self.layout, self.nbytes)
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
        header = _get(self.store, f"header/{n}", timeout_s)
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
            except BaseException as e:
                if self._wrote:
                    gen.abort_sync()  # some tensors hold the new version, some the old: serve nothing
                else:  # e.g. the trainer died before the verdict: nothing was written, the old version stands
                    gen.finish_sync(previous)
                self.syncing.clear()
                self.syncs = n
                self.store.set(f"ack/{n}/{self.replica}", f"{type(e).__name__}: {e}")
                raise
            gen.finish_sync(version if verified is not None else previous)
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
            works[i] = _broadcast(group, buckets[i].flat[i % 2], root=0)

        lead = min(_LEAD, len(buckets))
        for i in range(lead):
            post(i)
        verdict = torch.zeros(1, dtype=torch.uint8, device=self.world.device)
        _broadcast(group, verdict, root=0).wait()
        if verdict.item():  # one host sync; the buckets in flight are not unpacked
            for i in range(lead, len(buckets)):
                post(i)
            if check:  # the sender's checksums of the tensors it packed
                _broadcast(group, torch.empty(len(check), 2, dtype=torch.float64, device=self.world.device),
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
        _broadcast(group, theirs, root=0).wait()
        mine = torch.stack([_checksum(self.entries[k].dest) for k in checked])
        # Same bytes, same kernels: equal up to float64 summation order; a one-ulp
        # change of a single bf16 element moves the sum by far more than this.
        # NaN compares false, so a NaN left in the generator fails the "<=".
        bad = (~((mine - theirs).abs() <= 1e-12 * theirs[:, 1:2])).any(dim=1).tolist()
        if any(bad):
            raise RuntimeError(
                f"weight_sync: checksums differ after the sync: {[k for k, b in zip(checked, bad) if b]}"
            )
        return len(checked)
