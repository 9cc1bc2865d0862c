"""The trainer's view of a rollout server (weight_sync.transport = "server").

The loop sees the interface of rollout/base.py: ``sync`` (the weights over
the own-rank layout's NcclSender, to the server's session), ``submit`` /
``result`` (one POST /v1/completions with token-id prompts, sent from a
background thread so that it overlaps training; the token ids and logprobs
come back) and ``close``. Every trainer rank calls each method
together: trainer rank 0 talks HTTP and broadcasts the rollouts; every rank
joins the store (the sender's plan and headers) and the gathers of a sync.

What goes wrong says so in one line naming the server (a ValueError, as any
bad peer: the command exits 2): a server that does not answer, a sync that
failed, a certificate it does not trust (https: serve.ssl_cafile), and a
takeover (another trainer connected: the server leaves this session a signed
notice, and answers with the other session's weights). A trainer started
before its server says every few seconds that it waits; one that finds
another trainer connected waits once for that one's session lease to run out
(a crashed trainer's does), and its own lease is renewed by a heartbeat
thread, so that a long train step never loses it. A sync, the connection's
set-up and the check after a failure each have ONE deadline,
weight_sync.peer_timeout_s, across all their parts (HTTP requests, store
waits, the gloo broadcasts): a frozen server ends the trainer after that
long, not after that long per part. The HTTP(S) requests and the store they
carry: rollout/server_http.py.
"""

import math
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta

import torch
import torch.distributed as dist

from torchtitan_rl.config import JobConfig, SamplingConfig
from torchtitan_rl.rollout.base import Later, Rollouts
from torchtitan_rl.rollout.server_http import HttpStore, ServerClient, ServerError, ServerGone
from torchtitan_rl.serving.protocol import ENDED, base_url, client_tls, pair_store, session_store
from torchtitan_rl.distributed.world import World, pair_group
from torchtitan_rl.weight_sync.nccl_sender import NcclSender
from torchtitan_rl.weight_sync.store import ForgedMessage

_PROBE_S = 2.0
"""How long the checks after a failed sync (does the server answer? was this trainer replaced?) may take."""


