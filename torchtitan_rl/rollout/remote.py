"""The trainer's client of the generators on their own ranks (weight_sync.transport = "nccl").

torchrun starts T + R processes: ranks 0..T-1 train, the last R each run one generator replica
(serving/own_rank.py says what each replica does and the mailbox protocol between them). Trainer rank 0
posts every message; every trainer rank joins the weight broadcast (NcclSender) and gets the rollouts.
A "generate" posted before a "sync" is served with the weights before it: ``submit`` posts and returns,
and the trainer trains while the generators work (grpo.max_staleness); ``sync`` first collects the
replies still owed, since each replica reaches the sync only after them.
"""

import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from torchtitan_rl.config import JobConfig
from torchtitan_rl.distributed.world import World
from torchtitan_rl.rollout.base import Later, Rollouts, block_request, prompt_blocks
from torchtitan_rl.serving.own_rank import Mailbox
from torchtitan_rl.weight_sync.nccl_sender import NcclSender
from torchtitan_rl.weight_sync.store import who


class RemoteGenerator:
    """The trainer's view of the generator replicas; every trainer rank calls each method together.

    Built after the Trainer (``init_world`` first, so the Trainer took the
    trainer-only default group). The constructor returns once every replica
    has built its sync plan from the trainer's keys (its engine start included).
    """

    def __init__(self, cfg: JobConfig, *, reference: dict[str, torch.Tensor], world: World) -> None:
        assert world.role == "trainer"
        self.world = world
        self.engines = world.replicas
        self.mailboxes = [
            Mailbox(world.store, timeout_s=cfg.weight_sync.peer_timeout_s, peer=_who(r, world.replicas), replica=r)
            for r in range(world.replicas)
        ]
        if world.sender:
            for mailbox in self.mailboxes:
                mailbox.put("msg", {"op": "start"})
        self.sender = NcclSender(
            cfg.weight_sync, reference=reference, world=world, timeout_s=cfg.weight_sync.peer_timeout_s
        )
        self.inflight = cfg.generator.inflight_updates
        """A sync lands in the generate in progress (serving/own_rank.py): it waits for no reply."""
        self.requests = 0
        """Generate requests posted (each to every replica); the replicas answer them in this order."""
        self.answered = 0
        """Trainer rank 0: requests whose replies (one per replica) have been read from the store."""
        self.replies: dict[int, list[dict]] = {}
        """Trainer rank 0: each replica's reply, by request number, whose result has not been taken yet."""
        self.streamed: dict[int, list[tuple[int, Rollouts]]] = {}
        """Trainer rank 0 (generator.stream_groups): groups read, by request number, not yet handed out."""

    def sync(self, state: dict[str, torch.Tensor], *, version: int) -> float:
        """Send ``state`` to every replica, which serves ``version`` to the requests submitted after this;
        seconds the transfer took, once the requests submitted before have been answered (with
        generator.inflight_updates at once: the running requests' next tokens are sampled with ``version``)."""
        if self.world.sender:
            if not self.inflight:
                self._collect(self.requests - 1)  # the replicas reach the sync only after them
            for parts in self.replies.values():
                failed = [(r, part["error"]) for r, part in enumerate(parts) if "error" in part]
                if failed:  # that replica has stopped: say why rather than wait for it
                    raise RuntimeError(f"{_who(failed[0][0], self.world.replicas)}: {failed[0][1]}")
            for mailbox in self.mailboxes:
                mailbox.put("msg", {"op": "sync"})
        return self.sender.sync(state, version=version).seconds

    def submit(self, prompts: list[list[int]], **generate_kwargs) -> Later:
        """Post Engine.generate's arguments (``n``, ``stop_token_ids``, ``seed``, ...), each replica its
        contiguous block of ``prompts``, and return."""
        if self.world.sender:
            for mailbox, (a, b) in zip(self.mailboxes, prompt_blocks(len(prompts), self.engines)):
                block, kwargs = block_request(prompts, generate_kwargs, a, b)
                mailbox.put("msg", {"op": "generate", "prompts": block, **kwargs})
        number = self.requests
        self.requests += 1
        if generate_kwargs.get("stream"):
            return Streamed(lambda: self._take(number), lambda: self._poll_groups(number))
        return Later(lambda: self._take(number))

    def _poll_groups(self, number: int) -> tuple[list[tuple[int, Rollouts]], bool]:
        """Request ``number``'s groups that finished since the last call, and whether every replica has
        answered it (then none is left), on every trainer rank (collective)."""
        payload = [None]
        if self.world.sender:
            # Read the replies' presence first: a replica posts a request's reply after its last group.
            done = self.answered > number or all(m.arrived("reply", number) for m in self.mailboxes)
            for mailbox in self.mailboxes:
                while mailbox.waiting("group"):
                    message = mailbox.get("group", "group")
                    self.streamed.setdefault(message["request"], []).append((message["group"], message["rollouts"]))
            for old in [k for k in self.streamed if k < number]:  # of a request taken without its stream
                del self.streamed[old]
            payload = [(self.streamed.pop(number, []), done)]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(payload, src=0)  # the trainer ranks' group
        return payload[0]

    def rollouts(self, prompts: list[list[int]], **generate_kwargs) -> Rollouts:
        """Engine.generate on the replicas; every rank gets the rollouts."""
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


class Streamed(Later):
    """generator.stream_groups: a Later whose finished groups arrive before its rollouts."""

    POLL_S = 0.01
    """How often the trainer looks for groups when none came."""

    def __init__(self, fetch: Callable[[], Rollouts], poll: Callable[[], tuple[list, bool]]) -> None:
        super().__init__(fetch)
        self.poll = poll

    def stream(self) -> Iterator[list[tuple[int, Rollouts]]]:
        """The request's groups as they finish, (its index in the request, its samples), until the replicas
        have answered it (every trainer rank, together)."""
        while True:
            groups, done = self.poll()
            if groups:
                yield groups
            if done:
                return
            if not groups:
                time.sleep(self.POLL_S)


def _who(replica: int, replicas: int) -> str:
    return who(replica, replicas, alone="generator rank")
