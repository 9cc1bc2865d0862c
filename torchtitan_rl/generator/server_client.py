"""The trainer's view of a rollout server (weight_sync.transport = "server").

The loop sees the interface of generator/base.py: ``sync`` (the weights over
the own-rank layout's NcclSender, to the server's session), ``submit`` /
``result`` (one POST /v1/completions with token-id prompts, sent from a
background thread so that it overlaps training; the token ids and logprobs
come back) and ``close``. Every trainer rank calls each method
together: trainer rank 0 talks HTTP and broadcasts the rollouts; every rank
joins the store (the sender's plan and headers) and the gathers of a sync.
"""

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from torchtitan_rl.config import JobConfig, SamplingConfig
from torchtitan_rl.generator.base import Later
from torchtitan_rl.generator.generator import Rollouts
from torchtitan_rl.generator.server import connect_host, sync_port
from torchtitan_rl.weight_sync import NcclSender, World
from torchtitan_rl.weight_sync.nccl import pair_group


class ServerError(RuntimeError):
    """The server answered a request with an error (its status and message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"rollout server: HTTP {status}: {message}")
        self.status, self.message = status, message

    def __reduce__(self):  # pickled to the other trainer ranks (broadcast_object_list)
        return ServerError, (self.status, self.message)


class ServerClient:
    """JSON over HTTP to one server (stdlib only); errors become ServerError with the server's message."""

    def __init__(self, base_url: str, *, token: str = "", timeout_s: float = 1800.0) -> None:
        self.base_url, self.token, self.timeout_s = base_url.rstrip("/"), token, timeout_s

    def request(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                message = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = raw.decode(errors="replace")[:500]
            raise ServerError(e.code, message) from None

    def wait_ready(self, timeout_s: float) -> dict:
        """GET /health until the server answers (it may still be starting its engine)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.request("GET", "/health")
            except (urllib.error.URLError, ConnectionError) as e:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"rollout server: no answer at {self.base_url}/health within "
                                       f"{timeout_s:g} s ({e}); is `python -m torchtitan_rl.serve` running?") from None
                time.sleep(0.5)


class ServerGenerator:
    """The generator as the loop sees it, behind HTTP; every trainer rank calls each method together."""

    def __init__(self, cfg: JobConfig, *, reference: dict[str, torch.Tensor], device: torch.device) -> None:
        host = connect_host(cfg.serve.host)
        timeout_s = cfg.weight_sync.peer_timeout_s
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.client = ServerClient(f"http://{host}:{cfg.serve.port}", token=cfg.serve.token, timeout_s=timeout_s)
        reply = [None]
        if self.rank == 0:
            self.client.wait_ready(timeout_s)
            reply = [self.client.request("POST", "/control/connect", {"trainer_ranks": dist.get_world_size()})]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(reply, src=0)
        self.session = session = reply[0]["session"]
        store = dist.TCPStore(host, sync_port(cfg), is_master=False, timeout=timedelta(seconds=timeout_s))
        store = dist.PrefixStore(f"{reply[0]['store_prefix']}/{session}", store)
        pair = None
        if self.rank == 0:
            pair = pair_group(dist.PrefixStore("pair", store), rank=0, device=device, timeout_s=timeout_s)
        world = World("trainer", self.rank, dist.get_world_size(), device, store, pair)
        self.sender = NcclSender(cfg.weight_sync, reference=reference, world=world, timeout_s=timeout_s)
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rollouts")
        self.inflight: list[Future] = []
        """Trainer rank 0: the HTTP requests not yet answered (grpo.max_staleness of them at most)."""

    def sync(self, state: dict[str, torch.Tensor], *, version: int) -> float:
        """Send ``state`` to the server, which serves ``version`` to the requests submitted after this;
        seconds the transfer took, once the requests submitted before have been answered (the server would
        otherwise admit a late one after the sync)."""
        for reply in self.inflight:
            reply.exception()  # waits; an error is raised by its result()
        self.inflight = []
        return self.sender.sync(state, version=version).seconds

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
        if self.rank == 0:
            try:
                self.client.request("POST", "/control/disconnect", {"session": self.session})
            except (ServerError, OSError):
                pass  # the server is gone already: nothing to end
