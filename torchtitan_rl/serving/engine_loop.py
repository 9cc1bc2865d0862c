"""Continuous batching for the rollout server: many concurrent requests, one engine, one thread.

The Engine's ``generate`` owns the engine for one batch at a time (the
training layouts call it from one thread). A server gets requests at any
time from many connections, so here one thread owns the engine: callers
``submit`` samples (thread-safe, a Future each) and the thread admits them
between engine steps, so a new request joins the running batch at the next
step (vLLM's continuous batching) instead of waiting for it to finish.

The gate, as in the Engine:
- no weights yet (dummy start, or a failed sync withdrew them): a sample
  waits up to ``generator.wait_for_weights_s`` for a version, then fails
  with WeightsNotSyncedError (the server answers 503);
- a sync: the weight-sync receiver calls ``begin_sync`` before it writes a
  byte. That stops admissions, waits until every admitted sample finished
  (their version's weights are still intact), then lets the sync write.
  ``finish_sync`` publishes the new version, ``resume`` admits what queued
  meanwhile. So a sample runs start to end on one version, the one it
  reports: no response mixes two versions, and none is dropped (unless
  a sync stalls past ``sync_wait_s``: then 503).
The loop passes itself to the NcclReceiver in the Engine's place (the
same ``model``, ``weight_version``, ``begin_sync``/``finish_sync``/``abort_sync``);
the sync's owner then calls ``resume``, naming the session whose weights
it published, so every sample reports the session with the version.

Cancellation: ``cancel`` (a client that went away) drops its queued samples
and aborts its running ones in the engine, on the engine thread (the engine
is not thread-safe). A Future is marked running when its sample is admitted,
so a caller's ``Future.cancel`` either wins before that (the sample is never
added) or fails after it; the engine thread never resolves a cancelled Future.
A queued sample also has a deadline while a sync pauses admissions
(``sync_wait_s``): a stalled sync never holds a request forever.
"""

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from torchtitan_rl import compat
from torchtitan_rl.engine.engine import Engine, WeightsNotSyncedError


@dataclass
class Sample:
    """One finished sample: what a response needs."""

    token_ids: list[int]
    logprobs: list[float]
    """Logprob of each sampled token (after temperature)."""
    top_logprobs: list[dict[int, float]] | None
    """Per position, the requested number of most likely tokens and their logprobs; None if not asked."""
    text: str
    finish_reason: str
    """"stop" (eos, a stop token or string) or "length"."""
    weight_version: int
    weight_session: str | None
    """The trainer session whose sync published those weights (a new trainer restarts versions)."""


@dataclass
class _Job:
    prompt_ids: list[int]
    params: object
    """vLLM SamplingParams."""
    future: Future
    deadline: float
    """time.monotonic() after which a job still waiting for the first weights fails."""
    held_deadline: float
    """time.monotonic() after which a job queued behind a sync that does not end fails."""
    version: int | None = None
    session: str | None = None


