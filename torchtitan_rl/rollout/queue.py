"""The rollouts a run trains on, in step order: requested ahead (grpo.max_staleness), refilled, saved.

Prompts and seeds are drawn in step order, so step k trains on the same
prompts whatever grpo.max_staleness; docs/design.md ("Staleness") explains
why requests made right after a sync are served with that sync's weights.
With grpo.partial a request holds the groups partial.py's buffer carries plus
new prompts, and the step trains on the oldest groups it finished.
"""

import random
import time
from collections import deque
from collections.abc import Callable

from torchtitan_rl.config import JobConfig
from torchtitan_rl.config.validation import harness_lengths
from torchtitan_rl.rollout.base import Done, Pending, RolloutGenerator, Rollouts
from torchtitan_rl.rollout.partial import Pool, UnfinishedBuffer
from torchtitan_rl.grpo.tasks.base import Prompt, Task

REFILL_SEED_OFFSET = 1 << 40
"""Dynamic sampling's round r draws with seed base + r * this: clear of every step's and evaluation's seeds."""


class RolloutQueue:
    """Requests in flight, oldest first, each ``(step, prompts, Pending)`` (with grpo.partial ``(step, Pool,
    Pending)``); a checkpoint keeps them."""

    def __init__(self, cfg: JobConfig, *, generator: RolloutGenerator, task: Task) -> None:
        self.cfg, self.generator, self.task = cfg, generator, task
        self.prompt_rng = random.Random(cfg.job.seed)
        self.inflight: deque[tuple[int, list[Prompt] | Pool, Pending]] = deque()
        self.requested = 0
        """The next step to request rollouts for."""
        lengths = harness_lengths(cfg)
        self.lengths = {} if lengths is None else {"lengths": lengths}
        """The timing harness's drawn lengths (grpo.harness_lengths), passed with every request where set."""
        self.partial = None
        """grpo.partial: the groups carried between requests."""
        self.stream = {"stream": True} if cfg.generator.stream_groups else {}
        """generator.stream_groups: the step's requests post each group as it finishes."""
        self.stream_stats: dict[str, float] = {}
        for field, on in (("grpo.partial.enable", cfg.grpo.partial.enable),
                          ("generator.stream_groups", cfg.generator.stream_groups)):
            if on and type(task).submit is not Task.submit:
                raise ValueError(f"{field}: task {type(task).__name__} plays multi-turn episodes (its own submit); "
                                 "this works on single-turn samples only")
        if cfg.grpo.partial.enable:
            self.partial = UnfinishedBuffer(cfg, engines=generator.engines)

    @property
    def partial_stats(self) -> dict[str, float]:
        """The last step's carried and dropped samples (grpo.partial) and groups recomputed while the rest
        were generated (generator.stream_groups); {} with both off."""
        return {**(self.partial.stats if self.partial else {}), **self.stream_stats}

    def next(self, step: int, *, prefetch: Callable[[list[tuple[int, Rollouts]]], None] | None = None,
             ) -> tuple[list[Prompt], Rollouts]:
        """Request rollouts up to max_staleness steps ahead (served with the weights just synced, while
        the trainer learns), then wait for this step's, requested that many steps ago. ``prefetch``: given
        each chunk of its groups that finished while the rest are still generated (generator.stream_groups)."""
        cfg = self.cfg
        while self.requested <= min(step + cfg.grpo.max_staleness, cfg.trainer.steps - 1):
            if self.partial is None:
                ask = self.task.sample_prompts(cfg.grpo.prompts_per_step, generator=self.prompt_rng)
                self.inflight.append((self.requested, ask, self._submit(ask, seed=self.requested, **self.stream)))
            else:
                self.inflight.append((self.requested, *self._submit_partial(self.requested)))
            self.requested += 1
        _, prompts, pending = self.inflight.popleft()
        if getattr(pending, "stream", None) is not None and prefetch is not None:
            groups, busy = 0, 0.0
            for chunk in pending.stream():
                started = time.perf_counter()
                prefetch(chunk)
                groups, busy = groups + len(chunk), busy + time.perf_counter() - started
            self.stream_stats = {"stream_groups_early": float(groups), "stream_recompute_s": busy}
        rollouts = pending.result()
        if self.partial is not None:
            prompts, rollouts = self.partial.take(prompts, rollouts)
        # more stale only in the no-sync negative control
        assert step - rollouts.weight_version <= cfg.grpo.max_staleness or not cfg.weight_sync.enable, (
            step, rollouts.weight_version, cfg.grpo.max_staleness)
        return prompts, rollouts

    def refill(self, step: int, round_: int, n: int) -> tuple[list[Prompt], Rollouts]:
        """Dynamic sampling's extra draw of ``n`` prompts (the groups still missing): its own RNG per (seed,
        step, round), outside the main prompt stream (a dataset's epoch position included), so the step's
        prompts do not depend on max_staleness; sampled now, with the current weights."""
        cfg = self.cfg
        more = self.task.sample_extra_prompts(n, generator=random.Random(f"refill:{cfg.job.seed}:{step}:{round_}"))
        return more, self._submit(more, seed=REFILL_SEED_OFFSET * round_ + step).result()

    def _submit(self, prompts: list[Prompt], *, seed: int, stream: bool = False) -> Pending:
        cfg = self.cfg
        if stream:
            return self._ask([p.token_ids for p in prompts], n=cfg.grpo.group_size,
                             seed=cfg.job.seed * 1_000_003 + seed, stream=True)
        return self.task.submit(  # a multi-turn task plays whole episodes
            self.generator, prompts, n=cfg.grpo.group_size, seed=cfg.job.seed * 1_000_003 + seed,
            sampling=cfg.generator.sampling, max_total_tokens=cfg.generator.max_model_len, **self.lengths,
        )

    def _ask(self, prompts: list[list[int]], **generate_kwargs) -> Pending:
        """Engine.generate's arguments as Task.submit passes them for a single-turn task, and more (partial
        rollouts, streaming: refused for multi-turn tasks above)."""
        return self.generator.submit(prompts, stop_token_ids=[self.task.eos_id], sampling=self.cfg.generator.sampling,
                                     **generate_kwargs, **self.lengths)

    def _submit_partial(self, j: int) -> tuple[Pool, Pending]:
        """Request ``j`` of grpo.partial: the carried groups and new prompts."""
        cfg = self.cfg
        wanted = self.partial.new_groups_wanted()
        new = self.task.sample_prompts(wanted, generator=self.prompt_rng) if wanted else []
        # One seed for the run: a sample's seed is its group's number and its index (engine.sample_seed).
        pool, ask = self.partial.request(j, new, seed=cfg.job.seed * 1_000_003)
        return pool, self._ask(ask.pop("prompts"), **ask, **self.stream)

    def state_dict(self) -> dict:
        """The prompt stream and the rollouts requested for later steps (waited for: the weights they
        were sampled with are gone, so they could not be drawn again); with grpo.partial the carried groups."""
        state = {
            "prompt_rng": self.prompt_rng.getstate(),
            "task": self.task.state_dict(),  # a dataset's place in its epoch
            "queued": [(j, prompts, pending.result()) for j, prompts, pending in self.inflight],
        }
        if self.partial is not None:
            state["partial"] = self.partial.state_dict()
        return state

    def load_state_dict(self, state: dict, *, step: int) -> None:
        """Resume at ``step`` from what ``state_dict`` saved."""
        if (self.partial is not None) != ("partial" in state):
            raise ValueError(f"grpo.partial.enable: the checkpoint was written with it {'partial' in state}, this "
                             f"run has {self.partial is not None}; resume with the value the run was saved with")
        self.prompt_rng.setstate(_tuples(state["prompt_rng"]))
        self.task.load_state_dict(state.get("task", {}))
        queued = state.get("queued", [])
        check_queued(self.cfg, queued)
        self.inflight = deque((j, prompts, Done(r)) for j, prompts, r in queued)
        self.requested = step + len(self.inflight)
        if self.partial is not None:
            self.partial.load_state_dict(state["partial"])


def check_queued(cfg: JobConfig, queued: list) -> None:
    """Rollouts a checkpoint queued must fit this run's staleness bound (they cannot be drawn again)."""
    S = cfg.grpo.max_staleness
    too_old = [(j, r.weight_version) for j, _, r in queued if j - r.weight_version > S]
    if too_old and cfg.weight_sync.enable:
        raise ValueError(
            f"grpo.max_staleness: the checkpoint holds rollouts for steps {[j for j, _ in too_old]} sampled with "
            f"weight versions {[v for _, v in too_old]}, older than max_staleness {S} allows; resume with the "
            "grpo.max_staleness the run was saved with"
        )


def _tuples(state):
    """random.Random state after a JSON-like round trip: lists back to tuples."""
    return tuple(_tuples(s) for s in state) if isinstance(state, (list, tuple)) else state
