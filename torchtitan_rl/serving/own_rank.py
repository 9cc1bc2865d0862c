"""A generator on its own rank (weight_sync.transport = "nccl"): the replica's whole run, and the mailbox protocol
it answers (the trainer's side: rollout/remote.py's RemoteGenerator).

torchrun starts T + R processes: ranks 0..T-1 train (FSDP over them, their
default process group excludes the rest), the last R ranks each hold one
generator replica on its own device (distributed/world.py's ``init_world``;
R = generator.parallelism.data_parallel_replicate_degree). Trainer rank 0
drives; each replica answers its own mailbox in order:

    trainer rank 0 (RemoteGenerator)          each generator replica (serve)
    "start"                                   builds its sync plan (NcclReceiver)
    "sync"     + NcclSender.sync (all ranks)  NcclReceiver.receive (one broadcast feeds all replicas)
    "generate" {its block of prompts,         Engine.generate -> the pickled Rollouts; with "stream", each
                first_prompt, n, seed, ...}     finished group first, on a box of its own ("group")
    "stop"     (also after a trainer error)   closes the engine, returns

With generator.inflight_updates a "sync" that arrives while a "generate" runs
is received between two of its engine steps (``_sync_in_flight``): the
running samples go on with the new weights, each token recording its version
(docs/design.md, "Partial rollouts and in-flight updates").

A request's prompts are split over the replicas in contiguous blocks
(``prompt_blocks``); each replica seeds its samples by their global prompt
index (``first_prompt``), and the blocks' rollouts are concatenated in
replica order, so a batch is the same whatever R (bit for bit on CPU;
elsewhere up to the float rounding of other batch shapes, none in
batch-invariant mode).

Messages and rollouts go through the job's store, one key each (in parts
beyond ``PART_BYTES``), deleted by the reader, so the store does not grow; the weights go over the broadcast
group of NcclSender/NcclReceiver. A replica answers in order, so a
"generate" posted before a "sync" is served with the weights before it:
``submit`` posts and returns, and the trainer trains while the generators
work (grpo.max_staleness); ``sync`` first collects the replies still
owed, since each replica reaches the sync only after them. The generators
need no task and no prompt RNG: each request carries its prompts and seed,
so a resumed trainer (RNG state from the checkpoint) drives them unchanged.
Every wait that only a crash on the other side could make endless gives up
after ``weight_sync.peer_timeout_s`` with a RuntimeError.
"""

import functools
import pickle
import time
from pathlib import Path

import torch.distributed as dist

from torchtitan_rl import compat
from torchtitan_rl.config import JobConfig
from torchtitan_rl.distributed.world import World
from torchtitan_rl.engine.engine import Engine
from torchtitan_rl.engine.rollouts import SyncPoint
from torchtitan_rl.models.shape import ModelShape
from torchtitan_rl.weight_sync.nccl_receiver import NcclReceiver
from torchtitan_rl.weight_sync.store import store_value

_PREFIX = "torchtitan_rl/generator"
_POLL_S = 1.0
"""How often the generator, waiting for a sync's data, checks whether the trainer moved on."""
PART_BYTES = 4 << 20
"""A message is stored in parts of at most this many bytes: the libuv TCPStore (torchrun's default) drops the
connection of a client that sets a value over 8 MiB, and a step's rollouts at 8k-token samples are ~100 MB."""
_WHOLE, _PARTS = b"W", b"P"
"""The first byte of a message's key: the pickled message follows, or the number of its parts (keys KEY.0, ...)."""


class Mailbox:
    """Numbered pickled messages between trainer rank 0 and one replica through the job's store; the reader
    deletes each key it reads."""

    def __init__(self, store: dist.Store, *, timeout_s: float, peer: str, replica: int = 0) -> None:
        self.store = dist.PrefixStore(f"{_PREFIX}/{replica}", store)
        self.timeout_s, self.peer = timeout_s, peer
        self.sent = {"msg": 0, "reply": 0, "group": 0}
        self.read = {"msg": 0, "reply": 0, "group": 0}
        self._head: dict[str, tuple[object, list[str]]] = {}
        """A box's next entry once peeked, with the keys holding it: loaded once (generator.inflight_updates peeks
        at every engine step, and a queued "generate" carrying partial samples is tens of MB), deleted by get."""

    def put(self, box: str, value) -> None:
        key, data = f"{box}/{self.sent[box]}", pickle.dumps(value)
        if len(data) <= PART_BYTES:
            self.store.set(key, _WHOLE + data)
        else:  # the parts first: the reader waits for the key itself, set last
            parts = range(0, len(data), PART_BYTES)
            for i, start in enumerate(parts):
                self.store.set(f"{key}.{i}", data[start:start + PART_BYTES])
            self.store.set(key, _PARTS + str(len(parts)).encode())
        self.sent[box] += 1

    def _load(self, key: str, raw: bytes) -> tuple[object, list[str]]:
        """The message whose key holds ``raw``, its parts read, and the keys holding it (parts first)."""
        kind, rest = raw[:1], raw[1:]
        assert kind in (_WHOLE, _PARTS), f"{key}: not a mailbox message"
        keys = []
        if kind == _PARTS:
            keys = [f"{key}.{i}" for i in range(int(rest))]
            rest = b"".join(self.store.get(k) for k in keys)
        return pickle.loads(rest), [*keys, key]

    def waiting(self, box: str) -> bool:
        """Whether the next ``box`` entry has arrived."""
        return box in self._head or self.store.check([f"{box}/{self.read[box]}"])

    def arrived(self, box: str, index: int) -> bool:
        """Whether ``box`` entry ``index`` is there (not yet read: the reader deletes what it reads)."""
        return self.store.check([f"{box}/{index}"])

    def peek(self, box: str):
        """The next ``box`` entry if it has arrived (left for ``get``), else None; does not wait."""
        if box not in self._head:
            if not self.waiting(box):
                return None
            key = f"{box}/{self.read[box]}"
            self._head[box] = self._load(key, self.store.get(key))
        return self._head[box][0]

    def get(self, box: str, what: str):
        if box in self._head:
            value, keys = self._head.pop(box)
        else:
            key = f"{box}/{self.read[box]}"
            raw = store_value(self.store, key, self.timeout_s)
            if raw is None:
                raise RuntimeError(
                    f"generator: no {what} from the {self.peer} within weight_sync.peer_timeout_s "
                    f"({self.timeout_s:g} s); did it crash?"
                )
            value, keys = self._load(key, raw)
        for k in keys:
            self.store.delete_key(k)
        self.read[box] += 1
        return value