class EngineLoop:
    def __init__(self, generator: Engine, *, sync_wait_s: float) -> None:
        self.generator = generator
        self.model = generator.model
        self.sync_wait_s = sync_wait_s
        self.weight_session: str | None = None
        """The trainer session whose sync published the weights served now."""
        self.error: str | None = None
        """Why the engine thread stopped, if it did."""
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._running: dict[str, _Job] = {}
        self._aborts: list[str] = []
        """Running samples whose client went away: aborted in the engine by the engine thread."""
        self._counts = {"aborted": 0, "dropped": 0}
        self._paused = False
        self._closed = False
        self._ids = 0
        # OpenMP's thread count is per thread: the engine thread computes with the one the engine was built under
        # (vLLM's CPU attention checks that its metadata and its kernels agree on it).
        self._num_threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def weight_version(self) -> int | None:
        return self.generator.weight_version

    def submit(self, prompts_ids: list[list[int]], params: list) -> list[Future]:
        """Queue one sample per (prompt, params) pair; admitted together, so they share one weight version."""
        now = time.monotonic()
        deadline = now + self.generator.config.wait_for_weights_s
        held = max(deadline, now + self.sync_wait_s)
        jobs = [_Job(list(p), sp, Future(), deadline, held) for p, sp in zip(prompts_ids, params, strict=True)]
        with self._cond:
            if self._closed:
                raise WeightsNotSyncedError("the server is shutting down")
            self._queue.extend(jobs)
            self._cond.notify_all()
        return [j.future for j in jobs]

    def cancel(self, futures: list[Future]) -> None:
        """The caller gave up on these samples: drop the queued ones, abort the running ones in the engine."""
        ids = {id(f) for f in futures}
        with self._cond:
            kept = deque(j for j in self._queue if id(j.future) not in ids)
            self._counts["dropped"] += len(self._queue) - len(kept)
            self._queue = kept
            self._aborts += [rid for rid, j in self._running.items() if id(j.future) in ids]
            self._cond.notify_all()

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"queued": len(self._queue), "running": len(self._running), **self._counts}

    # -- the weight-sync receiver's hooks (it calls them in place of the Engine's) --
    def begin_sync(self) -> None:
        with self._cond:
            self._paused = True
            self._cond.wait_for(lambda: not self._running)  # every admitted sample ends on its weights
        self.generator.begin_sync()

    def finish_sync(self, version: int | None) -> None:
        self.generator.finish_sync(version)  # resets the prefix cache: the engine thread is idle now

    def abort_sync(self) -> None:
        self.generator.abort_sync()

    def resume(self, *, published_by: str | None) -> None:
        """Admit again after a sync; ``published_by``: the session whose sync published new weights, if one did."""
        with self._cond:
            if published_by is not None:
                self.weight_session = published_by
            self._paused = False
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)
        with self._cond:
            queued, running = list(self._queue), list(self._running.values())
        _fail(queued, running, RuntimeError("generator: the server shut down"))
        self.generator.close()

    # -- the engine thread ----------------------------------------------------
    def _admit(self) -> list[tuple[str, _Job]]:
        """Under the lock: queued jobs to add now, and jobs that waited too long for weights failed."""
        version = self.generator.weight_version
        if self._paused or version is None:
            now, expired = time.monotonic(), []
            while self._queue and self._deadline(self._queue[0]) <= now:  # FIFO: deadlines in queue order
                expired.append(self._queue.popleft())
            if expired:
                _fail(expired, [], WeightsNotSyncedError(
                    f"a weight sync held this request for {self.sync_wait_s:g} s (serve.sync_timeout_s)"
                    if self._paused else
                    "no weights synced yet: the trainer has not sent its first sync (or the last sync failed "
                    "and withdrew the weights)"
                ))
            return []
        admitted = []
        while self._queue:
            job = self._queue.popleft()
            if not job.future.set_running_or_notify_cancel():
                continue  # its caller cancelled it before it ran
            job.version, job.session = version, self.weight_session
            rid = f"s{self._ids}"
            self._ids += 1
            self._running[rid] = job
            admitted.append((rid, job))
        return admitted

    def _deadline(self, job: _Job) -> float:
        return job.held_deadline if self._paused else job.deadline

    def _ready(self) -> bool:
        return self._closed or bool(self._running) or bool(self._aborts) or (
            bool(self._queue) and not self._paused and self.generator.weight_version is not None
        )

    def _run(self) -> None:
        try:
            compat.set_num_threads(self._num_threads)
            self._loop()
        except BaseException as e:  # never die silently: fail what waits, refuse what comes, /health says so
            with self._cond:
                self._closed, self.error = True, f"{type(e).__name__}: {e}"
                queued, running = list(self._queue), list(self._running.values())
                self._queue.clear()
                self._running.clear()
                self._cond.notify_all()
            _fail(queued, running, RuntimeError(f"generator: the engine loop stopped: {e!r}"))
            raise

    def _loop(self) -> None:
        engine = self.generator.engine
        while True:
            with self._cond:
                # Wake for work, or for the first queued job's deadline while it cannot be admitted.
                while not self._ready():
                    timeout = None
                    if self._queue:
                        timeout = max(0.0, self._deadline(self._queue[0]) - time.monotonic())
                    if not self._cond.wait(timeout) and timeout is not None:
                        break
                if self._closed:
                    return
                admitted = self._admit()
                aborts = [rid for rid in self._aborts if rid in self._running]  # not those finished meanwhile
                self._aborts = []
            if aborts:
                # Freed in the engine before a waiting sync hears of it: it must find no KV block held.
                engine.abort_request(aborts)
                _drain(engine)
                with self._cond:
                    aborted = [self._running.pop(rid) for rid in aborts]
                    self._counts["aborted"] += len(aborted)
                    self._cond.notify_all()  # a sync may be waiting for the batch to drain
                _fail([], aborted, RuntimeError("generator: the client went away"))
            for rid, job in admitted:
                try:
                    engine.add_request(rid, {"prompt_token_ids": job.prompt_ids}, job.params)
                except Exception as e:  # this request's fault (vLLM's own checks): fail it alone
                    with self._cond:
                        self._running.pop(rid)
                        self._cond.notify_all()
                    job.future.set_exception(ValueError(f"{type(e).__name__}: {e}"))
            try:
                outputs = engine.step() if engine.has_unfinished_requests() else []
            except Exception as e:  # fail what ran, keep serving: the next request may well succeed
                self._fail_running(e)
                continue
            done = []
            for out in outputs:
                if out.finished:
                    done.append((out.request_id, out.outputs[0]))
            _drain(engine)
            with self._cond:
                jobs = [(self._running.pop(rid), c) for rid, c in done]
                self._cond.notify_all()  # a sync may be waiting for the batch to drain
            for job, c in jobs:
                job.future.set_result(_sample(c, job))

    def _fail_running(self, error: Exception) -> None:
        engine = self.generator.engine
        with self._cond:
            rids = list(self._running)
        if rids:
            engine.abort_request(rids)  # before a waiting sync hears the batch drained
        with self._cond:
            jobs = {rid: self._running.pop(rid) for rid in rids}
            self._cond.notify_all()
        _fail([], list(jobs.values()), RuntimeError(f"generator: the engine failed: {type(error).__name__}: {error}"))


def _drain(engine) -> None:
    """Once no request is left, collect the iteration still in flight (async scheduling), before a waiting
    sync hears that the batch drained: no iteration runs while it writes."""
    while not engine.has_unfinished_requests() and compat.batches_in_flight(engine):
        engine.step()


def _fail(queued: list[_Job], running: list[_Job], error: Exception) -> None:
    """Fail queued jobs (unless their caller cancelled them) and running ones (which can no longer be cancelled)."""
    for job in queued:
        if job.future.set_running_or_notify_cancel():
            job.future.set_exception(error)
    for job in running:
        job.future.set_exception(error)


def _sample(c, job: _Job) -> Sample:
    ids = list(c.token_ids)
    top = None
    if job.params.logprobs:
        top = [dict(sorted(((t, lp.logprob) for t, lp in pos.items()), key=lambda kv: -kv[1])
                    [: job.params.logprobs]) for pos in c.logprobs]
    return Sample(
        token_ids=ids,
        logprobs=[pos[t].logprob for pos, t in zip(c.logprobs, ids)],
        top_logprobs=top,
        text=c.text or "",
        finish_reason=c.finish_reason or "length",
        weight_version=job.version,
        weight_session=job.session,
    )
