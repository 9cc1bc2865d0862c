"""The rollout server as a user runs it: a real `python -m torchtitan_rl.serve` process on 127.0.0.1.

One server (run_configs/cpu_tiny.toml, real vLLM CPU engine) serves the whole
module; this process plays the trainer (ServerGenerator: the same client the
GRPO loop uses), and for the crash tests a trainer subprocess that dies in
the middle of a sync, stalls, lives on through a long "train step" or
freezes its server (server_trainer_worker.py); the TLS test starts a server
of its own. The tests run in file order: the first two need a
server that has not been synced yet. The server gets its token and API key
from the environment.
"""

import contextlib
import dataclasses
import http.client
import json
import os
import random
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    PROMPTS, REPO, assert_serves, free_port, make_generator, native_state, sync_model, trainer_model,
)
from torchtitan_rl.config import SamplingConfig, load_toml
from torchtitan_rl.serving.signed_store import session_namespace

CPU_TINY = REPO / "run_configs" / "cpu_tiny.toml"
TOKEN = "test-secret"
API_KEY = "test-key"
EOS = 2
"""<eos> of the digits tokenizer (run_configs/cpu_tiny.toml's task)."""
WAIT_S = 3.0
"""generator.wait_for_weights_s of the server: a request before the first sync waits this long, then 503.
Long enough for a sync of the tiny model to land inside it (tens of ms), short enough to wait out."""
SYNC_TIMEOUT_S = 5.0
"""serve.sync_timeout_s of the server: a stalled trainer's sync is dropped after this."""
MAX_REQUESTS = 48
"""serve.max_concurrent_requests of the server: above the load test's 32 clients."""
PER_CLIENT = 100
"""serve.max_requests_per_client of the server: above the 429 test's 72 clients (all from 127.0.0.1)."""
READ_TIMEOUT_S = 3.0
"""serve.read_timeout_s of the server: a slow client's headers or body are cut off after this."""
LEASE_S = 3.0
"""serve.session_lease_s of the server: a trainer that sends no request for this long may be replaced without
serve.takeover (its heartbeat runs every fifth of it)."""


def _config(port: int, out: Path):
    cfg = load_toml(CPU_TINY)
    cfg.job.output_dir = str(out)
    cfg.serve.port, cfg.serve.token, cfg.serve.api_key = port, TOKEN, API_KEY
    cfg.weight_sync.transport = "server"
    cfg.weight_sync.peer_timeout_s = 60.0
    cfg.serve.takeover = True  # the tests play one trainer after another on one server
    return cfg


@contextlib.contextmanager
def _server_process(out: Path, *, cert: Path | None = None, key: Path | None = None):
    """A server process on 127.0.0.1, up and answering (over https with ``cert`` and ``key``, which the trainer
    side then trusts); yields (its config, the process)."""
    cfg = _config(free_port(), out / "trainer")
    tls = []
    if cert is not None:
        cfg.serve.ssl_cafile = str(cert)
        tls = ["--serve.ssl_certfile", str(cert), "--serve.ssl_keyfile", str(key)]
    log = open(out / "server.log", "w")
    proc = subprocess.Popen(  # the secrets from the environment, as a user keeps them out of `ps`
        [sys.executable, "-m", "torchtitan_rl.serve", "--config", str(CPU_TINY), "--job.output_dir", str(out / "server"),
         "--serve.port", str(cfg.serve.port),
         "--generator.wait_for_weights_s", str(WAIT_S), "--weight_sync.peer_timeout_s", "60",
         "--serve.sync_timeout_s", str(SYNC_TIMEOUT_S), "--serve.max_concurrent_requests", str(MAX_REQUESTS),
         "--serve.max_requests_per_client", str(PER_CLIENT), "--serve.read_timeout_s", str(READ_TIMEOUT_S),
         "--serve.session_lease_s", str(LEASE_S), *tls],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "TORCHTITAN_RL_SERVE_TOKEN": TOKEN, "TORCHTITAN_RL_API_KEY": API_KEY},
    )
    cfg.log, cfg.pid = out / "server.log", proc.pid
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (out / "server.log").read_text()[-3000:]
            try:
                _get(cfg, "/health")
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, (out / "server.log").read_text()[-3000:]
                time.sleep(0.5)
        yield cfg, proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server process; yields its config (the trainer side reads the same serve section)."""
    with _server_process(tmp_path_factory.mktemp("serve")) as (cfg, _):
        yield cfg


def _request(cfg, method: str, path: str, body=None, *, raw: bytes | None = None, token: str | None = None,
             timeout: float = 120, content_type: str = "application/json", scheme: str = "Bearer"):
    """(status, headers, JSON body) of one request; HTTP errors are returned, not raised. /v1 requests carry the
    API key unless a ``token`` is given ("" for none)."""
    from torchtitan_rl.serving.protocol import base_url, client_tls

    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(f"{base_url(cfg.serve)}{path}", data=data, method=method)
    req.add_header("Content-Type", content_type)
    if token is None and path.startswith("/v1/"):
        token = API_KEY
    if token:
        req.add_header("Authorization", f"{scheme} {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=client_tls(cfg.serve)) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def _post_without_content_type(cfg, path: str, body: dict, *, token: str) -> tuple[int, dict]:
    """(status, JSON body) of a POST that says no Content-Type (urllib always sends one)."""
    conn = http.client.HTTPConnection("127.0.0.1", cfg.serve.port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Authorization": f"Bearer {token}"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _get(cfg, path: str) -> dict:
    status, _, body = _request(cfg, "GET", path)
    assert status == 200, body
    return body


def _complete(cfg, prompt=PROMPTS[0], *, timeout: float = 120, **fields):
    return _request(cfg, "POST", "/v1/completions", {
        "model": "torchtitan_rl", "prompt": prompt, "max_tokens": 4, "logprobs": 0, "return_token_ids": True, **fields,
    }, timeout=timeout)


def _connect(cfg, *, reference=None):
    """A trainer connection from this process (a new session replaces the previous one)."""
    from torchtitan_rl.rollout.server_client import ServerGenerator
    from torchtitan_rl.distributed.process_group import init_process_group

    init_process_group(torch.device("cpu"))  # the sender's collectives run on a one-rank trainer world
    reference = native_state(trainer_model(seed=0)) if reference is None else reference
    return ServerGenerator(cfg, reference=reference, device=torch.device("cpu"))


@contextlib.contextmanager
def _hanging_up(cfg, body: dict):
    """A completion request sent on a raw connection, closed when the block ends without reading the answer."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", cfg.serve.port)) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        yield


