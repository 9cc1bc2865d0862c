"""Where a generate's time goes: its engine iterations, recorded one by one and summed into an EngineTrace.

Engine.generate records, after every engine step, how many of its sequences vLLM's scheduler runs and keeps
waiting (compat.scheduler_load). The interval up to the next step is spent on that batch (async scheduling:
the step that returns has just queued it), so each interval counts the load read at its start. docs/design.md
("The long tail") says what each number means and why the batch fill stands for "GPU busy".
"""

import dataclasses
import time

TAIL_FRACTION = 0.25
"""A generate is in its tail while fewer than this share of its sequences are unfinished."""


@dataclasses.dataclass
class EngineTrace:
    """One generate's iterations, summed; every field but slowest_s adds up, so several engines' blocks merge by
    summing."""

    sequences: int = 0
    """Samples the generate asked for (its wave)."""
    wall_s: float = 0.0
    """Seconds from the first engine step to the last (the step loop)."""
    engines: int = 1
    """Engines whose blocks of one request this trace sums (``merge``)."""
    slowest_s: float = 0.0
    """The longest of those engines' wall_s (``merge`` keeps the maximum): the one the request waits for."""
    iterations: int = 0
    """Engine steps (each schedules and runs one batch)."""
    tail_s: float = 0.0
    """Seconds during which fewer than TAIL_FRACTION of the wave's sequences were unfinished (running or waiting)."""
    tail_iterations: int = 0
    """The engine steps of those seconds."""
    running_s: float = 0.0
    """Sequence-seconds: the integral of the number of running sequences over the loop."""
    slot_s: float = 0.0
    """Slot-seconds: min(generator.max_num_seqs, sequences) x wall_s, the most running_s could be."""
    preemptions: int = 0
    """Times vLLM's scheduler preempted one of the sequences (KV cache full: its blocks freed, recomputed later)."""
    after_need_s: float = 0.0
    """Partial rollouts: seconds the loop ran after grpo.prompts_per_step of its groups had finished, for the groups
    due to finish (grpo.partial.max_token_age) or the token budget; 0 without partial rollouts."""
    after_need_iterations: int = 0
    """The engine steps of those seconds."""
    kv_read_bytes: int = 0
    """KV-cache bytes the iterations' attention read: each iteration's running contexts (tokens) times the bytes a
    token takes in the cache. A decode iteration reads every running sequence's whole context, so over a generate
    this is the sum over samples of ~(prompt x length + length^2 / 2) tokens: the bytes that bound a long-context
    generate, whatever order its samples run in (docs/design.md, "The long tail"). Exact to one step a sample: the
    load is read between steps, and a sync's drain (a step that schedules nothing) still counts the contexts."""
    tail_kv_read_bytes: int = 0
    """Those bytes read in the tail's steps: over tail_s, the rate the attention reaches with a few sequences running
    (a step's fixed costs, or a kernel that a small batch does not fill), against the whole loop's."""

    @property
    def tail_share(self) -> float:
        """Share of the loop spent in the tail."""
        return self.tail_s / self.wall_s if self.wall_s else 0.0

    @property
    def batch_fill(self) -> float:
        """Time-weighted share of the engine's batch slots that held a running sequence (1: the whole wave, or
        max_num_seqs of it, decodes together all along)."""
        return self.running_s / self.slot_s if self.slot_s else 0.0

    @property
    def engine_balance(self) -> float:
        """The engines' mean step loop over the slowest one's: 1 when they finish together; 0.5 on two engines
        when one worked half as long as the other and then waited for it."""
        return self.wall_s / self.engines / self.slowest_s if self.slowest_s else 1.0

    @property
    def kv_read_rate(self) -> float:
        """Bytes a second the attention read from the KV cache, per engine (the merge of several engines' blocks
        sums their seconds too): to hold against the GPU's memory bandwidth."""
        return self.kv_read_bytes / self.wall_s if self.wall_s else 0.0

    @property
    def tail_kv_read_rate(self) -> float:
        """Bytes a second read from the KV cache during the tail."""
        return self.tail_kv_read_bytes / self.tail_s if self.tail_s else 0.0

    def metrics(self) -> dict[str, float]:
        """The step's metrics.jsonl keys (run/metrics.py)."""
        return {"gen_tail_share": self.tail_share, "gen_tail_s": self.tail_s, "gen_batch_fill": self.batch_fill,
                "gen_preemptions": float(self.preemptions), "gen_iterations": float(self.iterations),
                "gen_tail_iterations": float(self.tail_iterations),
                "gen_after_need_s": self.after_need_s, "gen_engine_balance": self.engine_balance,
                "gen_kv_read_gb": self.kv_read_bytes / 1e9, "gen_kv_read_tb_per_s": self.kv_read_rate / 1e12,
                "gen_tail_kv_read_tb_per_s": self.tail_kv_read_rate / 1e12}

    @staticmethod
    def merge(parts: list["EngineTrace"]) -> "EngineTrace":
        """The traces of several engines' blocks of one batch, summed (shares become time-weighted means), but
        for slowest_s."""
        return EngineTrace(**{f.name: (max if f.name == "slowest_s" else sum)(getattr(p, f.name) for p in parts)
                              for f in dataclasses.fields(EngineTrace)})


class TraceRecorder:
    """Builds one generate's EngineTrace: ``iteration`` after every engine step, ``finish`` at the end."""

    def __init__(self, *, sequences: int, max_num_seqs: int, kv_token_bytes: int) -> None:
        self.trace = EngineTrace(sequences=sequences)
        self.slots = min(max_num_seqs, sequences)
        self.kv_token_bytes = kv_token_bytes
        self.last = time.perf_counter()
        self.running, self.unfinished, self.context = 0, sequences, 0  # before the first step: nothing scheduled
        self.preempted: dict[str, int] = {}
        """Request id -> the most preemptions seen for it."""
        self.needed = False
        """The groups a partial request needs have finished (``need_met``)."""

    def need_met(self) -> None:
        """A partial request's needed groups have finished: the loop's time from here on is after_need_s."""
        self.needed = True

    def iteration(self, *, running: int, waiting: int, preempted: dict[str, int], context: int) -> None:
        """One engine step just returned; ``running``/``waiting``: the scheduler's load now; ``preempted``:
        preemption counts of requests seen preempted; ``context``: the running requests' tokens in the KV cache
        (compat.scheduler_load)."""
        now = time.perf_counter()
        dt, t = now - self.last, self.trace
        t.iterations += 1
        t.wall_s += dt
        t.slot_s += dt * self.slots
        t.running_s += dt * self.running
        read = self.context * self.kv_token_bytes
        t.kv_read_bytes += read
        if self.unfinished < TAIL_FRACTION * t.sequences:
            t.tail_s += dt
            t.tail_iterations += 1
            t.tail_kv_read_bytes += read
        if self.needed:
            t.after_need_s += dt
            t.after_need_iterations += 1
        self.last, self.running, self.unfinished, self.context = now, running, running + waiting, context
        self.preempted.update(preempted)

    def finish(self) -> EngineTrace:
        self.trace.preemptions = sum(self.preempted.values())
        self.trace.slowest_s = self.trace.wall_s
        return self.trace
