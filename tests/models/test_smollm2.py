"""The real SmolLM2-135M-Instruct (a Llama checkpoint) in the trainer and the generator, against transformers."""

import pytest
import torch

from tests.models.test_families import FP32_ATOL, make_trainer, shape_of
from torchtitan_rl.config import GeneratorConfig, ModelConfig, SamplingConfig, WeightSyncConfig
from torchtitan_rl.engine.engine import Engine
from torchtitan_rl.weight_sync.sync import WeightSync

# bf16 tolerance, relative to transformers' own bf16 forward of the same
# weights: both round the same fp32 weights and activations to bf16 (8
# mantissa bits) through 30 layers, in different orders, so neither is closer
# to the fp32 truth by construction. Measured against transformers' fp32
# logprobs, mean |error| trainer 0.047 / generator 0.049 vs transformers-bf16
# 0.052 / 0.059; max 0.25 / 0.25 vs 0.29 / 0.33. Ours may be at most 1.5x
# transformers' own bf16 error; a wrong weight or eps is orders larger.
BF16_VS_TRANSFORMERS = 1.5


def chat(folder) -> tuple[list[int], list[int]]:
    """A chat-formatted question, and the same with its answer appended (token ids)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(prompt)["input_ids"], tokenizer(prompt + "The capital of France is Paris.")["input_ids"]


def transformers_logprobs(folder, rows: list[list[int]], dtype) -> list[torch.Tensor]:
    """transformers' forward of each row: logprob of token t at position t (t >= 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    out = []
    with torch.no_grad():
        for row in rows:
            tokens = torch.tensor([row])
            logits = model(tokens).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None])[:, 0])
    return out


def errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    err = (got - want).abs()
    return err.mean().item(), err.max().item()


@pytest.mark.bf16_numerics
@pytest.mark.slow  # a whole run or engine in its own process: 7-12 s, out of the quick loop
def test_smollm2_trainer_and_generator_agree_with_transformers(smollm2_dir, tmp_path):
    prompt, answered = chat(smollm2_dir)

    trainer32 = make_trainer(smollm2_dir, tmp_path / "fp32")
    lp32 = trainer32.token_logprobs(torch.tensor([answered]), temperature=1.0)[0, 1:]
    del trainer32
    (hf32,) = transformers_logprobs(smollm2_dir, [answered], torch.float32)
    torch.testing.assert_close(lp32, hf32, atol=FP32_ATOL, rtol=0)  # fp32: measured 0.0 here too

    trainer = make_trainer(smollm2_dir, tmp_path / "bf16", dtype="bfloat16")
    gen = Engine(
        GeneratorConfig(max_model_len=128), model_config=ModelConfig(hf_checkpoint=str(smollm2_dir)),
        shape=shape_of(smollm2_dir), seed=0, device="cpu", workdir=tmp_path / "gen",
    )
    try:
        WeightSync(WeightSyncConfig(), reference=trainer.sync_state(), generator=gen).sync(
            trainer.sync_state(), version=1
        )
        rollouts = gen.generate([prompt], n=4, seed=0, sampling=SamplingConfig(max_tokens=12))
    finally:
        gen.close()

    rows = [answered] + [prompt + c for c in rollouts.completion_ids]
    truth = transformers_logprobs(smollm2_dir, rows, torch.float32)
    hf16 = transformers_logprobs(smollm2_dir, rows, torch.bfloat16)
    n = len(prompt) - 1  # completion tokens start at logprob index len(prompt) - 1
    trainer_lp = trainer.token_logprobs(torch.tensor([answered]), temperature=1.0)[0, 1:]
    gen_lp = torch.cat([torch.tensor(lp) for lp in rollouts.logprobs])
    checks = {
        "trainer": (trainer_lp, truth[0], hf16[0]),
        "generator": (gen_lp, torch.cat([t[n:] for t in truth[1:]]), torch.cat([t[n:] for t in hf16[1:]])),
    }
    for side, (ours, want, reference) in checks.items():
        (mean, peak), (ref_mean, ref_peak) = errors(ours, want), errors(reference, want)
        assert mean <= BF16_VS_TRANSFORMERS * ref_mean, (side, mean, ref_mean)
        assert peak <= BF16_VS_TRANSFORMERS * ref_peak, (side, peak, ref_peak)


@pytest.mark.slow
def test_one_grpo_step_on_the_math_task_then_export(smollm2_dir, tmp_path):
    """The README's real-model path on CPU, made small: chat-template prompts, math-verify reward,
    held-out evaluation before and after, the policy exported as a folder transformers loads."""
    import json

    from transformers import AutoConfig

    from tests.helpers import REPO
    from torchtitan_rl import simple_grpo
    from torchtitan_rl.config import load_toml

    cfg = load_toml(REPO / "run_configs" / "smollm2_135m_math_cpu.toml")
    cfg.model.hf_checkpoint = str(smollm2_dir)
    cfg.job.output_dir, cfg.job.export_dir = str(tmp_path / "run"), str(tmp_path / "hf")
    cfg.trainer.steps, cfg.grpo.prompts_per_step, cfg.grpo.group_size = 1, 2, 2
    cfg.generator.sampling.max_tokens = cfg.eval.max_tokens = 16
    cfg.eval.num_prompts = 2
    (record,) = simple_grpo.train(cfg)
    assert record["weight_version"] == 0 and record["tokens"] > 0
    assert record["mismatch_mean"] < 1e-4  # fp32 on both sides (the CPU config): summation order only, measured 6e-7
    evals = [json.loads(line) for line in (tmp_path / "run" / "latest" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if "eval_accuracy" in r] == [0, 1]  # before the step and after it
    exported = AutoConfig.from_pretrained(tmp_path / "hf")
    assert exported.architectures == ["LlamaForCausalLM"]
    assert (tmp_path / "hf" / "tokenizer.json").is_file() and (tmp_path / "hf" / "chat_template.jinja").is_file()