def _health_until(cfg, ready, timeout_s: float) -> dict:
    """GET /health until ``ready(health)``; the last answer."""
    deadline = time.monotonic() + timeout_s
    while not ready(health := _get(cfg, "/health")):
        assert time.monotonic() < deadline, health
        time.sleep(0.05)
    return health


def test_a_client_that_hangs_up_while_waiting_for_weights_is_dropped_from_the_queue(server):
    if _get(server, "/health")["weight_version"] is not None:
        pytest.skip("needs a server nobody synced yet: run the whole module")
    before = _get(server, "/health")
    with _hanging_up(server, {"model": "torchtitan_rl", "prompt": PROMPTS[0], "max_tokens": 4, "n": 3}):
        _health_until(server, lambda h: h["queued"] == 3, timeout_s=WAIT_S - 1)  # waiting for weights
    # Dropped when the client left, not when its wait for weights ran out.
    health = _health_until(server, lambda h: h["queued"] == 0, timeout_s=WAIT_S - 1.5)
    assert health["dropped"] == before["dropped"] + 3 and health["status"] == "ok", health


def test_requests_before_the_first_sync_get_503_and_a_waiting_one_gets_version_1(server):
    if _get(server, "/health")["weight_version"] is not None:
        pytest.skip("needs a server nobody synced yet: run the whole module")
    trainer = _connect(server)  # connected (plan built), nothing synced

    started = time.monotonic()
    status, headers, body = _complete(server)
    assert status == 503, body
    assert time.monotonic() - started >= WAIT_S - 0.5  # it waited for weights first
    assert body["error"]["type"] == "weights_not_synced" and "no weights synced yet" in body["error"]["message"]
    assert headers["retry-after"] == "1"
    # Chat is gated too (and says first that this tokenizer has no chat template).
    assert _get(server, "/health")["weight_version"] is None

    replies = []
    waiting = threading.Thread(target=lambda: replies.append(_complete(server, seed=3)))
    waiting.start()
    time.sleep(0.3)
    model = trainer_model(seed=0)
    trainer.sync(native_state(model), version=1)
    waiting.join()
    status, headers, body = replies[0]
    assert status == 200, body
    assert body["weight_version"] == 1 and headers["x-weight-version"] == "1"
    assert _get(server, "/health")["weight_version"] == 1


@pytest.mark.slow
def test_completions_equal_the_in_process_generators(server, tmp_path):
    trainer = _connect(server)
    model = trainer_model(seed=2)
    trainer.sync(native_state(model), version=7)
    sampling = SamplingConfig(max_tokens=6)
    # The server stops at the tokenizer's eos by itself (as any OpenAI server); the engine without a tokenizer
    # only when told: the GRPO loop always passes the task's eos.
    served = trainer.rollouts(PROMPTS, n=2, sampling=sampling, stop_token_ids=[EOS], seed=11)

    local = make_generator(tmp_path)
    try:
        sync_model(local, model, version=7)
        expected = local.generate(PROMPTS, n=2, sampling=sampling, stop_token_ids=[EOS], seed=11)
    finally:
        local.close()
    assert served.weight_version == expected.weight_version == 7
    assert served.prompt_ids == expected.prompt_ids
    assert served.completion_ids == expected.completion_ids
    # Same engine, same batch, same weights: the logprobs agree to float rounding, and they are this model's.
    for a, b in zip(served.logprobs, expected.logprobs):
        assert a == pytest.approx(b, abs=1e-5)
    assert_serves(served, model, not_=[trainer_model(seed=0)])


def test_load_with_two_syncs_in_the_middle_loses_nothing_and_mixes_no_versions(server):
    trainer = _connect(server)
    models = {v: trainer_model(seed=v) for v in (20, 21, 22)}
    trainer.sync(native_state(models[20]), version=20)
    published = {20: time.monotonic()}  # version -> when its sync returned
    clients, per_client = 32, 10
    done = []

    def client(c: int) -> None:
        rng = random.Random(c)
        for i in range(per_client):
            sent = time.monotonic()
            status, _, body = _complete(server, prompt=rng.choice(PROMPTS), n=rng.randint(1, 3), seed=c * 100 + i)
            done.append((sent, status, body))

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client, c) for c in range(clients)]
        for version in (21, 22):
            while len(done) < (version - 20) * clients * per_client // 3:
                time.sleep(0.01)
            trainer.sync(native_state(models[version]), version=version)
            published[version] = time.monotonic()
        for f in futures:
            f.result()

    assert len(done) == clients * per_client
    assert [s for _, s, _ in done if s != 200] == []
    versions = [b["weight_version"] for _, _, b in done]
    assert set(versions) == {20, 21, 22}  # both syncs landed while clients were waiting
    for sent, _, body in done:
        # A request sent after version v was published is never served by an older one.
        newest = max(v for v, t in published.items() if t <= sent) if sent >= published[20] else 20
        assert body["weight_version"] >= newest
    # Each response came from the weights of the version it names, not a mix.
    for v in (20, 22):
        body = next(b for _, _, b in done if b["weight_version"] == v)
        check = _as_rollouts(body, v)
        assert_serves(check, models[v], not_=[m for u, m in models.items() if u != v])


def _as_rollouts(body: dict, version: int):
    from torchtitan_rl.rollout.base import Rollouts

    c = body["choices"]
    return Rollouts([x["prompt_token_ids"] for x in c], [x["token_ids"] for x in c],
                    [x["logprobs"]["token_logprobs"] for x in c], version)


