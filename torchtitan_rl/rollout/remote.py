"""Generators on their own ranks (weight_sync.transport = "nccl"): their serving loop and the trainer's client.

torchrun starts T + R processes: ranks 0..T-1 train (FSDP over them, their
default process group excludes the rest), the last R ranks each hold one
generator replica on its own device (distributed/world.py's ``init_world``;
R = generator.parallelism.data_parallel_replicate_degree). Trainer rank 0
drives; each replica answers its own mailbox in order:

    trainer rank 0 (RemoteGenerator)          each generator replica (serve)
    "start"                                   builds its sync plan (NcclReceiver)
    "sync"     + NcclSender.sync (all ranks)  NcclReceiver.receive (one broadcast feeds all replicas)
    "generate" {its block of prompts,         Generator.generate -> the pickled Rollouts
                first_prompt, n, seed, ...}
    "stop"     (also after a trainer error)   closes the engine, returns

A request's prompts are split over the replicas in contiguous blocks
(``prompt_blocks``); each replica seeds its samples by their global prompt
index (``first_prompt``), and the blocks' rollouts are concatenated in
replica order, so a batch is the same whatever R (bit for bit on CPU;
elsewhere up to the float rounding of other batch shapes, none in
batch-invariant mode).

Messages and rollouts go through the job's store, one key each, deleted by
the reader, so the store does not grow; the weights go over the broadcast
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

import pickle
import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan_rl import compat
from torchtitan_rl.config import JobConfig
from torchtitan_rl.engine.generator import Generator
from torchtitan_rl.rollout.base import Later, Rollouts, prompt_blocks
from torchtitan_rl.models.shape import ModelShape
from torchtitan_rl.distributed.world import World
from torchtitan_rl.weight_sync.nccl_receiver import NcclReceiver
from torchtitan_rl.weight_sync.nccl_sender import NcclSender
from torchtitan_rl.weight_sync.store import store_value, who

_PREFIX = "torchtitan_rl/generator"
_POLL_S = 1.0
"""How often the generator, waiting for a sync's data, checks whether the trainer moved on."""


class _Mailbox:
    """Numbered pickled messages between trainer rank 0 and one replica through the job's store; the reader
    deletes each key it reads."""

    def __init__(self, store: dist.Store, *, timeout_s: float, peer: str, replica: int = 0) -> None:
        self.store = dist.PrefixStore(f"{_PREFIX}/{replica}", store)
        self.timeout_s, self.peer = timeout_s, peer
        self.sent = {"msg": 0, "reply": 0}
        self.read = {"msg": 0, "reply": 0}

    def put(self, box: str, value) -> None:
        self.store.set(f"{box}/{self.sent[box]}", pickle.dumps(value))
        self.sent[box] += 1

    def waiting(self, box: str) -> bool:
        """Whether the next ``box`` entry has arrived."""
        return self.store.check([f"{box}/{self.read[box]}"])

    def get(self, box: str, what: str):
        key = f"{box}/{self.read[box]}"
        raw = store_value(self.store, key, self.timeout_s)
        if raw is None:
            raise RuntimeError(
                f"generator: no {what} from the {self.peer} within weight_sync.peer_timeout_s "
                f"({self.timeout_s:g} s); did it crash?"
            )
        value = pickle.loads(raw)
        self.store.delete_key(key)
        self.read[box] += 1
        return value


# ---------------------------------------------------------------- trainer side


