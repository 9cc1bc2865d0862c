"""Engine.generate's per-iteration trace and the harness's drawn lengths, on a real engine with a tail."""

import tempfile

import pytest

from tests.helpers import PROMPTS, sync_model
from torchtitan_rl import compat
from torchtitan_rl.config import GeneratorConfig, HarnessLengthsConfig, ModelConfig, SamplingConfig
from torchtitan_rl.engine.engine import Engine
from torchtitan_rl.engine.lengths import response_length
from torchtitan_rl.models.families import resolve_shape
from torchtitan_rl.models.shape import build_titan_model
from torchtitan_rl.rollout.base import Rollouts, prompt_blocks

TAIL = HarnessLengthsConfig(distribution="lognormal", median=6, p90=24)
SAMPLING = SamplingConfig(max_tokens=48)


@pytest.fixture(scope="module")
def engine():
    """A tiny engine whose KV cache holds 16 blocks of 128 tokens: 16 short sequences at once, or 8 of 129-256."""
    shape = resolve_shape(flavor="tiny", hf_checkpoint=None, vocab_size=16, max_seq_len=512)
    config = GeneratorConfig(max_model_len=512, max_num_seqs=16, kv_cache_memory_gb=2048 * 512 / (1 << 30))
    e = Engine(config, model_config=ModelConfig(), shape=shape, seed=0, device="cpu", workdir=tempfile.mkdtemp())
    model = build_titan_model(shape, seed=1)
    sync_model(e, model, version=1)
    yield e
    e.close()


def test_kv_cache_capacity_is_read_from_the_engine(engine):
    assert compat.kv_cache_tokens(engine.engine) == 2048


def test_each_sample_runs_to_its_drawn_length_whatever_the_blocks(engine):
    whole = engine.generate(PROMPTS, n=4, seed=0, sampling=SAMPLING, stop_token_ids=[1], lengths=TAIL)
    drawn = [response_length(TAIL, cap=48, seed=0, prompt=p, sample=j) for p in range(3) for j in range(4)]
    # eos and the stop id ignored: the tiny model's 16-token vocabulary emits id 1 within a few tokens otherwise
    assert [len(c) for c in whole.completion_ids] == drawn and len(set(drawn)) > 3
    parts = [engine.generate(PROMPTS[a:b], n=4, seed=0, sampling=SAMPLING, stop_token_ids=[1], lengths=TAIL,
                             first_prompt=a) for a, b in prompt_blocks(len(PROMPTS), 2)]
    joined = Rollouts.concat(parts)
    assert [len(c) for c in joined.completion_ids] == drawn
    assert joined.trace.sequences == 12 and joined.trace.iterations == sum(p.trace.iterations for p in parts)
    # The blocks' step loops: the request waits for the slower one, whose wall the merge keeps.
    loops = [p.trace.wall_s for p in parts]
    assert [p.trace.slowest_s for p in parts] == loops and [p.trace.engine_balance for p in parts] == [1.0, 1.0]
    assert joined.trace.engines == 2 and joined.trace.slowest_s == max(loops)
    assert joined.trace.engine_balance == pytest.approx(sum(loops) / 2 / max(loops)) and joined.trace.engine_balance < 1


def test_the_trace_shows_the_tail_of_drawn_lengths_and_none_without_one(engine):
    tail = engine.generate(PROMPTS, n=4, seed=0, sampling=SAMPLING, lengths=TAIL).trace
    longest = max(response_length(TAIL, cap=48, seed=0, prompt=p, sample=j) for p in range(3) for j in range(4))
    # a step per token of the longest sample (+ the in-flight batch at the end)
    assert longest == 48 and longest <= tail.iterations <= longest + 3
    # lengths 1 2 3 5 7 8 10 12 23 23 23 48: from token 23 on, fewer than 3 of 12 run (the tail)
    assert 48 - 23 - 2 <= tail.tail_iterations <= 48 - 23 + 2 and 0 < tail.tail_s < tail.wall_s
    assert 0 < tail.batch_fill < 0.5 and tail.preemptions == 0
    even = engine.generate(PROMPTS, n=4, seed=0, sampling=SAMPLING,
                           lengths=HarnessLengthsConfig(distribution="lognormal", median=30, p90=31)).trace
    assert even.tail_iterations <= 3 and even.batch_fill > 0.7 > tail.batch_fill
    assert set(tail.metrics()) == {"gen_tail_share", "gen_tail_s", "gen_batch_fill", "gen_preemptions",
                                   "gen_iterations", "gen_tail_iterations", "gen_after_need_s",
                                   "gen_engine_balance", "gen_kv_read_gb",
                                   "gen_kv_read_tb_per_s", "gen_tail_kv_read_tb_per_s"}
    assert tail.metrics()["gen_tail_iterations"] == tail.tail_iterations
    assert tail.after_need_s == 0 == tail.after_need_iterations  # no partial request: no groups it needs


def test_the_kv_bytes_read_are_the_contexts_the_samples_decode_over(engine):
    shape = resolve_shape(flavor="tiny", hf_checkpoint=None, vocab_size=16, max_seq_len=512)
    assert engine.kv_token_bytes == shape.num_hidden_layers * 2 * shape.num_key_value_heads * shape.head_dim * 2
    r = engine.generate(PROMPTS, n=4, seed=0, sampling=SAMPLING, lengths=TAIL)
    samples = list(zip([p for p in PROMPTS for _ in range(4)], r.completion_ids))
    # token t of a sample attends over its prompt and the t tokens before it
    tokens = sum(len(p) * len(c) + len(c) * (len(c) - 1) // 2 for p, c in samples)
    # one step of slack a sample: vLLM counts a token's KV computed when it schedules it (async scheduling)
    slack = sum(len(p) + len(c) for p, c in samples)
    read = r.trace.kv_read_bytes / engine.kv_token_bytes
    assert abs(read - tokens) <= slack < tokens / 4, (read, tokens, slack)
    assert r.trace.kv_read_rate == r.trace.kv_read_bytes / r.trace.wall_s
    # The tail's part: the steps after all but the two longest samples finished (fewer than 3 of 12 unfinished)
    # read the two longest's contexts from the third's length on.
    by_length = sorted(samples, key=lambda s: len(s[1]), reverse=True)
    third = len(by_length[2][1])
    tail = sum(len(p) * (len(c) - third) + sum(range(third, len(c))) for p, c in by_length[:2])
    tail_read = r.trace.tail_kv_read_bytes / engine.kv_token_bytes
    assert 0 < tail and abs(tail_read - tail) <= sum(len(p) + len(c) for p, c in by_length[:2]), (tail_read, tail)
    assert r.trace.tail_kv_read_rate == r.trace.tail_kv_read_bytes / r.trace.tail_s


def test_preemptions_of_a_full_kv_cache_are_counted(engine):
    # 12 sequences of ~150 tokens need 2 blocks each, 24 > 16: vLLM preempts the newest to grow the others
    long = HarnessLengthsConfig(distribution="lognormal", median=150, p90=160)
    r = engine.generate(PROMPTS, n=4, seed=0, sampling=SamplingConfig(max_tokens=200), lengths=long)
    assert [len(c) for c in r.completion_ids] == [
        response_length(long, cap=200, seed=0, prompt=p, sample=j) for p in range(3) for j in range(4)]
    assert r.trace.preemptions >= 2