def _announce_big_body(cfg):
    """Headers announcing a 17 MiB body, no body: the server answers from Content-Length alone."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", cfg.serve.port, timeout=60)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Authorization", f"Bearer {API_KEY}")
    conn.putheader("Content-Length", str(17 << 20))
    conn.endheaders()
    resp = conn.getresponse()
    try:
        return resp.status, dict(resp.headers), json.loads(resp.read())
    finally:
        conn.close()


def _ensure_weights(cfg) -> None:
    if _get(cfg, "/health")["weight_version"] is None:  # run alone: give it weights to serve
        _connect(cfg).sync(native_state(trainer_model(seed=0)), version=1)


def test_bad_requests_get_4xx_with_a_reason_and_the_server_keeps_serving(server):
    _ensure_weights(server)
    cases = [
        (_announce_big_body(server), 413, "serve.max_body_mb"),
        (_request(server, "POST", "/v1/completions", raw=b'{"model": "torchtitan_rl", "prompt": [1,'), 400,
         "malformed JSON"),
        (_request(server, "POST", "/v1/completions",
                  raw=b'{"model": "torchtitan_rl", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), 400,
         "nested too deeply"),
        (_complete(server, prompt="1+2=" * 1000), 400, "characters exceed the context of 64 tokens"),
        (_request(server, "POST", "/v1/completions", {"model": "torchtitan_rl", "prompt": [1]}, token=""), 401,
         "serve.api_key"),
        (_request(server, "GET", "/v1/models", token="wrong"), 401, "serve.api_key"),
        (_complete(server, model="gpt-4"), 404, "model 'gpt-4' is not served"),
        (_complete(server, prompt=[1] * 70), 400, "exceed the context of 64 tokens"),
        (_complete(server, prompt=[1, 99]), 400, "outside the vocabulary"),
        (_complete(server, temperature=-1), 400, "temperature"),
        (_complete(server, temperature=3), 400, "temperature"),
        (_complete(server, stop_token_ids=[-1]), 400, "stop_token_ids"),
        (_complete(server, presence_penalty=0.5), 400, "presence_penalty"),
        (_complete(server, stop=[""]), 400, "stop"),
        (_complete(server, stream=True), 400, "stream"),
        (_complete(server, n=5000), 400, "serve.max_n"),
        (_request(server, "POST", "/v1/chat/completions", {"model": "torchtitan_rl", "messages": [
            {"role": "user", "content": "hi"}]}), 400, "no chat template"),
        (_request(server, "POST", "/control/connect", {"trainer_ranks": 1}), 401, "serve.token"),
        (_request(server, "POST", "/control/connect", {"trainer_ranks": 1}, token="wrong"), 401, "serve.token"),
        (_request(server, "POST", "/control/store", [1], token=TOKEN), 400, "a JSON object"),
        (_request(server, "POST", "/control/store", {"op": "get", "key": "x"}, token=TOKEN), 403,
         "not in a live sync session's keys"),
        # A body that says it is not JSON is not read as JSON (before: parsed anyway); curl -d says it is a form.
        (_request(server, "POST", "/v1/completions", {"model": "torchtitan_rl", "prompt": [1]},
                  content_type="text/plain"), 415, "'text/plain' is not JSON; send 'Content-Type: application/json'"),
        (_request(server, "POST", "/v1/completions", {"model": "torchtitan_rl", "prompt": [1]},
                  content_type="application/x-www-form-urlencoded"), 415, "-H 'Content-Type: application/json'"),
        (_request(server, "POST", "/control/connect", {}, token=TOKEN, content_type="text/plain"), 415,
         "is not JSON"),
        # A field the control endpoint does not take is refused, as the config refuses an unknown key (before:
        # ignored, and the connect replaced the running trainer).
        (_request(server, "POST", "/control/connect", {"takeover": True, "trainer_ranks": 1}, token=TOKEN), 422,
         "trainer_ranks: unknown field; /control/connect takes takeover"),
        (_request(server, "POST", "/control/store", {"op": "check", "keys": ["x"], "ttl": 1}, token=TOKEN), 422,
         "ttl: unknown field"),
    ]
    for (status, _, body), want, text in cases:
        assert status == want, (want, text, body)
        assert text in body["error"]["message"], (text, body)
    status, _, body = _complete(server)
    assert status == 200, body
    # Valid edge cases: a seed far past int64 once mixed per sample; top logprobs that top-k cut to -inf.
    status, _, body = _complete(server, seed=10**15, n=2)
    assert status == 200, body
    status, _, body = _complete(server, top_k=1, logprobs=2)
    assert status == 200 and min(body["choices"][0]["logprobs"]["top_logprobs"][0].values()) == -9999.0, body
    # No Content-Type at all: read as JSON (minimal clients send none).
    status, body = _post_without_content_type(server, "/v1/completions", {
        "model": "torchtitan_rl", "prompt": PROMPTS[0], "max_tokens": 2}, token=API_KEY)
    assert status == 200, body
    # RFC 7235: the scheme is case-insensitive (before: 'bearer' got 401).
    for scheme in ("bearer", "BEARER", "Bearer "):
        status, _, body = _request(server, "GET", "/v1/models", scheme=scheme)
        assert status == 200, (scheme, body)
    # Only the current session's trainer can end it.
    status, _, body = _request(server, "POST", "/control/disconnect", {"session": "not-the-current"}, token=TOKEN)
    assert status == 200 and body["ended"] is False, body
    assert _get(server, "/v1/models")["data"][0]["id"] == "torchtitan_rl"


def test_the_readmes_curl_example_is_answered(server):
    """README's curl line, as a user pastes it (its -H 'Content-Type: application/json': curl -d alone says
    application/x-www-form-urlencoded, which gets 415)."""
    _ensure_weights(server)
    line = next(line for line in (REPO / "README.md").read_text().splitlines()
                if line.startswith("curl ") and "/v1/completions" in line)
    args = shlex.split(line.replace("localhost:8000", f"127.0.0.1:{server.serve.port}"))
    out = subprocess.run([*args, "-H", f"Authorization: Bearer {API_KEY}"], capture_output=True, text=True,
                         timeout=60)
    body = json.loads(out.stdout)
    assert body.get("weight_version") is not None and body["choices"][0]["token_ids"], body


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net writes them) of the sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.rsplit(":", 1)
            if state == "0A" and int(port_hex, 16) == port:
                found.append(address)
    return found


def _process_listeners(pid: int) -> list[tuple[str, int]]:
    """(hex address as /proc/net writes it, port) of every TCP socket process ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and fields[9] in inodes:
                found.append((address, int(port_hex, 16)))
    return found


ATTACKER = "127.0.0.2"


