"""The research options in the real loop (vLLM CPU engine, tiny trainer): resume, samples, signals."""

import json

import pytest

from tests.test_simple_grpo import _chat_config, _config, train

RESEARCH = dict(epochs=2, mini_batches=2, dynamic_sampling=True, dynamic_sampling_max_rounds=2,
                overlong="soft_penalty", overlong_buffer=2, entropy_coef=0.01, clip_eps_high=0.28,
                loss_aggregation="seq_mean_token_sum_norm")
# Not max_staleness: a run of fewer trainer.steps requests nothing past its last step, so the first half
# of a resumed pair would not prefetch what the uninterrupted run does (the async loop's own rule).


def _research(cfg):
    for name, value in RESEARCH.items():
        setattr(cfg.grpo, name, value)
    return cfg


@pytest.mark.slow
def test_resume_at_a_batch_boundary_is_exact_with_epochs_and_dynamic_sampling(tmp_path):
    a = train(_research(_config(tmp_path / "a", steps=4)))

    def config(steps):
        cfg = _research(_config(tmp_path / "b", steps=steps))
        cfg.trainer.checkpoint.enable, cfg.trainer.checkpoint.interval = True, 2
        return cfg

    train(config(2))
    resumed = config(4)
    resumed.resume = True
    b = train(resumed)

    assert [r["step"] for r in b] == [2, 3]
    keys = ("reward_mean", "loss", "grad_norm", "ratio_max", "clip_fraction", "entropy", "groups_dropped",
            "sampling_rounds", "completion_tokens")
    for key in keys:
        assert [r[key] for r in b] == [r[key] for r in a[2:]], key
    # The options acted: four optimizer steps per batch moved the ratio off 1 and the clip engaged;
    # groups without signal were dropped and replaced.
    assert all(r["optimizer_steps"] == 4 for r in a)
    assert max(r["ratio_max"] for r in a) > 1.05 and max(r["clip_fraction"] for r in a) > 0
    assert sum(r["groups_dropped"] for r in a) > 0 and max(r["sampling_rounds"] for r in a) >= 1


@pytest.mark.slow
def test_evaluation_samples_and_per_level_rewards_reach_jsonl_and_tensorboard(tmp_path, smollm2_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = _chat_config(tmp_path, smollm2_dir, steps=2, levels=(1, 3))
    cfg.eval.every_n_steps, cfg.metrics.samples_per_eval = 2, 3
    history = train(cfg)

    samples = [json.loads(line) for line in (tmp_path / "latest" / "samples.jsonl").read_text().splitlines()]
    # Before the first step and after the last, 3 completions each, with the weights that wrote them.
    assert [(s["step"], s["version"]) for s in samples] == [(0, 0)] * 3 + [(2, 2)] * 3
    assert all(s["prompt"] and isinstance(s["completion"], str) and s["reward"] == 0.0 for s in samples)
    events = EventAccumulator(str(tmp_path / "latest" / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert "samples/text_summary" in events.Tags()["tensors"]
    for r in history:
        assert {"reward_mean/level_1", "reward_mean/level_3", "entropy", "response_length_p90",
                "truncated_frac"} <= set(r)


@pytest.mark.slow
def test_overlong_mask_takes_exactly_the_cut_completions_out_of_the_loss(tmp_path):
    def one_step(name, overlong):
        cfg = _config(tmp_path / name, steps=1)
        cfg.generator.sampling.max_tokens = 2
        cfg.grpo.overlong = overlong
        return train(cfg)[0]

    off, masked = one_step("off", "off"), one_step("mask", "mask")
    B = 32 * 8  # cpu_tiny's prompts_per_step x group_size
    cut = round(off["truncated_frac"] * B)
    assert 0 < cut < B and masked["truncated_frac"] == off["truncated_frac"]  # the same samples
    assert masked["tokens"] == off["tokens"] - 2 * cut  # a cut completion has max_tokens = 2 tokens
