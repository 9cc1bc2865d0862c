"""Continuous batching for the rollout server: many concurrent requests, one engine, one thread.

The Generator's ``generate`` owns the engine for one batch at a time (the
training layouts call it from one thread). A server gets requests at any
time from many connections, so here one thread owns the engine: callers
``submit`` samples (thread-safe, a Future each) and the thread admits them
between engine steps, so a new request joins the running batch at the next
step (vLLM's continuous batching) instead of waiting for it to finish.

The gate, as in the Generator:
- no weights yet (dummy start, or a failed sync withdrew them): a sample
  waits up to ``generator.wait_for_weights_s`` for a version, then fails
  with WeightsNotSyncedError (the server answers 503);
- a sync: the weight-sync receiver calls ``begin_sync`` before it writes a
  byte. That stops admissions, waits until every admitted sample finished
  (their version's weights are still intact), then lets the sync write.
  ``finish_sync`` publishes the new version and admits what queued
  meanwhile. So a sample runs start to end on one version, the one it
  reports: no response mixes two versions, and none is dropped.
The loop passes itself to the NcclReceiver in the Generator's place (the
same ``model``, ``weight_version``, ``begin_sync``/``finish_sync``/``abort_sync``).
"""

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from torchtitan_rl.generator.generator import Generator, WeightsNotSyncedError


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


@dataclass
class _Job:
    prompt_ids: list[int]
    params: object
    """vLLM SamplingParams."""
    future: Future
    deadline: float
    """time.monotonic() after which a job still waiting for the first weights fails."""
    version: int | None = None


class EngineLoop:
    def __init__(self, generator: Generator) -> None:
        self.generator = generator
        self.model = generator.model
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._running: dict[str, _Job] = {}
        self._paused = False
        self._closed = False
        self._ids = 0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def weight_version(self) -> int | None:
        return self.generator.weight_version

    def submit(self, prompts_ids: list[list[int]], params: list) -> list[Future]:
        """Queue one sample per (prompt, params) pair; admitted together, so they share one weight version."""
        wait_s = self.generator.config.wait_for_weights_s
        deadline = time.monotonic() + wait_s
        jobs = [_Job(list(p), sp, Future(), deadline) for p, sp in zip(prompts_ids, params, strict=True)]
        with self._cond:
            if self._closed:
                raise WeightsNotSyncedError("the server is shutting down")
            self._queue.extend(jobs)
            self._cond.notify_all()
        return [j.future for j in jobs]

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"queued": len(self._queue), "running": len(self._running)}

    # -- the weight-sync receiver's hooks (it calls them in place of the Generator's) --
    def begin_sync(self) -> None:
        with self._cond:
            self._paused = True
            self._cond.wait_for(lambda: not self._running)  # every admitted sample ends on its weights
        self.generator.begin_sync()

    def finish_sync(self, version: int | None) -> None:
        self.generator.finish_sync(version)  # resets the prefix cache: the engine thread is idle now
        self._resume()

    def abort_sync(self) -> None:
        self.generator.abort_sync()
        self._resume()

    def _resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)
        with self._cond:
            jobs = list(self._queue) + list(self._running.values())
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(RuntimeError("generator: the server shut down"))
        self.generator.close()

    # -- the engine thread ----------------------------------------------------
    def _admit(self) -> list[tuple[str, _Job]]:
        """Under the lock: queued jobs to add now, and jobs that waited too long for weights failed."""
        version = self.generator.weight_version
        if self._paused:
            return []
        if version is None:
            now = time.monotonic()
            while self._queue and self._queue[0].deadline <= now:
                job = self._queue.popleft()
                job.future.set_exception(WeightsNotSyncedError(
                    "no weights synced yet: the trainer has not sent its first sync (or the last sync failed "
                    "and withdrew the weights)"
                ))
            return []
        admitted = []
        while self._queue:
            job = self._queue.popleft()
            job.version = version
            rid = f"s{self._ids}"
            self._ids += 1
            self._running[rid] = job
            admitted.append((rid, job))
        return admitted

    def _ready(self) -> bool:
        return self._closed or bool(self._running) or (
            bool(self._queue) and not self._paused and self.generator.weight_version is not None
        )

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # never die silently: fail what waits, refuse what comes
            with self._cond:
                self._closed = True
                jobs = list(self._queue) + list(self._running.values())
                self._queue.clear()
                self._running.clear()
                self._cond.notify_all()
            for job in jobs:
                if not job.future.done():
                    job.future.set_exception(RuntimeError(f"generator: the engine loop stopped: {e!r}"))
            raise

    def _loop(self) -> None:
        engine = self.generator.engine
        while True:
            with self._cond:
                # Wake for work, or for the first queued job's deadline while there are no weights.
                while not self._ready():
                    timeout = None
                    if self._queue and not self._paused:
                        timeout = max(0.0, self._queue[0].deadline - time.monotonic())
                    if not self._cond.wait(timeout) and timeout is not None:
                        break
                if self._closed:
                    return
                admitted = self._admit()
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
            with self._cond:
                jobs = [(self._running.pop(rid), c) for rid, c in done]
                self._cond.notify_all()  # a sync may be waiting for the batch to drain
            for job, c in jobs:
                job.future.set_result(_sample(c, job))

    def _fail_running(self, error: Exception) -> None:
        engine = self.generator.engine
        with self._cond:
            jobs, self._running = dict(self._running), {}
            self._cond.notify_all()
        if jobs:
            engine.abort_request(list(jobs))
        for job in jobs.values():
            job.future.set_exception(RuntimeError(f"generator: the engine failed: {type(error).__name__}: {error}"))


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
    )