def test_a_tokenless_peer_at_every_server_port_cannot_deny_or_fill_a_sync(server):
    """An attacker without the token tries a TCPStore client on every port the server process listens on and
    deletes every key it can list, parks 1 MiB values, and writes to the store's HTTP route: the sync lands."""
    from datetime import timedelta

    import torch.distributed as dist

    trainer = _connect(dataclasses.replace(server, weight_sync=dataclasses.replace(server.weight_sync,
                                                                                    peer_timeout_s=15.0)))
    models = {70: trainer_model(seed=70), 71: trainer_model(seed=71)}
    trainer.sync(native_state(models[70]), version=70)
    stores = []

    def dial(port: int) -> None:
        with contextlib.suppress(RuntimeError, ValueError):  # not a store: nothing there to list or delete
            stores.append(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2)))

    # In threads: a TCPStore client's handshake with a port that is not a store may never end.
    dials = [threading.Thread(target=dial, args=(port,), daemon=True) for _, port in _process_listeners(server.pid)]
    for t in dials:
        t.start()
    deadline = time.monotonic() + 5  # a store answers within its 2 s timeout; the rest may hang for good
    for t in dials:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    stop, refused, junk = threading.Event(), [], b"x" * (1 << 20)

    def attack():
        i = 0
        while not stop.is_set():
            for store in stores:
                with contextlib.suppress(RuntimeError):
                    for key in store.list_keys():
                        store.delete_key(key)
                    store.set(f"junk/{i % 64}", junk)
            # From an address of its own: the server logs a first rejection once per source and 30 s window,
            # and this module's earlier tests were refused from 127.0.0.1 (all of 127/8 is loopback on Linux).
            conn = http.client.HTTPConnection("127.0.0.1", server.serve.port, timeout=10,
                                              source_address=(ATTACKER, 0))
            conn.request("POST", "/control/store", body=json.dumps({"op": "set", "key": "junk", "value": ""}))
            refused.append(conn.getresponse().status)
            conn.close()
            i += 1

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    try:
        time.sleep(0.2)
        trainer.sync(native_state(models[71]), version=71)
    finally:
        stop.set()
        attacker.join()
    assert refused and set(refused) == {401}, set(refused)
    assert stores == []  # no port of the server answers as a store
    # Each refusal counted, one line said so (then one count per 30 s while they go on).
    assert _rejected(server, "requests without serve.token") >= len(refused)
    assert server.log.read_text().count(f"rejected POST /control/store from {ATTACKER}") == 1
    assert "Invalid HTTP request received" not in server.log.read_text()  # a TCPStore handshake: counted, not a line each
    status, _, body = _complete(server, n=4, max_tokens=8, seed=71)  # 32 tokens: a firm logprob check
    assert status == 200 and body["weight_version"] == 71, body
    assert_serves(_as_rollouts(body, 71), models[71], not_=[models[70]])


def test_the_sync_store_is_bounded_by_serve_sync_store_mb_and_dropped_two_sessions_later(server):
    from torchtitan_rl.rollout.server_http import HttpStore, ServerClient, ServerError

    trainer = _connect(server)
    store = HttpStore(ServerClient(f"http://127.0.0.1:{server.serve.port}", token=TOKEN), timeout_s=10)
    keys = f"torchtitan_rl/serve/{session_namespace(TOKEN, trainer.session)}/junk"
    with pytest.raises(ServerError, match=r"HTTP 413: .* over serve.sync_store_mb \(64 MiB\)"):
        for i in range(5):
            store.set(f"{keys}/{i}", b"x" * (15 << 20))
    assert store.check([f"{keys}/0"])
    _connect(server)
    _connect(server)  # two sessions later nobody may read its keys, and they are gone
    with pytest.raises(ServerError, match="HTTP 403"):
        store.check([f"{keys}/0"])


def test_every_listener_of_the_server_is_on_the_serve_host(server):
    """The HTTP port, vLLM's own process groups and the sync session's gloo pair: all on 127.0.0.1 (serve.host),
    none on the machine's other addresses (before: gloo and TCPStore listeners bound the hostname's address or
    every interface, and GLOO_SOCKET_IFNAME moved them to that interface)."""
    _connect(server).sync(native_state(trainer_model(seed=1)), version=1)  # a live session: its pair listens too
    listeners = _process_listeners(server.pid)
    assert (("0100007F", server.serve.port)) in listeners
    assert {address for address, _ in listeners} == {"0100007F"}, listeners


def _rejected(cfg, what: str) -> int:
    return _get(cfg, "/health")["rejected"].get(what, 0)


def test_a_forged_or_replayed_sync_header_is_rejected_and_changes_nothing(server):
    from torchtitan_rl.rollout.server_http import HttpStore, ServerClient, ServerError

    trainer = _connect(server)
    models = {40: trainer_model(seed=40), 41: trainer_model(seed=41)}
    trainer.sync(native_state(models[40]), version=40)
    # A token holder that writes without signing (a stale or buggy client), or replays the last header.
    store = HttpStore(ServerClient(f"http://127.0.0.1:{server.serve.port}", token=TOKEN), timeout_s=10)
    keys = f"torchtitan_rl/serve/{session_namespace(TOKEN, trainer.session)}/torchtitan_rl/weight_sync/weights"
    genuine = store.get(f"{keys}/header/1")
    with pytest.raises(ServerError, match="HTTP 403: key 'elsewhere' is not in a live sync session's keys"):
        store.set("elsewhere", "x")
    forged = json.dumps({"version": 999999, "moved": "1" * 64, "bucket_bytes": 1 << 20, "verify": "off",
                         "samples": 0})
    for value in (forged, genuine):  # written without a signature; the first sync's own header, replayed
        rejected = _rejected(server, "forged store messages")
        store.set(f"{keys}/header/2", value)
        deadline = time.monotonic() + 10
        while _rejected(server, "forged store messages") < rejected + 1:  # the server read it and refused it
            assert time.monotonic() < deadline, server.log.read_text()[-2000:]
            time.sleep(0.05)
        status, _, body = _complete(server, timeout=20)  # not paused by a sync that never comes
        assert status == 200 and body["weight_version"] == 40, body
        assert _get(server, "/health")["weight_version"] == 40
    # A flood of distinct forgeries adds to the count, not to the log (before: one line each).
    lines, rejected = server.log.read_text().count("rejected a store message"), _rejected(server, "forged store messages")
    for i in range(200):
        store.set(f"{keys}/header/2", json.dumps({"version": 1000 + i}))
        time.sleep(0.002)
    assert _rejected(server, "forged store messages") > rejected + 20
    assert server.log.read_text().count("rejected a store message") == lines == 1, server.log.read_text()[-3000:]
    assert "sync -> version 999999" not in server.log.read_text()
    # The trainer's own next sync overwrites the forgery and lands.
    trainer.sync(native_state(models[41]), version=41)
    status, _, body = _complete(server, n=2)
    assert status == 200 and body["weight_version"] == 41 and body["weight_session"] == trainer.session, body
    assert_serves(_as_rollouts(body, 41), models[41], not_=[models[40]])


