"""The rollout server: our generator behind an OpenAI-style HTTP API, fed weights by the trainer.

``TORCHTITAN_RL_SERVE_TOKEN=SECRET python -m torchtitan_rl.serve --config run_configs/...``
(the token from the environment, out of sight of ``ps``) builds, from the same
JobConfig as the trainer, the Engine (dummy weights,
NaN-poisoned: it serves nothing before the first sync), an EngineLoop
(continuous batching over concurrent requests, engine_loop.py) and:

    GET  /health               status, weight version, queue
    GET  /v1/models            the served model (serve.model_name)
    POST /v1/completions       text or token-id prompts
    POST /v1/chat/completions  messages through the checkpoint's chat template
    POST /control/connect      (Bearer serve.token) a trainer opens a sync session; {"takeover": true}
                               to replace one that is connected (409 without it, unless that one's lease ran out)
    POST /control/store        (Bearer serve.token) its ranks' store operations (set, get, wait, ...)
    POST /control/heartbeat    (Bearer serve.token) it renews its session's lease (serve.session_lease_s)
    POST /control/disconnect   (Bearer serve.token) it closes it

Request bodies are JSON: a Content-Type other than application/json gets 415 (none at all is read as JSON), and
a control request with a field the endpoint does not take gets 422 naming it. With serve.ssl_certfile the
server speaks HTTPS only (uvicorn's TLS); without it, a serve.host beyond loopback is said at start, in one
line, to carry the secrets in clear.

The /v1 endpoints need ``Authorization: Bearer <serve.api_key>`` when one is
set (required beyond loopback). Generation requests before the first sync
wait up to ``generator.wait_for_weights_s`` and then get 503 with a JSON
reason and ``Retry-After``; never a token from dummy weights. Every response
carries the version that produced it and the trainer session that sent it.
Parsing, templating and tokenizing run on a thread pool, after a character
cap, so the event loop (and /health) never waits for a big prompt; more than
``serve.max_concurrent_requests`` requests in progress (counted once their
body is in) or ``serve.max_requests_per_client`` open from one address get
429, and a body slower than ``serve.read_timeout_s`` gets 408 (headers:
serving/http_limits.py). A client that
disconnects has its samples aborted in the engine.

Weights: a trainer connects (``/control/connect``), gets a random session id,
and the two sides build the own-rank layout's two-rank group on the server's
sync store (serving/sync_store.py: in the server's memory, reached from
outside only through ``/control/store``, so only through serve.token): the trainer's
NcclSender, the server's NcclReceiver (weight_sync/nccl_sender.py, nccl_receiver.py: sync plan and
coverage proof at connect, validation before any write, buckets, checksums,
version published last; after a LoRA run's first full sync only the adapter
moves, one flat bucket). A session thread applies each sync between the
engine loop's batches (EngineLoop.begin_sync drains what runs). Every
message in the store is also signed with serve.token for its session
(serving/signed_store.py): a replayed one is rejected and ignored.
Rejections (forged messages, requests without the token or key) are logged
the first at once, then as one count per 30 s per source. A session lives while its trainer makes requests (its
client's heartbeat, every fifth of serve.session_lease_s, runs through long train steps); a connect with takeover,
or any connect once the session's lease ran out (a killed or frozen trainer), ends the previous
session and leaves it a signed notice that names its replacement; a trainer
that dies or stalls mid-sync is dropped after serve.sync_timeout_s, leaving
the previous version served if nothing was written yet, else nothing served
until the next sync: never a mix (over NCCL the watchdog ends the server
instead: docs/design.md).

Long: the routes and the sync session they share; the parts with a job of their own live beside it
(engine_loop.py, protocol.py, http_limits.py, sync_store.py).
"""