def serve(cfg: JobConfig, *, world: World, shape: ModelShape, workdir: Path) -> None:
    """One generator replica's whole run: build the engine, answer trainer rank 0 until "stop"."""
    assert world.role == "generator"
    if world.replicas > 1:  # each writes the config.json its engine reads: not one file rewritten under another
        workdir = workdir / f"replica{world.replica}"
    with compat.vllm_device(world.device):  # this rank's GPU, not cuda:0
        generator = Engine(
            cfg.generator, model_config=cfg.model, shape=shape, seed=cfg.job.seed,
            device=world.device.type, workdir=workdir, batch_invariant=cfg.batch_invariant_mode,
        )
    if world.replica == 0:
        print("\n".join(generator.start_lines()), flush=True)
    try:
        mailbox = Mailbox(world.store, timeout_s=cfg.weight_sync.peer_timeout_s, peer="trainer",
                           replica=world.replica)
        if mailbox.get("msg", "start message")["op"] == "stop":  # the trainer failed before its first sync
            return
        receiver = NcclReceiver(generator=generator, world=world, timeout_s=cfg.weight_sync.peer_timeout_s)
        served = 0
        """Generate requests answered: the trainer numbers them alike."""
        while True:
            request = mailbox.get("msg", "request")
            op = request.pop("op")
            if op == "stop":
                return
            if op == "sync":
                _receive(receiver, mailbox, cfg.weight_sync.peer_timeout_s)
                continue
            assert op == "generate", op
            between_steps = None
            if cfg.generator.inflight_updates:  # a sync posted meanwhile lands between two engine steps
                between_steps = SyncPoint(
                    pending=functools.partial(_sync_waits, mailbox),
                    apply=functools.partial(_sync_in_flight, receiver, mailbox, cfg.weight_sync.peer_timeout_s))
            on_group = None
            if request.pop("stream", False):  # generator.stream_groups: each group as soon as it is finished
                on_group = functools.partial(_post_group, mailbox, request=served, first=request["first_prompt"])
            try:
                rollouts = generator.generate(request.pop("prompts"), between_steps=between_steps, on_group=on_group,
                                              **request)
            except Exception as e:  # the trainer raises it too, rather than wait for rollouts
                mailbox.put("reply", {"error": f"{type(e).__name__}: {e}"})
                raise
            mailbox.put("reply", {"rollouts": rollouts})  # after its groups: the trainer's end of the stream
            served += 1
    finally:
        generator.close()


def _post_group(mailbox: Mailbox, group: int, rollouts, *, request: int, first: int) -> None:
    """generator.stream_groups: one finished group of request ``request``, numbered in the whole request."""
    mailbox.put("group", {"request": request, "group": first + group, "rollouts": rollouts})


def _sync_waits(mailbox: Mailbox) -> bool:
    """generator.inflight_updates: a sync is at the head of the mailbox (a "generate" at the head waits: it was
    posted before the syncs behind it)."""
    return (message := mailbox.peek("msg")) is not None and message["op"] == "sync"


def _sync_in_flight(receiver: NcclReceiver, mailbox: Mailbox, timeout_s: float) -> None:
    """generator.inflight_updates: the syncs at the head of the mailbox, received now, between two engine steps
    of the generate in progress."""
    while _sync_waits(mailbox):
        mailbox.get("msg", "request")
        _receive(receiver, mailbox, timeout_s)


def _receive(receiver: NcclReceiver, mailbox: Mailbox, timeout_s: float) -> None:
    """One sync. A trainer that rejects its state dict sends nothing and stops: don't wait for it."""
    deadline = time.monotonic() + timeout_s
    while receiver.receive(timeout_s=_POLL_S) is None:
        if mailbox.waiting("msg"):  # the next message ("stop") came instead of the sync's data
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"generator: the trainer announced a sync but sent nothing within weight_sync.peer_timeout_s "
                f"({timeout_s:g} s); did it crash?"
            )