def test_a_state_dict_missing_a_frozen_key_is_named_not_blamed_on_the_server(server):
    model = trainer_model(seed=63)
    state = native_state(model)
    trainer = _connect(server, reference=state)
    trainer.sync(state, version=63)  # the rope caches move once; later syncs skip them while untouched
    state.pop("layers.0.attention.rope.cache")
    with pytest.raises(ValueError, match=r"weight_sync: state dict missing \['layers.0.attention.rope.cache'\]"):
        trainer.sync(state, version=64)
    assert _get(server, "/health")["weight_version"] == 63


def test_a_15_mb_prompt_is_refused_while_health_answers_within_100_ms(server):
    _ensure_weights(server)
    replies, latencies = [], []
    raw = json.dumps({"model": "torchtitan_rl", "prompt": "1+2=" * (15_000_000 // 4)}).encode()
    big = threading.Thread(target=lambda: replies.append(_request(server, "POST", "/v1/completions", raw=raw)))
    big.start()
    while big.is_alive() or not latencies:
        started = time.perf_counter()
        _get(server, "/health")
        latencies.append(time.perf_counter() - started)
    big.join()
    assert max(latencies) < 0.1, latencies
    status, _, body = replies[0]
    assert status == 400 and "characters exceed the context of 64 tokens" in body["error"]["message"], body


def test_a_client_that_hangs_up_mid_generation_has_its_samples_aborted(server):
    _ensure_weights(server)
    before = _get(server, "/health")
    body = {"model": "torchtitan_rl", "prompt": PROMPTS[0], "max_tokens": 50, "n": 2048, "seed": 5}
    with _hanging_up(server, body):
        _health_until(server, lambda h: h["running"] > 0, timeout_s=30)
    health = _health_until(server, lambda h: h["running"] == 0, timeout_s=10)
    assert health["aborted"] > before["aborted"], health
    status, _, reply = _complete(server)  # the engine loop lives on
    assert status == 200 and health["status"] == "ok", reply


def test_more_requests_than_serve_max_concurrent_requests_get_429_with_retry_after(server):
    _ensure_weights(server)
    clients = MAX_REQUESTS + 24
    start = threading.Barrier(clients)

    def client(c: int):
        start.wait()
        return _complete(server, n=16, max_tokens=40, seed=c)

    with ThreadPoolExecutor(clients) as pool:
        replies = list(pool.map(client, range(clients)))
    limited = [(h, b) for status, h, b in replies if status == 429]
    assert limited and len(limited) <= clients - MAX_REQUESTS, [r[0] for r in replies]
    assert all(h["retry-after"] == "1" and "serve.max_concurrent_requests" in b["error"]["message"]
               for h, b in limited)
    assert {status for status, _, _ in replies} == {200, 429}


def _response(sock: socket.socket, *, timeout_s: float) -> str:
    """One HTTP response read from a raw socket: status line, headers and a Content-Length body."""
    sock.settimeout(timeout_s)
    raw = b""
    while b"\r\n\r\n" not in raw:
        chunk = sock.recv(4096)
        assert chunk, raw
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        chunk = sock.recv(4096)
        assert chunk, raw
        body += chunk
    return (head + b"\r\n\r\n" + body).decode()


def test_slow_uploads_from_one_address_are_capped_and_cut_off_while_other_clients_are_served(server):
    """PER_CLIENT + 20 uploads from 127.0.0.2 that announce a body and never finish it, and 20 connections that
    never finish their headers (before: 1,100 such uploads held every serve.max_concurrent_requests slot and
    every other client got 429)."""
    _ensure_weights(server)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Length: 1000\r\n\r\n{{").encode()
    uploads, headers = [], []
    try:
        for _ in range(PER_CLIENT + 20):
            sock = socket.create_connection(("127.0.0.1", server.serve.port), source_address=("127.0.0.2", 0))
            sock.sendall(head)
            uploads.append(sock)
        for _ in range(20):
            sock = socket.create_connection(("127.0.0.1", server.serve.port), source_address=("127.0.0.2", 0))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            headers.append(sock)
        started = time.monotonic()
        status, _, body = _complete(server, timeout=30)  # another client, meanwhile
        assert status == 200, body
        assert time.monotonic() - started < READ_TIMEOUT_S  # served at once, not after the slow ones were cut
        answers = [_response(sock, timeout_s=READ_TIMEOUT_S + 10) for sock in uploads]
        assert sum(a.startswith("HTTP/1.1 429") and "serve.max_requests_per_client" in a for a in answers) == 20
        assert sum(a.startswith("HTTP/1.1 408") and "serve.read_timeout_s" in a for a in answers) == PER_CLIENT
        for sock in headers:  # closed without a word: no request ever began
            sock.settimeout(READ_TIMEOUT_S + 10)
            assert sock.recv(4096) == b""
        assert time.monotonic() - started < READ_TIMEOUT_S + 10
    finally:
        for sock in uploads + headers:
            sock.close()
    log = server.log.read_text()
    assert log.count("from 127.0.0.2 that sent no complete request headers") == 1, log[-2000:]


def test_a_second_trainer_replaces_the_first_which_is_told_so_in_one_line(server):
    from torchtitan_rl.rollout.server_http import ServerGone

    first = _connect(server)
    first.sync(native_state(trainer_model(seed=50)), version=50)
    # Without serve.takeover a second trainer is refused, in one line, and the first keeps its session; an empty
    # body (curl -X POST) asks for no takeover either (before: both replaced the running trainer).
    polite = dataclasses.replace(server, serve=dataclasses.replace(server.serve, takeover=False))
    with pytest.raises(ServerGone, match=r"a trainer is connected \(session [0-9a-f]{8}, since [0-9:]{8}\); connect "
                                         r'with \{"takeover": true\} to replace it \(the trainer\'s serve.takeover\)'):
        _connect(polite)
    status, _, body = _request(server, "POST", "/control/connect", raw=b"", token=TOKEN)
    assert status == 409 and body["error"]["type"] == "conflict", body
    first.sync(native_state(trainer_model(seed=52)), version=52)  # still its session
    status, _, body = _request(server, "POST", "/control/connect", {"takeover": "yes"}, token=TOKEN)
    assert status == 400 and body["error"]["param"] == "takeover", body
    second = _connect(server)  # serve.takeover: replaces it
    second.sync(native_state(trainer_model(seed=0)), version=0)  # a new run restarts its versions
    status, headers, body = _complete(server)
    assert (body["weight_version"], body["weight_session"]) == (0, second.session), body
    assert headers["x-weight-session"] == second.session
    with pytest.raises(ServerGone, match="this trainer was replaced: another trainer connected") as e:
        first.sync(native_state(trainer_model(seed=51)), version=51)
    assert "\n" not in str(e.value) and f"http://127.0.0.1:{server.serve.port}" in str(e.value)
    with pytest.raises(ServerGone, match="replaced"):
        first.rollouts(PROMPTS[:1])
    assert second.rollouts(PROMPTS[:1]).weight_version == 0


def _worker(cfg, *args: str) -> subprocess.Popen:
    """tests/serving/server_trainer_worker.py against the server of ``cfg``, its output piped."""
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("server_trainer_worker.py")), str(cfg.serve.port), TOKEN,
         API_KEY, *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _until_line(proc: subprocess.Popen, line: str) -> None:
    """Read the worker's stdout until ``line``."""
    for out in proc.stdout:
        if out.strip() == line:
            return
    pytest.fail(f"the worker ended before it said {line!r}: exit {proc.wait()}: {proc.stderr.read()[-2000:]}")


@pytest.mark.slow
def test_a_killed_trainer_is_replaced_without_takeover_once_its_lease_runs_out_and_a_live_one_is_kept(server):
    """Before: after kill -9 of the trainer, every new trainer got 409 until it passed serve.takeover."""
    from torchtitan_rl.rollout.server_http import ServerGone

    polite = dataclasses.replace(server, serve=dataclasses.replace(server.serve, takeover=False))
    worker = _worker(server, "0", "live")  # connects, syncs version 30, then "trains" for an hour
    try:
        _until_line(worker, "training")
        time.sleep(2 * LEASE_S)  # a long train step: only its heartbeat renews the lease
        started = time.monotonic()
        with pytest.raises(ServerGone, match=r"a trainer is connected \(session [0-9a-f]{8}, since [0-9:]{8}\); "
                                             r"connect with .*; or stop that trainer first") as refused:
            _connect(polite)  # waits once for the lease, which the live trainer renews: then one line
        assert time.monotonic() - started < LEASE_S + 3
        status, _, body = _complete(server)
        assert status == 200 and body["weight_version"] == 30, body  # still the live trainer's weights
        worker.kill()  # kill -9: no disconnect, no goodbye
        worker.wait(timeout=30)
        trainer = _connect(polite)  # no serve.takeover: it waits out the dead trainer's lease by itself
        trainer.sync(native_state(trainer_model(seed=33)), version=33)
        status, _, body = _complete(server)
        assert status == 200 and (body["weight_version"], body["weight_session"]) == (33, trainer.session), body
        assert "(its lease ran out: no request for" in server.log.read_text()
        assert f"or after its lease runs out ({LEASE_S:g} s without a request from it, serve.session_lease_s)" in \
            str(refused.value) and "\n" not in str(refused.value)
    finally:
        worker.kill()
        worker.wait(timeout=30)


@pytest.mark.slow
def test_a_frozen_server_ends_the_trainer_within_peer_timeout_s_with_one_line(server):
    """The server stopped (SIGSTOP) in the middle of a sync: the trainer says so in one line within its
    weight_sync.peer_timeout_s and a few seconds, and exits (before: one peer_timeout_s per part, the gloo send,
    the session check, /health and the disconnect: 125 s at 60 s)."""
    timeout_s = 6.0
    ended = server.log.read_text().count("ended:")
    worker = _worker(server, "1", "stop-server", str(server.pid), str(timeout_s))
    said = []  # (seconds after the stop, line) of the worker's stderr

    def read_stderr() -> None:
        for line in worker.stderr:
            said.append((time.monotonic() - stopped, line.rstrip("\n")))

    try:
        _until_line(worker, "server stopped")
        stopped = time.monotonic()
        reader = threading.Thread(target=read_stderr, daemon=True)
        reader.start()
        rc = worker.wait(timeout=4 * timeout_s + 60)
        exited = time.monotonic() - stopped
        reader.join(timeout=10)
    finally:
        os.kill(server.pid, signal.SIGCONT)
        worker.kill()
        worker.wait(timeout=30)
    lines = [(t, line) for t, line in said if line.strip()]
    assert rc == 2 and len(lines) == 1 and not any("Traceback" in line for _, line in said), (rc, said[-20:])
    took, line = lines[0]
    # The deadline runs from the sync's start, before the stop; then a 2 s probe of /health. The process's own
    # teardown (torch, gloo) takes seconds more on a loaded 2-core machine.
    assert took < timeout_s + 5, (took, line)
    assert exited < timeout_s + 20, exited
    assert line.startswith(f"torchtitan_rl: error: rollout server http://127.0.0.1:{server.serve.port}: the sync "
                           f"of version 31 did not finish within weight_sync.peer_timeout_s ({timeout_s:g} s)"), line
    assert line.endswith("it does not answer (stopped?)"), line
    deadline = time.monotonic() + SYNC_TIMEOUT_S + 30  # the server, running again, ends that sync and serves on
    while server.log.read_text().count("ended:") < ended + 1:
        assert time.monotonic() < deadline, server.log.read_text()[-2000:]
        time.sleep(0.1)
    trainer = _connect(server)
    trainer.sync(native_state(trainer_model(seed=34)), version=34)
    status, _, body = _complete(server)
    assert status == 200 and body["weight_version"] == 34, body


@pytest.mark.slow
def test_a_trainer_stalled_mid_sync_is_dropped_then_killed_and_a_new_trainer_syncs(server):
    """The worker syncs version 30, then stops itself (SIGSTOP) after one broadcast of the next sync, as a hung
    trainer or a dead link would: the server drops that sync after serve.sync_timeout_s and serves on."""
    ended = server.log.read_text().count("ended:")
    worker = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("server_trainer_worker.py")), str(server.serve.port),
         TOKEN, API_KEY, "1", "stop"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        for line in worker.stdout:  # its sync is in flight, one bucket sent
            if line.strip() == "stalling":
                break
        else:
            pytest.fail(f"the worker ended before it stalled: exit {worker.wait()}")
        started = time.monotonic()
        # A request while the sync hangs: answered within the sync timeout (503) or right after it (200).
        status, _, body = _complete(server, timeout=SYNC_TIMEOUT_S + 20)
        assert time.monotonic() - started < SYNC_TIMEOUT_S + 10
        assert (status, body.get("weight_version")) == (200, 30) or status == 503, body
        deadline = time.monotonic() + SYNC_TIMEOUT_S + 10
        while server.log.read_text().count("ended:") < ended + 1:
            assert time.monotonic() < deadline, server.log.read_text()[-2000:]
            time.sleep(0.1)
        assert "still serving version 30" in server.log.read_text()
        status, _, body = _complete(server)
        assert status == 200 and body["weight_version"] == 30, body  # nothing had been written
        trainer = _connect(server)  # a new trainer, the old one still hanging
        trainer.sync(native_state(trainer_model(seed=32)), version=32)
        status, _, body = _complete(server)
        assert status == 200 and body["weight_version"] == 32, body
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)


@pytest.mark.slow
def test_grpo_loop_learns_through_the_server(server):
    from torchtitan_rl import simple_grpo

    cfg = _config(server.serve.port, Path(server.job.output_dir))
    cfg.trainer.steps = 40
    history = simple_grpo.train(cfg)
    assert [r["weight_version"] for r in history] == list(range(40))
    first = sum(r["reward_mean"] for r in history[:5]) / 5
    last = sum(r["reward_mean"] for r in history[-5:]) / 5
    # The same thresholds as the in-process run (tests/test_simple_grpo.py): same step body, same numbers.
    assert first < 0.15 and last > 0.3 and last > first + 0.2, (first, last)


@pytest.mark.slow  # five steps of a whole run: ~8 s, out of the quick loop
def test_asynchronous_loop_through_the_server_samples_each_batch_one_version_behind(server):
    from torchtitan_rl import simple_grpo

    cfg = _config(server.serve.port, Path(server.job.output_dir) / "async")
    cfg.trainer.steps, cfg.grpo.max_staleness, cfg.grpo.importance_correction = 5, 1, "truncate"
    history = simple_grpo.train(cfg)
    assert [r["weight_version"] for r in history] == [0, 0, 1, 2, 3]
    assert [r["staleness"] for r in history] == [0, 1, 1, 1, 1]


@pytest.mark.slow
@pytest.mark.parametrize("die_after, serves", [(1, "previous"), (5, "nothing")])
def test_a_trainer_killed_mid_sync_leaves_the_previous_version_or_nothing_never_a_mix(server, die_after, serves):
    """The worker syncs version 30, then dies after ``die_after`` broadcasts of the next sync: after 1 the
    server had written nothing (two buckets are sent before the verdict), after 5 it had unpacked some."""
    ended = server.log.read_text().count("ended:")
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("server_trainer_worker.py")), str(server.serve.port),
         TOKEN, API_KEY, str(die_after)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr  # its deliberate exit mid-sync
    deadline = time.monotonic() + 60
    while server.log.read_text().count("ended:") < ended + 1:  # the server noticed the dead peer
        assert time.monotonic() < deadline, server.log.read_text()[-2000:]
        time.sleep(0.1)
    status, _, body = _complete(server)
    if serves == "previous":
        assert _get(server, "/health")["weight_version"] == 30
        assert status == 200 and body["weight_version"] == 30, body
    else:
        assert _get(server, "/health")["weight_version"] is None
        assert status == 503, body
    # A new trainer brings it back.
    trainer = _connect(server)
    trainer.sync(native_state(trainer_model(seed=5)), version=31)
    status, _, body = _complete(server)
    assert status == 200 and body["weight_version"] == 31, body


@pytest.mark.slow
def test_a_server_killed_under_its_trainer_is_named_in_one_line(tmp_path):
    from torchtitan_rl.rollout.server_http import ServerGone

    with _server_process(tmp_path) as (cfg, proc):
        trainer = _connect(cfg)
        trainer.sync(native_state(trainer_model(seed=0)), version=1)
        proc.kill()  # kill -9
        proc.wait(timeout=30)
        url = f"http://127.0.0.1:{cfg.serve.port}"
        with pytest.raises(ServerGone) as e:
            trainer.sync(native_state(trainer_model(seed=1)), version=2)
        assert f"rollout server {url}: the sync of version 2 failed" in str(e.value), e.value
        assert "it does not answer" in str(e.value) and "\n" not in str(e.value)
        with pytest.raises(ServerGone, match=f"rollout server {url}: no answer to POST /v1/completions"):
            trainer.rollouts(PROMPTS[:1])


def _self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (PEM files ``name``.crt, ``name``.key)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"torchtitan_rl test {name}")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.mark.slow
def test_over_https_an_untrusting_trainer_is_refused_in_one_line_and_a_trusting_one_trains(tmp_path):
    """serve.ssl_certfile/ssl_keyfile: the server speaks TLS only; the trainer verifies its certificate against
    serve.ssl_cafile (before: the token travelled in clear, and neither side had a TLS option)."""
    from tests.helpers import assert_one_line_error, run_cli
    from torchtitan_rl import simple_grpo
    from torchtitan_rl.rollout.server_http import ServerClient

    cert, key = _self_signed(tmp_path, "server")
    other, _ = _self_signed(tmp_path, "other")
    with _server_process(tmp_path, cert=cert, key=key) as (cfg, _):
        url = f"https://127.0.0.1:{cfg.serve.port}"
        assert f"torchtitan_rl serve: {url} " in cfg.log.read_text()
        assert "travel in clear" not in cfg.log.read_text()
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # no plain-HTTP door: no token in clear
            urllib.request.urlopen(f"http://127.0.0.1:{cfg.serve.port}/health", timeout=10)
        for trusted in ("", str(other)):  # the system's CAs, or another certificate
            started = time.monotonic()
            proc = run_cli("--config", str(CPU_TINY), "--job.output_dir", str(tmp_path / "refused"),
                           "--weight_sync.transport", "server", "--serve.port", str(cfg.serve.port),
                           "--serve.token", TOKEN, "--serve.api_key", API_KEY, "--serve.ssl_certfile", str(cert),
                           "--serve.ssl_cafile", trusted, "--weight_sync.peer_timeout_s", "60")
            assert_one_line_error(proc, f"rollout server {url}: its TLS certificate failed verification",
                                  "set serve.ssl_cafile", prefix="torchtitan_rl: error: ")
            assert time.monotonic() - started < 50  # refused at once, not after waiting peer_timeout_s
        cfg.trainer.steps = 2  # trusts the server's own certificate (serve.ssl_cafile): trains
        history = simple_grpo.train(cfg)
        assert [r["weight_version"] for r in history] == [0, 1]
        assert ServerClient(url, tls=ssl.create_default_context(cafile=str(cert))).request(
            "GET", "/health")["syncs"] == 2