import asyncio
import base64
import json
import math
import secrets
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from torchtitan_rl.config import JobConfig, SamplingConfig
from torchtitan_rl.config.validation import tokenizer_dir
from torchtitan_rl.serving.engine_loop import EngineLoop, Sample
from torchtitan_rl.engine.engine import WeightsNotSyncedError, sample_seed, sampling_params
from torchtitan_rl.serving.openai_api import ChatRequest, CompletionRequest, HttpError, parse
from torchtitan_rl.serving.protocol import ENDED, SESSION_PREFIX, pair_store, session_prefix, session_store
from torchtitan_rl.serving.sync_store import StoreFull, SyncStore
from torchtitan_rl.distributed.world import World, pair_group
from torchtitan_rl.weight_sync.nccl_receiver import NcclReceiver
from torchtitan_rl.serving.signed_store import REJECTIONS

_POLL_S = 0.01
"""How often a session thread looks for the trainer's next sync header."""
_WAIT_SLICE_S = 5.0
"""Longest one store ``wait`` request is held open; the trainer's client asks again until its own timeout."""

class SyncSessions:
    """The trainer's sync sessions; one at a time, each a thread that applies syncs as they come."""

    def __init__(self, loop: EngineLoop, *, device: torch.device, secret: str, timeout_s: float,
                 store_bytes: int, lease_s: float) -> None:
        """``store_bytes``: the bound of what the trainer may write in the sync store (serve.sync_store_mb);
        ``lease_s``: how long a session lasts without a request from its trainer (serve.session_lease_s)."""
        self.loop, self.device, self.secret, self.timeout_s, self.lease_s = loop, device, secret, timeout_s, lease_s
        self.sync_store = SyncStore(max_bytes=store_bytes)
        self.store = self.sync_store.store
        self._previous: str | None = None
        """The session the current one replaced: its trainer may still read its notice."""
        self._lock = threading.Lock()
        """Held while a sync is applied: an ending session never overlaps the next one's sync."""
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._since = ""
        """When the current session connected (HH:MM:SS), for the refusal of a second trainer."""
        self._seen = 0.0
        """When the current session's trainer made its last request (monotonic): its lease runs from there."""
        self._keys = ""
        """The current session's key prefix (its store requests renew the lease too)."""
        self.session: str | None = None
        self.syncs = 0

    def connected(self) -> str | None:
        """The session of the trainer connected now: not disconnected, its thread not ended by a failure."""
        alive = self._thread is not None and self._thread.is_alive() and not self._stop.is_set()
        return self.session if alive else None

    def connect(self, *, takeover: bool) -> str:
        current = self.connected()
        silent = time.monotonic() - self._seen
        expired = current is not None and silent > self.lease_s
        if current is not None and not takeover and not expired:
            raise HttpError(409, f"a trainer is connected (session {current[:8]}, since {self._since}); connect "
                                 "with {\"takeover\": true} to replace it (the trainer's serve.takeover), or "
                                 f"after its lease runs out ({self.lease_s:g} s without a request from it, "
                                 "serve.session_lease_s)",
                            type="conflict", headers={"Retry-After": str(math.ceil(self.lease_s - silent))})
        session = uuid.uuid4().hex
        if self._stop is not None:
            self._stop.set()  # the previous session's thread exits at its next poll
            when = time.strftime("%H:%M:%S")
            lapsed = (f"its lease ran out ({silent:.0f} s without a request from it, serve.session_lease_s "
                      f"{self.lease_s:g}) and " if expired and not takeover else "")
            session_store(self.store, self.session, secret=self.secret).set(
                ENDED, f"{lapsed}another trainer connected to the server at {when} (session {session[:8]}) and "
                       "replaced this one; one server takes one trainer")
            print(f"torchtitan_rl serve: session {self.session[:8]} replaced by {session[:8]}"
                  f"{f' (its lease ran out: no request for {silent:.0f} s)' if lapsed else ''}", flush=True)
        if self._previous is not None:  # two sessions back: nobody reads its keys any more
            self.sync_store.drop(session_prefix(self._previous, secret=self.secret) + "/")
        self._previous = self.session
        self._stop, self.session, self._since = threading.Event(), session, time.strftime("%H:%M:%S")
        self._seen, self._keys = time.monotonic(), session_prefix(session, secret=self.secret) + "/"
        self._thread = threading.Thread(target=self._serve, args=(session, self._stop),
                                        name=f"sync-{session[:8]}", daemon=True)
        self._thread.start()
        return session

    def owns(self, key: str) -> bool:
        """Whether ``key`` lies in the current or the replaced session's keys: all a trainer may touch."""
        return any(s is not None and key.startswith(session_prefix(s, secret=self.secret) + "/")
                   for s in (self.session, self._previous))

    def renew(self, session: str) -> bool:
        """The trainer of ``session`` made a request (its heartbeat): its lease starts again. False when that
        session is not the connected one (replaced, disconnected or ended): its heartbeat may stop."""
        if session != self.connected():
            return False
        self._seen = time.monotonic()
        return True

    def renew_by_key(self, key: str) -> None:
        """A store request on the current session's keys renews its lease as a heartbeat does."""
        if self.session is not None and key.startswith(self._keys):
            self._seen = time.monotonic()

    def disconnect(self, session: str) -> bool:
        """End ``session`` if it is the current one (a trainer replaced by a newer one must not end it)."""
        if self._stop is None or session != self.session:
            return False
        self._stop.set()
        return True

    def _serve(self, session: str, stop: threading.Event) -> None:
        try:
            pair = pair_group(pair_store(self.store, session, secret=self.secret), rank=1, device=self.device,
                              timeout_s=self.timeout_s)
            store = session_store(self.store, session, secret=self.secret)
            world = World("generator", 1, 1, self.device, store, pair)  # rank 1 of the pair; one sender
            receiver = NcclReceiver(generator=self.loop, world=world, timeout_s=self.timeout_s)
            print(f"torchtitan_rl serve: trainer connected (session {session[:8]}, {len(receiver.keys)} tensors)",
                  flush=True)
            while not stop.wait(_POLL_S):
                if not receiver.pending():
                    continue
                with self._lock:
                    stats = None
                    try:
                        stats = receiver.receive(timeout_s=0)  # None: the header was forged (logged, ignored)
                    finally:  # the receiver published (or restored, or withdrew) a version: admit again
                        published = stats is not None and not stats.rejected
                        self.loop.resume(published_by=session if published else None)
                if stats is not None:
                    self.syncs += 1
                    what = "rejected" if stats.rejected else f"{stats.bytes_written / 2**20:.1f} MiB"
                    print(f"torchtitan_rl serve: sync -> version {stats.version} ({what}, {stats.seconds:.3f} s, "
                          f"session {session[:8]})", flush=True)
        except Exception as e:  # the server keeps serving (previous version, or nothing after a partial write)
            version = self.loop.weight_version
            state = (f"still serving version {version}" if version is not None else
                     "serving nothing until a trainer syncs (a failed sync that had written part of the weights "
                     "withdraws them)")
            print(f"torchtitan_rl serve: sync session {session[:8]} ended: {type(e).__name__}: "
                  f"{str(e).splitlines()[0] if str(e) else ''}; {state}", flush=True)