class RemoteGenerator:
    """The trainer's view of the generator replicas; every trainer rank calls each method together.

    Built after the Trainer (``init_world`` first, so the Trainer took the
    trainer-only default group). The constructor returns once every replica
    has built its sync plan from the trainer's keys (its engine start included).
    """

    def __init__(self, cfg: JobConfig, *, reference: dict[str, torch.Tensor], world: World) -> None:
        assert world.role == "trainer"
        self.world = world
        self.mailboxes = [
            _Mailbox(world.store, timeout_s=cfg.weight_sync.peer_timeout_s, peer=_who(r, world.replicas), replica=r)
            for r in range(world.replicas)
        ]
        if world.sender:
            for mailbox in self.mailboxes:
                mailbox.put("msg", {"op": "start"})
        self.sender = NcclSender(
            cfg.weight_sync, reference=reference, world=world, timeout_s=cfg.weight_sync.peer_timeout_s
        )
        self.requests = 0
        """Generate requests posted (each to every replica); the replicas answer them in this order."""
        self.answered = 0
        """Trainer rank 0: requests whose replies (one per replica) have been read from the store."""
        self.replies: dict[int, list[dict]] = {}
        """Trainer rank 0: each replica's reply, by request number, whose result has not been taken yet."""

    def sync(self, state: dict[str, torch.Tensor], *, version: int) -> float:
        """Send ``state`` to every replica, which serves ``version`` to the requests submitted after this;
        seconds the transfer took, once the requests submitted before have been answered."""
        if self.world.sender:
            self._collect(self.requests - 1)  # the replicas reach the sync only after them
            for parts in self.replies.values():
                failed = [(r, part["error"]) for r, part in enumerate(parts) if "error" in part]
                if failed:  # that replica has stopped: say why rather than wait for it
                    raise RuntimeError(f"{_who(failed[0][0], self.world.replicas)}: {failed[0][1]}")
            for mailbox in self.mailboxes:
                mailbox.put("msg", {"op": "sync"})
        return self.sender.sync(state, version=version).seconds

    def submit(self, prompts: list[list[int]], **generate_kwargs) -> Later:
        """Post Generator.generate's arguments (``n``, ``stop_token_ids``, ``seed``, ...), each replica its
        contiguous block of ``prompts``, and return."""
        if self.world.sender:
            for mailbox, (a, b) in zip(self.mailboxes, prompt_blocks(len(prompts), self.world.replicas)):
                mailbox.put("msg", {"op": "generate", "prompts": prompts[a:b], "first_prompt": a, **generate_kwargs})
        number = self.requests
        self.requests += 1
        return Later(lambda: self._take(number))

    def rollouts(self, prompts: list[list[int]], **generate_kwargs) -> Rollouts:
        """Generator.generate on the replicas; every rank gets the rollouts."""
        return self.submit(prompts, **generate_kwargs).result()

    def _collect(self, number: int) -> None:
        """Trainer rank 0: read every replica's replies up to request ``number`` from the store."""
        while self.answered <= number:
            self.replies[self.answered] = [m.get("reply", "rollouts") for m in self.mailboxes]
            self.answered += 1

    def _take(self, number: int) -> Rollouts:
        """Request ``number``'s rollouts, the replicas' blocks in order, on every trainer rank (collective)."""
        payload = [None]
        if self.world.sender:
            self._collect(number)
            parts = self.replies.pop(number)
            failed = [(r, part["error"]) for r, part in enumerate(parts) if "error" in part]
            if failed:
                payload = [{"error": f"{_who(failed[0][0], self.world.replicas)}: {failed[0][1]}"}]
            else:
                payload = [{"rollouts": Rollouts.concat([part["rollouts"] for part in parts])}]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(payload, src=0)  # the trainer ranks' group
        reply = payload[0]
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["rollouts"]

    def close(self) -> None:
        """Tell every replica to shut its engine down and exit (also after an error here)."""
        if self.world.sender:
            for mailbox in self.mailboxes:
                mailbox.put("msg", {"op": "stop"})


def _who(replica: int, replicas: int) -> str:
    return who(replica, replicas, alone="generator rank")


# -------------------------------------------------------------- generator side


def serve(cfg: JobConfig, *, world: World, shape: ModelShape, workdir: Path) -> None:
    """One generator replica's whole run: build the engine, answer trainer rank 0 until "stop"."""
    assert world.role == "generator"
    if world.replicas > 1:  # each writes the config.json its engine reads: not one file rewritten under another
        workdir = workdir / f"replica{world.replica}"
    with compat.vllm_device(world.device):  # this rank's GPU, not cuda:0
        generator = Generator(
            cfg.generator, model_config=cfg.model, shape=shape, seed=cfg.job.seed,
            device=world.device.type, workdir=workdir, batch_invariant=cfg.batch_invariant_mode,
        )
    try:
        mailbox = _Mailbox(world.store, timeout_s=cfg.weight_sync.peer_timeout_s, peer="trainer",
                           replica=world.replica)
        if mailbox.get("msg", "start message")["op"] == "stop":  # the trainer failed before its first sync
            return
        receiver = NcclReceiver(generator=generator, world=world, timeout_s=cfg.weight_sync.peer_timeout_s)
        while True:
            request = mailbox.get("msg", "request")
            op = request.pop("op")
            if op == "stop":
                return
            if op == "sync":
                _receive(receiver, mailbox, cfg.weight_sync.peer_timeout_s)
                continue
            assert op == "generate", op
            try:
                rollouts = generator.generate(request.pop("prompts"), **request)
            except Exception as e:  # the trainer raises it too, rather than wait for rollouts
                mailbox.put("reply", {"error": f"{type(e).__name__}: {e}"})
                raise
            mailbox.put("reply", {"rollouts": rollouts})
    finally:
        generator.close()


def _receive(receiver: NcclReceiver, mailbox: _Mailbox, timeout_s: float) -> None:
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