def test_a_server_beyond_loopback_over_plain_http_says_so_at_start_in_one_line(tmp_path):
    """Before: nothing said that serve.token would cross the network in clear."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchtitan_rl.serve", "--config", str(CPU_TINY), "--job.output_dir", str(tmp_path),
         "--serve.host", "0.0.0.0", "--serve.port", str(free_port())],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TORCHTITAN_RL_SERVE_TOKEN": TOKEN, "TORCHTITAN_RL_API_KEY": API_KEY},
    )
    lines = []

    def read() -> None:  # until the warning, or the line that says the server is up (then it said nothing)
        for line in proc.stdout:
            lines.append(line)
            if "travel in clear" in line or line.startswith("torchtitan_rl serve: http"):
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=300)
    proc.kill()
    proc.wait(timeout=30)
    said = [line for line in lines if "travel in clear" in line]
    assert len(said) == 1 and said[0].startswith("torchtitan_rl serve: warning: serve.host 0.0.0.0 is reachable beyond this "
                                       "machine over plain HTTP: serve.token and serve.api_key travel in clear; set "
                                       "serve.ssl_certfile and serve.ssl_keyfile"), said


@pytest.mark.slow  # a whole process's imports and start-up: 6-8 s, out of the quick loop
def test_a_gloo_socket_ifname_off_the_serve_host_is_one_line_and_exit_2(tmp_path, monkeypatch):
    """GLOO_SOCKET_IFNAME naming another interface than serve.host's would put vLLM's and the sync's gloo
    listeners there (before: 13 listeners on it while serve.host was 127.0.0.1): refused before the engine."""
    import psutil

    from tests.helpers import assert_one_line_error, run_module

    other = next((name for name, addrs in psutil.net_if_addrs().items()
                  if name != "lo" and any(a.family == socket.AF_INET for a in addrs)), None)
    if other is None:
        pytest.skip("needs a network interface besides loopback")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", other)
    proc = run_module("torchtitan_rl.serve", "--config", str(CPU_TINY), "--job.output_dir", str(tmp_path),
                      "--serve.token", TOKEN, "--serve.port", str(free_port()), timeout=120)
    assert_one_line_error(proc, f"serve.host: 127.0.0.1 is on interface lo, but GLOO_SOCKET_IFNAME={other} would put "
                          f"the server's gloo listeners on {other}", prefix="torchtitan_rl: error: ")
    assert not (tmp_path / "generator_model").exists()  # the engine was never built


def test_serve_without_a_token_is_one_line_and_exit_2():
    from tests.helpers import assert_one_line_error, run_module

    proc = run_module("torchtitan_rl.serve", "--config", str(CPU_TINY))
    assert_one_line_error(proc, "serve.token", prefix="torchtitan_rl: error: ")
    proc = run_module("torchtitan_rl.simple_grpo", "--config", str(CPU_TINY), "--weight_sync.transport", "server",
                      "--serve.token", "x", "--serve.max_n", "8")
    assert_one_line_error(proc, "serve.max_n")


@pytest.mark.slow
def test_a_busy_port_is_one_line_and_exit_2_before_the_engine_starts(tmp_path):
    from tests.helpers import assert_one_line_error, run_module

    with socket.create_server(("127.0.0.1", 0)) as taken:  # another process's listener
        port = taken.getsockname()[1]
        proc = run_module("torchtitan_rl.serve", "--config", str(CPU_TINY), "--job.output_dir", str(tmp_path),
                          "--serve.token", TOKEN, "--serve.port", str(port))
    assert_one_line_error(proc, f"serve.port: cannot listen on 127.0.0.1:{port}", prefix="torchtitan_rl: error: ")
    assert not (tmp_path / "generator_model").exists()  # the engine was never built


@pytest.mark.slow
def test_chat_completions_with_the_checkpoints_chat_template(smollm2_dir, tmp_path):
    """A standalone server on SmolLM2's own weights (generator.load_format auto: version 0, no trainer)."""
    from transformers import AutoTokenizer

    cfg = _config(free_port(), tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchtitan_rl.serve", "--config", str(REPO / "run_configs" / "smollm2_135m_math_cpu.toml"),
         "--model.hf_checkpoint", str(smollm2_dir), "--generator.load_format", "auto",
         "--job.output_dir", str(tmp_path), "--serve.port", str(cfg.serve.port),
         "--serve.token", TOKEN],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        from torchtitan_rl.rollout.server_http import ServerClient

        ServerClient(f"http://127.0.0.1:{cfg.serve.port}").wait_ready(180)
        messages = [{"role": "user", "content": "What is 2 + 3? Reply with the number only."}]
        status, headers, body = _request(cfg, "POST", "/v1/chat/completions", {
            "model": "torchtitan_rl", "messages": messages, "max_tokens": 12, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
        })
        assert status == 200, body
        choice = body["choices"][0]
        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert choice["prompt_token_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert choice["message"]["content"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
        assert "5" in choice["message"]["content"]
        assert [t["token"] for t in choice["logprobs"]["content"]] == tokenizer.convert_ids_to_tokens(choice["token_ids"])
        assert all(len(t["top_logprobs"]) == 2 for t in choice["logprobs"]["content"])
        assert body["weight_version"] == 0 and headers["x-weight-version"] == "0"  # the checkpoint's own weights
        # A stop string ends the text before it (vLLM detokenizes with the checkpoint's tokenizer).
        status, _, body = _complete(cfg, prompt="Count: 1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 6"])
        assert status == 200 and " 6" not in body["choices"][0]["text"], body
    finally:
        proc.terminate()
        proc.wait(timeout=30)