class RolloutServer:
    """The HTTP side: request checks, tokenization, responses; generation goes through the EngineLoop."""

    def __init__(self, cfg: JobConfig, *, loop: EngineLoop, sessions: SyncSessions, tokenizer) -> None:
        self.cfg, self.loop, self.sessions, self.tokenizer = cfg, loop, sessions, tokenizer
        self.max_model_len = cfg.generator.max_model_len
        self.vocab_size = loop.generator.shape.vocab_size
        # No token spells more characters than the longest vocabulary entry: a longer text cannot fit.
        self.max_chars = self.max_model_len * max(map(len, tokenizer.get_vocab()), default=1)
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tokenize")
        """JSON parsing, validation, chat templates and tokenizing: off the event loop."""
        self.in_progress = 0
        """Generation requests between their body's last byte and their response (the event loop's own count)."""
        self.per_client: dict[str, int] = {}
        """Generation requests between their first byte and their response, per client address."""

    def app(self):
        from starlette.applications import Starlette
        from starlette.routing import Route

        routes = [
            Route("/health", self._handler(self.health), methods=["GET"]),
            Route("/v1/models", self._handler(self.models, key="api_key"), methods=["GET"]),
            Route("/v1/completions", self._handler(self.completions, key="api_key", generation=True),
                  methods=["POST"]),
            Route("/v1/chat/completions", self._handler(self.chat, key="api_key", generation=True),
                  methods=["POST"]),
            Route("/control/connect", self._handler(self.connect, key="token"), methods=["POST"]),
            Route("/control/store", self._handler(self.store, key="token"), methods=["POST"]),
            Route("/control/heartbeat", self._handler(self.heartbeat, key="token"), methods=["POST"]),
            Route("/control/disconnect", self._handler(self.disconnect, key="token"), methods=["POST"]),
        ]
        return Starlette(routes=routes)

    def _handler(self, fn, *, key: str | None = None, generation: bool = False):
        from starlette.responses import JSONResponse

        async def handle(request):
            try:
                if key is not None:
                    self._authorize(request, key)
                body, headers = await (self._generation(request, fn) if generation else fn(request))
                return JSONResponse(body, headers=headers)
            except HttpError as e:
                return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
            except Exception as e:  # a bug, not the client's fault: say so, keep serving
                return JSONResponse(HttpError(500, f"{type(e).__name__}: {e}", type="server_error").body(),
                                    status_code=500)

        return handle

    async def _generation(self, request, fn):
        """``fn(body)`` under the per-client and the global caps, cancelled (its samples aborted) if the client
        goes away. The global cap counts a request once its body is in: slow uploads cannot hold its slots."""
        client = request.client.host if request.client else ""
        mine = self.cfg.serve.max_requests_per_client
        if self.per_client.get(client, 0) >= mine:
            raise HttpError(429, f"{mine} generation requests from {client} are open (serve.max_requests_per_client); "
                                 "retry later", type="rate_limit_error", headers={"Retry-After": "1"})
        self.per_client[client] = self.per_client.get(client, 0) + 1
        counted = False
        work = gone = None
        try:
            body = await self._json(request)
            cap = self.cfg.serve.max_concurrent_requests
            if self.in_progress >= cap:
                raise HttpError(429, f"{cap} generation requests are in progress (serve.max_concurrent_requests); "
                                     "retry later", type="rate_limit_error", headers={"Retry-After": "1"})
            self.in_progress += 1
            counted = True
            work = asyncio.ensure_future(fn(body))
            gone = asyncio.ensure_future(_disconnected(request))  # only once the body is read: one reader
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise HttpError(499, "the client closed the connection")  # nobody reads this answer
            return work.result()
        finally:
            self.in_progress -= counted
            self.per_client[client] -= 1
            if not self.per_client[client]:
                del self.per_client[client]
            for task in (work, gone):
                if task is not None and not task.done():
                    task.cancel()  # also when uvicorn cancels this handler: the samples are aborted

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # -- helpers ----------------------------------------------------------------
    async def _json(self, request, *, field: str = "max_body_mb", empty=None, fields: tuple[str, ...] = ()):
        """The body's JSON, at most serve.<field> MiB (max_body_mb; the store's values: sync_store_mb);
        ``empty`` (when not None) stands for an empty body; ``fields``: the only ones a JSON object may have
        (a control endpoint's; empty: any, as OpenAI's endpoints ignore what they do not use)."""
        _check_content_type(request)
        mb = getattr(self.cfg.serve, field)
        limit = int(mb * (1 << 20)) * (2 if field == "sync_store_mb" else 1)  # base64 and JSON around the values
        length = request.headers.get("content-length")
        if length is not None and int(length) > limit:
            raise HttpError(413, f"request body of {int(length)} bytes exceeds serve.{field} ({mb:g} MiB)")
        raw = bytearray()
        timeout_s = self.cfg.serve.read_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                async for chunk in request.stream():
                    raw += chunk
                    if len(raw) > limit:
                        raise HttpError(413, f"request body exceeds serve.{field} ({mb:g} MiB)")
        except TimeoutError:
            source = request.client.host if request.client else "an unknown address"
            REJECTIONS("requests too slow to send their body", source,
                       f"torchtitan_rl serve: answered 408 to {request.method} {request.url.path} from {source}: "
                       f"its body took over {timeout_s:g} s (serve.read_timeout_s)")
            raise HttpError(408, f"the request body did not arrive within {timeout_s:g} s (serve.read_timeout_s)",
                            headers={"Connection": "close"}) from None
        if not raw and empty is not None:
            return empty
        body = await self._off_loop(_loads, raw)
        unknown = [k for k in body if k not in fields] if fields and isinstance(body, dict) else []
        if unknown:
            raise HttpError(422, f"{unknown[0]}: unknown field; {request.url.path} takes {', '.join(fields)}",
                            param=unknown[0])
        return body

    def _authorize(self, request, key: str) -> None:
        secret = getattr(self.cfg.serve, key)
        if key == "api_key" and not secret:
            return  # no key set: open (serve.host is loopback, check_serve made sure)
        # RFC 7235: the scheme is case-insensitive ("bearer" too); one or more spaces before the credentials.
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), secret.encode()):
            what = "control" if key == "token" else "generation"
            source = request.client.host if request.client else "an unknown address"
            REJECTIONS(f"requests without serve.{key}", source,
                       f"torchtitan_rl serve: rejected {request.method} {request.url.path} from {source}: no valid "
                       f"'Authorization: Bearer <serve.{key}>'")
            raise HttpError(401, f"{what} endpoints need 'Authorization: Bearer <serve.{key}>'",
                            type="authentication_error")

    def _check_model(self, name: str) -> None:
        if name != self.cfg.serve.model_name:
            raise HttpError(404, f"model {name!r} is not served here; this server serves "
                                 f"{self.cfg.serve.model_name!r}", param="model", code="model_not_found")

    def _check_size(self, body) -> None:
        """Bounds checked before validating or tokenizing anything: a prompt that cannot fit costs no time."""
        if not isinstance(body, dict):
            return  # parse() says what is wrong
        prompt, fits = body.get("prompt"), f"the context of {self.max_model_len} tokens (generator.max_model_len)"
        if isinstance(prompt, list) and len(prompt) > max(self.max_model_len, self.cfg.serve.max_n):
            raise HttpError(400, f"prompt: a list of {len(prompt)} exceeds both {fits} and serve.max_n", param="prompt")
        items = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []
        for i, x in enumerate(items):
            where = "prompt" if len(items) == 1 else f"prompt[{i}]"
            if isinstance(x, str) and len(x) > self.max_chars:
                raise HttpError(400, f"{where}: {len(x)} characters exceed {fits}", param=where)
            if isinstance(x, list) and len(x) > self.max_model_len:
                raise HttpError(400, f"{where}: {len(x)} prompt tokens exceed {fits}", param=where)
        messages = body.get("messages")
        if isinstance(messages, list):
            chars = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))
            if chars > self.max_chars:
                raise HttpError(400, f"messages: {chars} characters of content exceed {fits}", param="messages")
    def _check_prompt(self, ids: list[int], max_tokens: int, where: str) -> None:
        if not ids:
            raise HttpError(400, f"{where}: empty prompt", param=where)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise HttpError(400, f"{where}: token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})",
                            param=where)
        if len(ids) + max_tokens > self.max_model_len:
            raise HttpError(400, f"{where}: {len(ids)} prompt tokens + max_tokens {max_tokens} exceed the context "
                                 f"of {self.max_model_len} tokens (generator.max_model_len)", param=where)

    async def _generate(self, req, prompts: list[list[int]], max_tokens: int, logprobs: int) -> list[Sample]:
        if req.n * len(prompts) > self.cfg.serve.max_n:
            raise HttpError(400, f"n: {req.n} completions x {len(prompts)} prompts exceed serve.max_n "
                                 f"({self.cfg.serve.max_n})", param="n")
        for i, ids in enumerate(prompts):
            self._check_prompt(ids, max_tokens, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
        bad = [t for t in req.stop_token_ids or [] if not 0 <= t < self.vocab_size]
        if bad:
            raise HttpError(400, f"stop_token_ids: {bad[:5]} outside the vocabulary [0, {self.vocab_size})",
                            param="stop_token_ids")
        s = SamplingConfig(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, max_tokens=max_tokens)
        stop = req.stop_strings()
        params, repeated = [], []
        try:
            for i, ids in enumerate(prompts):  # group-contiguous, seeds as the in-process Engine's
                for j in range(req.n):
                    params.append(sampling_params(s, stop_token_ids=req.stop_token_ids,
                                                  seed=sample_seed(req.seed, i, j), logprobs=logprobs, stop=stop))
                    repeated.append(ids)
        except Exception as e:  # vLLM's own checks of sampling settings (VLLMValidationError)
            raise HttpError(400, f"{getattr(e, 'parameter', None) or 'sampling'}: {e}",
                            param=getattr(e, "parameter", None)) from None
        futures = []
        try:
            futures = self.loop.submit(repeated, params)
            samples = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except asyncio.CancelledError:  # the client went away (or the server is stopping)
            self.loop.cancel(futures)
            raise
        except WeightsNotSyncedError as e:
            raise HttpError(503, f"generator: {e}", type="weights_not_synced",
                            headers={"Retry-After": "1"}) from None
        except ValueError as e:  # the engine refused this request (add_request's checks); others run on
            raise HttpError(400, str(e)) from None
        assert len({(s.weight_version, s.weight_session) for s in samples}) == 1, \
            "one request's samples span two versions"
        return samples

    def _token(self, tid: int) -> str:
        return self.tokenizer.convert_ids_to_tokens(tid)

    def _envelope(self, kind: str, choices: list[dict], samples: list[Sample], prompt_tokens: int):
        version = samples[0].weight_version
        completion_tokens = sum(len(s.token_ids) for s in samples)
        body = {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.cfg.serve.model_name,
            "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "weight_version": version,
            "weight_session": samples[0].weight_session,
        }
        return body, {"X-Weight-Version": str(version), "X-Weight-Session": str(samples[0].weight_session)}

    # -- endpoints --------------------------------------------------------------
    async def health(self, request):
        if not self.loop.alive():
            raise HttpError(503, f"generator: the engine loop stopped: {self.loop.error}", type="server_error")
        return {"status": "ok", "weight_version": self.loop.weight_version,
                "syncs": self.sessions.syncs, "in_progress": self.in_progress, **self.loop.stats(),
                "rejected": dict(REJECTIONS.totals)}, {}

    async def models(self, request):
        return {"object": "list", "data": [{
            "id": self.cfg.serve.model_name, "object": "model", "owned_by": "torchtitan_rl",
            "max_model_len": self.max_model_len, "weight_version": self.loop.weight_version,
        }]}, {}

    def _completion_prompts(self, body) -> tuple[CompletionRequest, list[list[int]]]:
        """On the pool: the request checked and its prompts as token ids."""
        self._check_size(body)
        req = parse(CompletionRequest, body)
        self._check_model(req.model)
        p = req.prompt
        if isinstance(p, str):
            prompts = self.tokenizer([p], add_special_tokens=True)["input_ids"]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        elif p and all(isinstance(x, str) for x in p):
            prompts = self.tokenizer(list(p), add_special_tokens=True)["input_ids"]
        else:
            prompts = [list(x) for x in p]
        if not prompts:
            raise HttpError(400, "prompt: empty", param="prompt")
        return req, prompts

    async def completions(self, body):
        req, prompts = await self._off_loop(self._completion_prompts, body)
        samples = await self._generate(req, prompts, req.max_tokens or 16, req.logprobs or 0)
        choices = []
        for k, s in enumerate(samples):
            choice = {"index": k, "text": s.text, "finish_reason": s.finish_reason, "logprobs": None}
            if req.logprobs is not None:
                choice["logprobs"] = {
                    "tokens": self.tokenizer.convert_ids_to_tokens(s.token_ids),  # one call, not one per token
                    "token_logprobs": [_finite(lp) for lp in s.logprobs],
                    "top_logprobs": None if s.top_logprobs is None else [
                        {self._token(t): _finite(lp) for t, lp in pos.items()} for pos in s.top_logprobs],
                }
            if req.return_token_ids:
                choice["token_ids"] = s.token_ids
                choice["prompt_token_ids"] = prompts[k // req.n]
            choices.append(choice)
        return self._envelope("text_completion", choices, samples, sum(len(x) for x in prompts))

    def _chat_prompt(self, body) -> tuple[ChatRequest, list[int]]:
        """On the pool: the request checked and its messages through the chat template, as token ids."""
        self._check_size(body)
        req = parse(ChatRequest, body)
        self._check_model(req.model)
        if not getattr(self.tokenizer, "chat_template", None):
            raise HttpError(400, "messages: the model's tokenizer has no chat template; use /v1/completions",
                            param="messages")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # jinja errors: a role the template does not know, ...
            raise HttpError(400, f"messages: the chat template rejected them: {e}", param="messages") from None
        return req, self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template wrote the specials

    async def chat(self, body):
        req, prompt = await self._off_loop(self._chat_prompt, body)
        k = req.top_logprobs if req.logprobs else 0
        # As OpenAI's chat: without a limit, the rest of the context.
        max_tokens = req.max_completion_tokens or req.max_tokens or max(1, self.max_model_len - len(prompt))
        samples = await self._generate(req, [prompt], max_tokens, k)
        choices = []
        for i, s in enumerate(samples):
            choice = {"index": i, "message": {"role": "assistant", "content": s.text},
                      "finish_reason": s.finish_reason, "logprobs": None}
            if req.logprobs:
                choice["logprobs"] = {"content": [
                    {"token": token, "logprob": _finite(lp), "top_logprobs": [
                        {"token": self._token(u), "logprob": _finite(v)} for u, v in (top or {}).items()]}
                    for token, lp, top in zip(self.tokenizer.convert_ids_to_tokens(s.token_ids), s.logprobs,
                                              s.top_logprobs or [None] * len(s.token_ids))
                ]}
            if req.return_token_ids:
                choice["token_ids"] = s.token_ids
                choice["prompt_token_ids"] = prompt
            choices.append(choice)
        return self._envelope("chat.completion", choices, samples, len(prompt))

    async def connect(self, request):
        body = await self._json(request, empty={}, fields=("takeover",))
        takeover = body.get("takeover", False) if isinstance(body, dict) else None
        if not isinstance(takeover, bool):
            raise HttpError(400, "takeover: true or false (replace a connected trainer)", param="takeover")
        session = self.sessions.connect(takeover=takeover)
        return {"session": session, "store_prefix": SESSION_PREFIX, "weight_version": self.loop.weight_version,
                "lease_s": self.sessions.lease_s}, {}

    async def heartbeat(self, request):
        """The connected trainer renews its session's lease; ``current`` false: that session is over."""
        return {"current": self.sessions.renew(await self._session(request))}, {}

    async def store(self, request):
        """One operation of a trainer rank on the sync store (rollout/server_http.py: HttpStore)."""
        body = await self._json(request, field="sync_store_mb", fields=_STORE_FIELDS)
        if not isinstance(body, dict):
            raise HttpError(400, "body: a JSON object {\"op\", \"key\" or \"keys\", ...}")
        op = body.get("op")
        keys = body.get("keys") if op in ("check", "wait") else [body.get("key")]
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
            raise HttpError(400, "key/keys: the store keys of this operation", param="key")
        foreign = [k for k in keys if not self.sessions.owns(k)]
        if foreign:
            raise HttpError(403, f"key {foreign[0]!r} is not in a live sync session's keys", param="key")
        store, key = self.sessions.sync_store, keys[0]
        self.sessions.renew_by_key(key)
        try:
            if op == "set":
                store.set(key, _b64(body, "value"))
                return {}, {}
            if op == "get":
                value = store.get(key)
                if value is None:
                    raise HttpError(404, f"key {key!r} is not set", param="key")
                return {"value": base64.b64encode(value).decode()}, {}
            if op == "check":
                return {"ready": store.check(keys)}, {}
            if op == "wait":  # a long poll, at most _WAIT_SLICE_S: the client asks again until its own timeout
                timeout_s = body.get("timeout_s", 0)
                if not isinstance(timeout_s, (int, float)):
                    raise HttpError(400, "timeout_s: seconds to wait", param="timeout_s")
                deadline = time.monotonic() + min(timeout_s, _WAIT_SLICE_S)
                while not (ready := store.check(keys)) and time.monotonic() < deadline:
                    await asyncio.sleep(_POLL_S / 5)
                return {"ready": ready}, {}
            if op == "add":
                amount = body.get("amount", 0)
                if not isinstance(amount, int):
                    raise HttpError(400, "amount: an integer", param="amount")
                return {"value": store.add(key, amount)}, {}
            if op == "compare_set":
                value = store.compare_set(key, _b64(body, "expected"), _b64(body, "desired"))
                return {"value": base64.b64encode(value).decode()}, {}
        except StoreFull as e:
            raise HttpError(413, str(e)) from None
        raise HttpError(400, f"op: one of set, get, check, wait, add, compare_set, got {op!r}", param="op")

    async def disconnect(self, request):
        return {"status": "ok", "ended": self.sessions.disconnect(await self._session(request))}, {}

    async def _session(self, request) -> str:
        """The ``{"session"}`` body of /control/heartbeat and /control/disconnect."""
        body = await self._json(request, fields=("session",))
        session = body.get("session") if isinstance(body, dict) else None
        if not isinstance(session, str):
            raise HttpError(400, "session: the id /control/connect returned", param="session")
        return session


_STORE_FIELDS = ("op", "key", "keys", "value", "timeout_s", "amount", "expected", "desired")
"""What a /control/store request may carry (rollout/server_http.py: HttpStore sends them)."""


def _check_content_type(request) -> None:
    """A JSON body, or none said: a client that says text/plain or a form (curl -d without -H) gets 415 rather
    than its body read as JSON anyway."""
    given = request.headers.get("content-type")
    if given is None:
        return
    media = given.split(";")[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise HttpError(415, f"Content-Type: {given!r} is not JSON; send 'Content-Type: application/json' "
                             "(curl: -H 'Content-Type: application/json')")


def _b64(body: dict, field: str) -> bytes:
    try:
        return base64.b64decode(body[field], validate=True)
    except (KeyError, TypeError, ValueError):
        raise HttpError(400, f"{field}: a base64 string", param=field) from None


def _loads(raw: bytes):
    """A request body's JSON; any parse failure is the client's: 400."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HttpError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise HttpError(400, "malformed JSON body: nested too deeply") from None


async def _disconnected(request) -> None:
    """Returns when the client closes its connection (as vLLM's listen_for_disconnect); the body is read."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _finite(logprob: float) -> float:
    """JSON has no -inf: a token top-k/top-p removed gets -9999.0, as in OpenAI's and vLLM's servers."""
    return max(logprob, -9999.0)


def tokenizer_folder(cfg: JobConfig, task, workdir: Path) -> str:
    """An HF tokenizer folder for the engine and the chat template: the run's, or the task's own tokenizer
    (digits: a ``tokenizers.Tokenizer``) written out as one."""

    if tokenizer_dir(cfg):
        return tokenizer_dir(cfg)
    from transformers import PreTrainedTokenizerFast

    tok = task.tokenizer
    if not isinstance(tok, PreTrainedTokenizerFast):
        tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=tok.id_to_token(task.eos_id),
                                      pad_token=tok.id_to_token(task.pad_id))
    folder = workdir / "generator_model"  # beside the config.json the Engine writes there: vLLM reads both
    tok.save_pretrained(str(folder))
    return str(folder)
