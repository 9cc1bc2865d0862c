"""The rollout server as a user runs it: a real `python -m torchtitan_rl.serve` process on 127.0.0.1.

One server (run_configs/cpu_tiny.toml, real vLLM CPU engine) serves the whole
module; this process plays the trainer (ServerGenerator: the same client the
GRPO loop uses), and for the crash tests a trainer subprocess that dies in
the middle of a sync. The tests run in file order: the first one needs a
server that has not been synced yet.
"""

import json
import random
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

from tests.helpers import PROMPTS, REPO, assert_serves, free_port, make_generator, native_state, trainer_model
from torchtitan_rl.config import SamplingConfig, WeightSyncConfig, load_toml
from torchtitan_rl.weight_sync import WeightSync

CPU_TINY = REPO / "run_configs" / "cpu_tiny.toml"
TOKEN = "test-secret"
EOS = 2
"""<eos> of the digits tokenizer (run_configs/cpu_tiny.toml's task)."""
WAIT_S = 3.0
"""generator.wait_for_weights_s of the server: a request before the first sync waits this long, then 503.
Long enough for a sync of the tiny model to land inside it (tens of ms), short enough to wait out."""


def _config(port: int, sync_port: int, out: Path):
    cfg = load_toml(CPU_TINY)
    cfg.job.output_dir = str(out)
    cfg.serve.port, cfg.serve.sync_port, cfg.serve.token = port, sync_port, TOKEN
    cfg.weight_sync.transport = "server"
    cfg.weight_sync.peer_timeout_s = 60.0
    return cfg


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server process; yields its config (the trainer side reads the same serve section)."""
    out = tmp_path_factory.mktemp("serve")
    cfg = _config(free_port(), free_port(), out / "trainer")
    log = open(out / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchtitan_rl.serve", "--config", str(CPU_TINY), "--job.output_dir", str(out / "server"),
         "--serve.port", str(cfg.serve.port), "--serve.sync_port", str(cfg.serve.sync_port),
         "--serve.token", TOKEN, "--generator.wait_for_weights_s", str(WAIT_S),
         "--weight_sync.peer_timeout_s", "60"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )
    cfg.log = out / "server.log"
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
        yield cfg
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _request(cfg, method: str, path: str, body=None, *, raw: bytes | None = None, token: str | None = None):
    """(status, headers, JSON body) of one request; HTTP errors are returned, not raised."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(f"http://127.0.0.1:{cfg.serve.port}{path}", data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def _get(cfg, path: str) -> dict:
    status, _, body = _request(cfg, "GET", path)
    assert status == 200, body
    return body


def _complete(cfg, prompt=PROMPTS[0], **fields):
    return _request(cfg, "POST", "/v1/completions", {
        "model": "torchtitan_rl", "prompt": prompt, "max_tokens": 4, "logprobs": 0, "return_token_ids": True, **fields,
    })


def _connect(cfg):
    """A trainer connection from this process (a new session replaces the previous one)."""
    from torchtitan_rl.generator.server_client import ServerGenerator
    from torchtitan_rl.trainer.distributed import init_process_group

    init_process_group(torch.device("cpu"))  # the sender's collectives run on a one-rank trainer world
    return ServerGenerator(cfg, reference=native_state(trainer_model(seed=0)), device=torch.device("cpu"))


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
        WeightSync(WeightSyncConfig(), reference=native_state(model), generator=local).sync(
            native_state(model), version=7)
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
    from torchtitan_rl.generator.generator import Rollouts

    c = body["choices"]
    return Rollouts([x["prompt_token_ids"] for x in c], [x["token_ids"] for x in c],
                    [x["logprobs"]["token_logprobs"] for x in c], version)


def _announce_big_body(cfg):
    """Headers announcing a 17 MiB body, no body: the server answers from Content-Length alone."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", cfg.serve.port, timeout=60)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(17 << 20))
    conn.endheaders()
    resp = conn.getresponse()
    try:
        return resp.status, dict(resp.headers), json.loads(resp.read())
    finally:
        conn.close()


def test_bad_requests_get_4xx_with_a_reason_and_the_server_keeps_serving(server):
    if _get(server, "/health")["weight_version"] is None:  # run alone: give it weights to serve
        _connect(server).sync(native_state(trainer_model(seed=0)), version=1)
    cases = [
        (_announce_big_body(server), 413, "serve.max_body_mb"),
        (_request(server, "POST", "/v1/completions", raw=b'{"model": "torchtitan_rl", "prompt": [1,'), 400,
         "malformed JSON"),
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
        (_request(server, "POST", "/control/connect", {"trainer_ranks": 0}, token=TOKEN), 400, "trainer_ranks"),
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
    # Only the current session's trainer can end it.
    status, _, body = _request(server, "POST", "/control/disconnect", {"session": "not-the-current"}, token=TOKEN)
    assert status == 200 and body["ended"] is False, body
    assert _get(server, "/v1/models")["data"][0]["id"] == "torchtitan_rl"


@pytest.mark.slow
def test_grpo_loop_learns_through_the_server(server):
    from torchtitan_rl import simple_grpo

    cfg = _config(server.serve.port, server.serve.sync_port, Path(server.job.output_dir))
    cfg.trainer.steps = 40
    history = simple_grpo.run(cfg)
    assert [r["weight_version"] for r in history] == list(range(40))
    first = sum(r["reward_mean"] for r in history[:5]) / 5
    last = sum(r["reward_mean"] for r in history[-5:]) / 5
    # The same thresholds as the in-process run (tests/test_simple_grpo.py): same step body, same numbers.
    assert first < 0.15 and last > 0.3 and last > first + 0.2, (first, last)


def test_asynchronous_loop_through_the_server_samples_each_batch_one_version_behind(server):
    from torchtitan_rl import simple_grpo

    cfg = _config(server.serve.port, server.serve.sync_port, Path(server.job.output_dir) / "async")
    cfg.trainer.steps, cfg.grpo.max_staleness, cfg.grpo.importance_correction = 5, 1, "truncate"
    history = simple_grpo.run(cfg)
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
         str(server.serve.sync_port), TOKEN, str(die_after)],
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


def test_serve_without_a_token_is_one_line_and_exit_2():
    from tests.helpers import assert_one_line_error, run_module

    proc = run_module("torchtitan_rl.serve", "--config", str(CPU_TINY))
    assert_one_line_error(proc, "serve.token", prefix="torchtitan_rl: error: ")
    proc = run_module("torchtitan_rl.simple_grpo", "--config", str(CPU_TINY), "--weight_sync.transport", "server",
                      "--serve.token", "x", "--serve.max_n", "8")
    assert_one_line_error(proc, "serve.max_n")


@pytest.mark.slow
def test_chat_completions_with_the_checkpoints_chat_template(smollm2_dir, tmp_path):
    """A standalone server on SmolLM2's own weights (generator.load_format auto: version 0, no trainer)."""
    from transformers import AutoTokenizer

    cfg = _config(free_port(), free_port(), tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchtitan_rl.serve", "--config", str(REPO / "run_configs" / "smollm2_135m_math_cpu.toml"),
         "--model.hf_checkpoint", str(smollm2_dir), "--generator.load_format", "auto",
         "--job.output_dir", str(tmp_path), "--serve.port", str(cfg.serve.port),
         "--serve.sync_port", str(cfg.serve.sync_port), "--serve.token", TOKEN],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        from torchtitan_rl.generator.server_client import ServerClient

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