class ServerGenerator:
    """The generator as the loop sees it, behind HTTP; every trainer rank calls each method together."""

    def __init__(self, cfg: JobConfig, *, reference: dict[str, torch.Tensor], device: torch.device) -> None:
        self.timeout_s = timeout_s = cfg.weight_sync.peer_timeout_s
        self.engines = 1  # the server splits nothing: its engine answers the request whole
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.client = ServerClient(base_url(cfg.serve), token=cfg.serve.token, api_key=cfg.serve.api_key,
                                   timeout_s=timeout_s, tls=client_tls(cfg.serve))
        self.heartbeat: Heartbeat | None = None
        """Trainer rank 0: renews the session's lease while this trainer lives."""
        self._answers = True
        """False once a failed sync found the server not answering: close() then does not wait for it."""
        reply = [None]
        if self.rank == 0:
            self.client.wait_ready(timeout_s)
            reply = [self._connect()]
            self.heartbeat = Heartbeat(self.client, reply[0]["session"], every_s=reply[0]["lease_s"] / 5)
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(reply, src=0)
        self.session = session = reply[0]["session"]
        self.synced = False
        """Whether this session published weights yet: from then on every answer must carry them."""
        prefix = reply[0]["store_prefix"]
        self._http_store = HttpStore(self.client, timeout_s=timeout_s)  # referenced: the Python side must outlive
        self.store = session_store(self._http_store, session, secret=cfg.serve.token, prefix=prefix)
        pair = None
        try:
            with self.client.deadline(timeout_s, "the sync session's set-up"):
                if self.rank == 0:
                    pair = _Bounded(pair_group(pair_store(self._http_store, session, secret=cfg.serve.token,
                                                          prefix=prefix), rank=0, device=device, timeout_s=timeout_s),
                                    self.client)
                world = World("trainer", self.rank, dist.get_world_size(), device, self.store, pair)
                self.sender = NcclSender(cfg.weight_sync, reference=reference, world=world, timeout_s=timeout_s)
        except BaseException:
            if self.heartbeat is not None:
                self.heartbeat.stop()
            raise
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rollouts")
        self.inflight: list[Future] = []
        """Trainer rank 0: the HTTP requests not yet answered (grpo.max_staleness of them at most)."""

    def _connect(self) -> dict:
        """POST /control/connect. Another trainer connected (409, serve.takeover off): wait once until its lease
        would run out (a crashed or frozen trainer's does) and try again; a live one renews it: one line."""
        url, waited = self.client.base_url, False
        while True:
            try:
                return self.client.request("POST", "/control/connect", {"takeover": self.cfg.serve.takeover})
            except ServerError as e:
                if e.status != 409:
                    raise
                if waited or e.retry_after is None:
                    raise ServerGone(f"rollout server {url}: {e.message}; or stop that trainer first") from None
                wait = min(float(e.retry_after) + 0.5, self.timeout_s)
                print(f"torchtitan_rl: another trainer holds the rollout server at {url}; waiting {wait:.0f} s for "
                      "its session lease to run out (serve.session_lease_s: a crashed trainer's does; "
                      "--serve.takeover true replaces it now)", flush=True)
                time.sleep(wait)
                waited = True

    def sync(self, state: dict[str, torch.Tensor], *, version: int) -> float:
        """Send ``state`` to the server, which serves ``version`` to the requests submitted after this;
        seconds the transfer took, once the requests submitted before have been answered (the server would
        otherwise admit a late one after the sync). All of it within weight_sync.peer_timeout_s."""
        started, failure = time.monotonic(), None
        with self.client.deadline(self.timeout_s, f"the sync of version {version}"):
            for reply in self.inflight:
                try:
                    reply.exception(timeout=max(0.0, self.client.left()))  # waits; its result() raises an error
                except FutureTimeout:
                    raise ServerGone(f"rollout server {self.client.base_url}: no answer to the rollouts requested "
                                     f"before the sync of version {version} within weight_sync.peer_timeout_s "
                                     f"({self.timeout_s:g} s)") from None
            self.inflight = []
            self._check_session()
            try:
                seconds = self.sender.sync(state, version=version).seconds
            except Exception as e:  # gloo, the store or a verdict: say which server, and whether it still answers
                if isinstance(e, ValueError) and not isinstance(e, ServerGone):
                    raise  # a state dict the sync refused: it names the tensors
                failure = e
        if failure is not None:
            url = self.client.base_url
            # gloo's own lines start with its source file: "[.../unbound_buffer.cc:129] Timed out waiting ..."
            first = re.sub(r"^\[[^\]]*\] ", "", str(failure).splitlines()[0] if str(failure) else "")
            first = first.removeprefix(f"rollout server {url}: ") or type(failure).__name__
            what = (f"did not finish within weight_sync.peer_timeout_s ({self.timeout_s:g} s)"
                    if time.monotonic() - started >= self.timeout_s else "failed")
            raise ServerGone(f"rollout server {url}: the sync of version {version} {what} ({first}); "
                             f"{self._probe()}") from None
        self.synced = True
        return seconds

    def _probe(self) -> str:
        """After a failed sync, within a few seconds: does the server answer, and was this trainer replaced?"""
        try:
            self.client.request("GET", "/health", timeout_s=_PROBE_S)
        except (ServerGone, ServerError):
            self._answers = False
            return "it does not answer (stopped?)"
        with self.client.deadline(_PROBE_S, "the check of this trainer's session"):
            self._check_session()
        return "it still answers; its log says why"

    def _check_session(self) -> None:
        """Raise if the server ended this session because another trainer connected."""
        try:
            notice = self.store.get(ENDED).decode() if self.store.check([ENDED]) else None
        except ForgedMessage:
            notice = None  # logged by the store; only the server's own notice counts
        except (dist.DistError, ServerGone):
            notice = None  # the store is gone with its server: the caller says so
        except ServerError as e:  # 403: the server dropped this session's keys (two newer trainers connected)
            notice = f"its session ended ({e.message})" if e.status == 403 else None
        if notice:
            raise ServerGone(f"rollout server {self.client.base_url}: this trainer was replaced: {notice}")

    def submit(self, prompts: list[list[int]], *, n: int = 1, sampling: SamplingConfig | None = None,
               stop_token_ids: list[int] | None = None, seed: int | None = None) -> Later:
        """POST the request from a background thread (trainer rank 0) and return at once."""
        reply = None
        if self.rank == 0:
            s = sampling or self.cfg.generator.sampling
            reply = self.pool.submit(self._complete, prompts, n, s, stop_token_ids, seed)
            # Only what a sync must wait for: answered ones are dropped (the no-sync control never syncs).
            self.inflight = [r for r in self.inflight if not r.done()] + [reply]
        return Later(lambda: self._take(reply))

    def rollouts(self, prompts: list[list[int]], **generate_kwargs) -> Rollouts:
        """``n`` completions per prompt, group-contiguous, with token ids, logprobs and the weight version."""
        return self.submit(prompts, **generate_kwargs).result()

    def _take(self, reply) -> Rollouts:
        """The rollouts on every trainer rank (collective); an HTTP error is raised on every rank."""
        payload = [None]
        if self.rank == 0:
            try:
                payload = [reply.result()]
            except Exception as e:  # the other ranks raise it too, rather than wait in the broadcast
                payload = [e]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(payload, src=0)
        if isinstance(payload[0], Exception):
            raise payload[0]
        return payload[0]

    def _complete(self, prompts, n, s: SamplingConfig, stop_token_ids, seed) -> Rollouts:
        started = time.perf_counter()
        reply = self.client.request("POST", "/v1/completions", {
            "model": self.cfg.serve.model_name, "prompt": [list(p) for p in prompts], "n": n,
            "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            "stop_token_ids": stop_token_ids, "seed": seed, "logprobs": 0, "return_token_ids": True,
        })
        if self.synced and reply.get("weight_session") != self.session:
            self._check_session()
            raise ServerGone(f"rollout server {self.client.base_url}: answered with the weights of trainer session "
                             f"{str(reply.get('weight_session'))[:8]}, not this trainer's ({self.session[:8]}): "
                             "another trainer replaced this one")
        choices = sorted(reply["choices"], key=lambda c: c["index"])
        assert len(choices) == n * len(prompts), (len(choices), n, len(prompts))
        return Rollouts(
            prompt_ids=[c["prompt_token_ids"] for c in choices],
            completion_ids=[c["token_ids"] for c in choices],
            logprobs=[c["logprobs"]["token_logprobs"] for c in choices],
            weight_version=reply["weight_version"],
            generate_s=time.perf_counter() - started,  # the request's wall time: the server's engine time is not sent
        )

    def close(self) -> None:
        """End the sync session; the server keeps serving the last version for other clients."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.rank == 0 and self._answers:  # a few seconds at most: a frozen server must not hold the exit
            try:
                self.client.request("POST", "/control/disconnect", {"session": self.session}, timeout_s=_PROBE_S)
            except (ServerError, ServerGone):
                pass  # the server is gone already: nothing to end


class Heartbeat:
    """Trainer rank 0: renews its session's lease (``POST /control/heartbeat``) every ``every_s`` from a daemon
    thread, whatever the main thread does (a long train step); stops once the server says the session is over,
    or has not answered for a whole lease (the session is lost by then)."""

    def __init__(self, client: ServerClient, session: str, *, every_s: float) -> None:
        self._stop = threading.Event()
        threading.Thread(target=self._run, args=(client, session, every_s), name="serve-heartbeat",
                         daemon=True).start()

    def _run(self, client: ServerClient, session: str, every_s: float) -> None:
        answered = time.monotonic()
        while not self._stop.wait(every_s):
            try:
                if not client.request("POST", "/control/heartbeat", {"session": session}, timeout_s=every_s)["current"]:
                    return  # replaced or ended: the loop's next sync or rollouts say so
                answered = time.monotonic()
            except (ServerError, ServerGone):  # the loop's own requests say what is wrong
                if time.monotonic() - answered > 5 * every_s:
                    return

    def stop(self) -> None:
        self._stop.set()


class _Bounded:
    """The sync pair's group, each broadcast's timeout cut to what is left of this thread's deadline (gloo
    honours a per-operation timeout; NCCL's watchdog keeps the group's, weight_sync.peer_timeout_s)."""

    def __init__(self, group, client: ServerClient) -> None:
        self.group, self.client = group, client

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions):
        if (left := self.client.left()) is not None:
            # Whole milliseconds, rounded up: gloo's truncation let it time out up to 1 ms before the deadline, and
            # the sync then said "failed" instead of "did not finish within weight_sync.peer_timeout_s".
            opts.timeout = timedelta(milliseconds=math.ceil(max(left, 0.001) * 1000))
        return self.group.broadcast(tensors, opts)
