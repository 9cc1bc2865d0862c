"""export.py: the policy as an HF folder that transformers and vLLM's own model classes load unmodified."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import REPO, run_module, tiny_shape
from tests.models.test_families import FP32_ATOL, TOKENS_BL, hf_logprobs, make_trainer, shape_of
from tests.trainer.helpers import make_batch
from torchtitan_rl import compat
from torchtitan_rl.config import GRPOConfig, JobConfig, LoRAConfig, write_toml
from torchtitan_rl.engine.engine import build_engine
from torchtitan_rl.export import export_hf
from torchtitan_rl.grpo.tasks.digits import DigitsTask, build_digits_tokenizer
from torchtitan_rl.models.moe import synced_state
from torchtitan_rl.models.shape import build_titan_model

FAMILIES = ["qwen3", "llama"]


def trained(folder, tmp_path, **model_fields):
    """A trainer on the folder's weights (fp32) after one optimizer step: weights unlike the folder's."""
    trainer = make_trainer(folder, tmp_path, **model_fields)
    trainer.train_step(make_batch(seed=0), temperature=1.0, grpo=GRPOConfig())
    return trainer


def vllm_native_prompt_logprobs(folder, tokens_BL: torch.Tensor) -> tuple[torch.Tensor, str]:
    """vLLM's own model class for the folder's architecture (load_format=auto, fp32, CPU): prompt logprobs."""
    from vllm import SamplingParams

    engine = build_engine(
        model=str(folder), load_format="auto", dtype="float32", max_model_len=64, max_num_seqs=8,
        enforce_eager=True, tensor_parallel_size=1, seed=0, device="cpu", gpu_memory_utilization=0.1,
        kv_cache_memory_bytes=64 << 20, batch_invariant=False,
    )
    try:
        model_cls = type(compat.vllm_model(engine))
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        for i, row in enumerate(tokens_BL.tolist()):
            engine.add_request(f"p{i}", {"prompt_token_ids": row}, params)
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out
    finally:
        engine.engine_core.shutdown()
    rows = []
    for i, row in enumerate(tokens_BL.tolist()):
        lps = outputs[f"p{i}"].prompt_logprobs  # None at position 0, then {token: Logprob}
        rows.append([0.0] + [lps[t][row[t]].logprob for t in range(1, len(row))])
    return torch.tensor(rows), f"{model_cls.__module__}.{model_cls.__name__}"


@pytest.mark.parametrize("family", FAMILIES)
def test_export_reloads_with_the_trainer_logprobs(family, tiny_hf_checkpoint, tmp_path):
    folder = tiny_hf_checkpoint(family)
    trainer = trained(folder, tmp_path)
    want = trainer.token_logprobs(TOKENS_BL, temperature=1.0)
    assert (want - hf_logprobs(folder, TOKENS_BL)).abs().max() > 1e-3  # the step moved the weights

    out = export_hf(trainer.sync_state(), shape=shape_of(folder), out_dir=tmp_path / "export",
                    tokenizer_dir=folder, dtype="float32", hf_checkpoint=folder)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [{"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[family]]
    assert config["model_type"] == family
    assert (out / "generation_config.json").is_file()
    # fp32 export, fp32 forwards: as tight as the trainer-vs-transformers check.
    torch.testing.assert_close(hf_logprobs(out, TOKENS_BL), want, atol=FP32_ATOL, rtol=0)

    got, model_cls = vllm_native_prompt_logprobs(out, TOKENS_BL)
    assert model_cls.startswith("vllm.model_executor.models."), model_cls  # vLLM's class, not ours
    # vLLM's native model on CPU, fp32: its own kernels (fused QKV/gate-up GEMMs,
    # its RMSNorm and attention ops) sum in other orders than the trainer's;
    # measured max 4.8e-6, so the trainer-vs-transformers bound holds here too.
    torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)


def test_lora_run_exports_merged_weights(tiny_hf_checkpoint, tmp_path):
    folder = tiny_hf_checkpoint("llama")
    lora = LoRAConfig(rank=2)
    trainer = trained(folder, tmp_path, lora=lora)
    want = trainer.token_logprobs(TOKENS_BL, temperature=1.0)
    assert (want - hf_logprobs(folder, TOKENS_BL)).abs().max() > 1e-3  # the adapter is visible

    out = export_hf(trainer.sync_state(), shape=shape_of(folder), out_dir=tmp_path / "export", lora=lora,
                    dtype="float32")
    assert not any("lora" in k for k in load_file(out / "model.safetensors"))
    # W + scale * B @ A in fp32 vs the unmerged forward: rounding only.
    torch.testing.assert_close(hf_logprobs(out, TOKENS_BL), want, atol=FP32_ATOL, rtol=0)


def test_non_empty_target_is_refused(tiny_hf_checkpoint, tmp_path):
    folder = tiny_hf_checkpoint("llama")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    model_state = {"x": torch.zeros(1)}
    with pytest.raises(ValueError, match="export: .*taken exists and is not empty"):
        export_hf(model_state, shape=shape_of(folder), out_dir=tmp_path / "taken")
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["notes.txt"]


@pytest.mark.slow  # a whole run or engine in its own process: 7-12 s, out of the quick loop
def test_command_exports_a_saved_checkpoint(tiny_hf_checkpoint, tmp_path):
    """python -m torchtitan_rl.export --run-dir: the same folder as exporting the live trainer (bf16)."""
    from torchtitan_rl.run.parts import run_shape, run_task
    from torchtitan_rl.trainer import Trainer

    folder = tiny_hf_checkpoint("llama")
    run_dir = tmp_path / "run"
    cfg = JobConfig()
    cfg.job.output_dir = str(run_dir)
    cfg.model.hf_checkpoint = str(folder)
    shape = run_shape(cfg, run_task(cfg))
    trainer = Trainer(cfg.trainer, model_config=cfg.model, shape=shape, seed=0, device=torch.device("cpu"),
                      output_dir=run_dir)
    trainer.train_step(make_batch(seed=0), temperature=1.0, grpo=GRPOConfig())
    trainer.save_checkpoint(1)
    write_toml(cfg, run_dir / "config.toml")
    live = export_hf(trainer.sync_state(), shape=shape, out_dir=tmp_path / "live", tokenizer_dir=folder,
                     hf_checkpoint=folder)

    proc = run_module("torchtitan_rl.export", "--run-dir", str(run_dir), "--out", str(tmp_path / "cli"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = load_file(tmp_path / "cli" / "model.safetensors"), load_file(live / "model.safetensors")
    assert got.keys() == want.keys() and all(got[k].dtype == torch.bfloat16 for k in got)
    assert all(torch.equal(got[k], want[k]) for k in got)
    assert (tmp_path / "cli" / "config.json").read_text() == (live / "config.json").read_text()

    proc = run_module("torchtitan_rl.export", "--run-dir", str(run_dir), "--step", "7", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"torchtitan_rl: error: export: --step 7: no complete checkpoint step-7 in {run_dir / 'checkpoints'} (have [1])"
    ]


def test_export_carries_the_checkpoint_tokenizer_and_chat_template(tiny_hf_checkpoint, smollm2_dir, tmp_path):
    """A checkpoint's tokenizer, chat template and generation config travel into the export."""
    from transformers import AutoTokenizer

    from torchtitan_rl.export import TOKENIZER_FILES
    from torchtitan_rl.models.shape import build_titan_model

    folder = tmp_path / "ckpt"  # the tiny Llama's weights with SmolLM2's tokenizer files
    shutil.copytree(tiny_hf_checkpoint("llama"), folder)
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, folder)
    shape = shape_of(folder)
    model = build_titan_model(shape, seed=0)
    out = export_hf(dict(model.named_parameters()), shape=shape, out_dir=tmp_path / "export", tokenizer_dir=folder,
                    hf_checkpoint=folder)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = AutoTokenizer.from_pretrained(smollm2_dir).apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    got = AutoTokenizer.from_pretrained(out).apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert got == want and "<|im_start|>assistant" in got
    assert (out / "generation_config.json").read_text() == (smollm2_dir / "generation_config.json").read_text()


def test_export_skips_a_damaged_checkpoint_and_writes_readable_files(tmp_path, capsys):
    """export --run-dir takes the newest checkpoint that verifies (one line per one it skips), refuses a damaged
    --step, and its files are readable like any new file (safetensors writes 0600)."""
    import os
    import stat

    from torchtitan_rl.export import export_checkpoint
    from torchtitan_rl.run.parts import run_shape, run_task
    from torchtitan_rl.trainer import Trainer

    run_dir = tmp_path / "run"
    cfg = JobConfig()  # the tiny Qwen3 on the digits vocabulary
    shape = run_shape(cfg, run_task(cfg))
    trainer = Trainer(cfg.trainer, model_config=cfg.model, shape=shape, seed=0, device=torch.device("cpu"),
                      output_dir=run_dir)
    write_toml(cfg, run_dir / "config.toml")
    for step in (1, 2):
        trainer.train_step(make_batch(seed=step), temperature=1.0, grpo=GRPOConfig())
        trainer.save_checkpoint(step)
        if step == 1:
            live = export_hf(trainer.sync_state(), shape=shape, out_dir=tmp_path / "live")
    shard = run_dir / "checkpoints" / "step-2" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    capsys.readouterr()

    export_checkpoint(run_dir, out=tmp_path / "newest")
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"torchtitan_rl: skipping checkpoint {run_dir / 'checkpoints' / 'step-2'}: __0_0.distcp has 100")
    assert err[1] == f"torchtitan_rl: exporting {run_dir / 'checkpoints' / 'step-1'}"
    got, want = load_file(tmp_path / "newest" / "model.safetensors"), load_file(live / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    with pytest.raises(ValueError, match=r"^export: --step 2: .*step-2 is damaged: __0_0.distcp has 100 bytes"):
        export_checkpoint(run_dir, out=tmp_path / "x", step=2)

    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "newest").iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes


class DeletingDigits(DigitsTask):
    """The digits task, whose first reward deletes the run's model folder (model.hf_checkpoint): moved mid-run."""

    def __init__(self, tokenizer_dir: str) -> None:
        super().__init__(mode="copy")
        self.source = tokenizer_dir

    def reward(self, prompt, completion_ids):
        if self.source is not None:
            shutil.rmtree(self.source)
            self.source = None
        return super().reward(prompt, completion_ids)


def deleting_digits(tokenizer_dir: str) -> DeletingDigits:
    return DeletingDigits(tokenizer_dir)


@pytest.mark.slow  # a real 2-step run (vLLM's start-up): ~20 s on 2 cores
def test_a_model_folder_deleted_mid_run_still_exports_its_tokenizer(tiny_hf_checkpoint, tmp_path):
    """The run's export_files/ (written at its start) gives the end-of-run export and a later export command the
    tokenizer, chat template and config of a model folder that no longer exists."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from torchtitan_rl import simple_grpo
    from torchtitan_rl.config import load_toml
    from torchtitan_rl.export import export_checkpoint

    source = tmp_path / "ckpt"  # the tiny Llama's weights with the digits tokenizer and a chat template
    shutil.copytree(tiny_hf_checkpoint("llama"), source)
    PreTrainedTokenizerFast(tokenizer_object=build_digits_tokenizer(), eos_token="<eos>",
                            pad_token="<pad>").save_pretrained(source)
    (source / "chat_template.jinja").write_text("{% for m in messages %}<bos>{{ m['content'] }}={% endfor %}")
    messages = [{"role": "user", "content": "123"}]
    want = AutoTokenizer.from_pretrained(source).apply_chat_template(messages, tokenize=False)
    generation_config = (source / "generation_config.json").read_text()
    cfg = load_toml(REPO / "run_configs" / "cpu_tiny.toml")
    cfg.job.output_dir, cfg.job.export, cfg.model.hf_checkpoint = str(tmp_path / "out"), True, str(source)
    cfg.grpo.task, cfg.grpo.prompts_per_step, cfg.trainer.steps = "tests.test_export:deleting_digits", 8, 2
    cfg.trainer.checkpoint.enable, cfg.trainer.checkpoint.interval = True, 2
    simple_grpo.train(cfg)
    assert not source.exists()

    run = tmp_path / "out" / "run-1"
    for out in (run / "hf", export_checkpoint(run, out=tmp_path / "later")):
        assert want == "<bos>123=" and AutoTokenizer.from_pretrained(out).apply_chat_template(
            messages, tokenize=False) == want
        assert (out / "generation_config.json").read_text() == generation_config
        assert AutoModelForCausalLM.from_pretrained(out).config.architectures == ["LlamaForCausalLM"]


def test_the_digits_task_exports_a_tokenizer_that_round_trips(tmp_path, capsys):
    """cpu_tiny (no model folder): the digits tokenizer is kept as an HF tokenizer; AutoTokenizer on the export
    gives the task's own token ids and texts back. An export without any tokenizer says so in one line."""
    import random

    from transformers import AutoTokenizer

    from torchtitan_rl.config import load_toml
    from torchtitan_rl.export import snapshot
    from torchtitan_rl.run.parts import run_shape, run_task
    from torchtitan_rl.models.shape import build_titan_model

    cfg = load_toml(REPO / "run_configs" / "cpu_tiny.toml")
    task = run_task(cfg)
    shape = run_shape(cfg, task)
    files = snapshot(tmp_path / "run", cfg=cfg, task=task, shape=shape)
    state = dict(build_titan_model(shape, seed=0).named_parameters())
    out = export_hf(state, shape=shape, out_dir=tmp_path / "hf", tokenizer_dir=files, hf_checkpoint=files)

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == task.vocab_size == shape.vocab_size
    for prompt in task.sample_prompts(5, generator=random.Random(0)):
        assert tokenizer(prompt.text, add_special_tokens=False)["input_ids"] == prompt.token_ids
        completion = prompt.target + [task.eos_id]
        assert tokenizer.decode(completion) == task.tokenizer.decode(completion, skip_special_tokens=False)
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (task.eos_id, task.pad_id)
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (task.eos_id, task.pad_id)

    capsys.readouterr()
    export_hf(state, shape=shape, out_dir=tmp_path / "bare")
    assert capsys.readouterr().out.splitlines() == [
        f"torchtitan_rl: export: {tmp_path / 'bare'} has no tokenizer (the run had none): transformers and vLLM "
        "load its weights only with a tokenizer folder given beside it"]


@pytest.mark.slow  # vLLM's LLM on the export (its own engine process): ~20 s on 2 shared cores
def test_the_cpu_tiny_export_chats_in_vllm_as_the_readme_shows(tmp_path):
    """README's `LLM(folder).chat(...)` on a cpu_tiny export: the digits tokenizer carries a chat template that
    renders a user message as the task's own prompt (<bos>123=) and an answer as its completion (111<eos>).
    Before, the export had no template and vLLM's chat() refused the folder."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from torchtitan_rl.config import load_toml
    from torchtitan_rl.export import snapshot
    from torchtitan_rl.models.shape import build_titan_model
    from torchtitan_rl.run.parts import run_shape, run_task

    cfg = load_toml(REPO / "run_configs" / "cpu_tiny.toml")
    task = run_task(cfg)
    shape = run_shape(cfg, task)
    files = snapshot(tmp_path / "run", cfg=cfg, task=task, shape=shape)
    out = export_hf(dict(build_titan_model(shape, seed=0).named_parameters()), shape=shape, out_dir=tmp_path / "hf",
                    tokenizer_dir=files, hf_checkpoint=files)
    prompt = task.make_prompt([1, 2, 3])
    turn = [{"role": "user", "content": "123"}, {"role": "assistant", "content": "111"}]
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.apply_chat_template(turn, tokenize=False) == "<bos>123=111<eos>"

    llm = LLM(str(out), kv_cache_memory_bytes=16 << 20, enforce_eager=True)
    (answer,) = llm.chat([turn[:1]], SamplingParams(max_tokens=4, temperature=0))
    assert answer.prompt_token_ids == prompt.token_ids
    assert len(answer.outputs[0].token_ids) >= 1


def test_a_random_model_on_another_checkpoints_tokenizer_exports_its_own_shape(smollm2_dir, tmp_path):
    """task.tokenizer lends the tiny random model SmolLM2's tokenizer: the export's config.json is the tiny
    model's (it used to be SmolLM2's, which no loader could fill from the tiny weights)."""
    from torchtitan_rl.run.parts import run_shape, run_task
    from torchtitan_rl.models.shape import build_titan_model

    cfg = JobConfig()
    cfg.grpo.task, cfg.task.tokenizer = "math", str(smollm2_dir)
    shape = run_shape(cfg, run_task(cfg))
    model = build_titan_model(shape, seed=0)
    out = export_hf(dict(model.named_parameters()), shape=shape, out_dir=tmp_path / "export",
                    tokenizer_dir=smollm2_dir, hf_checkpoint=cfg.model.hf_checkpoint)
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (shape.hidden_size, shape.num_hidden_layers)
    assert shape_of(out) == shape
    assert (out / "tokenizer.json").is_file()


@pytest.mark.slow  # a whole run or engine in its own process: 7-12 s, out of the quick loop
def test_moe_export_loads_in_native_vllm_as_qwen3_moe(tmp_path):
    """A Qwen3 MoE export runs in vLLM's own Qwen3MoeForCausalLM (its fused-MoE layer) as in transformers."""
    shape = tiny_shape("tiny-moe")
    model = build_titan_model(shape, seed=1)
    with torch.no_grad():  # experts 4x their init: at init they hardly move a logprob (tests/engine/test_moe.py)
        for name, p in model.named_parameters():
            if ".inner_experts." in name:
                p.mul_(4)
    out = export_hf(synced_state(model), shape=shape, out_dir=tmp_path / "export", dtype="float32")
    tokens_BL = torch.randint(0, shape.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    want = hf_logprobs(out, tokens_BL)

    # Its own process: vLLM keeps one set of groups per process, and a dense engine built earlier in this one
    # left out the expert-parallel group vLLM's own MoE layer asks for (a run builds one engine).
    torch.save(tokens_BL, tmp_path / "tokens.pt")
    proc = run_module("tests.test_export", str(out), str(tmp_path / "tokens.pt"), str(tmp_path / "got.pt"),
                      timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, model_cls = torch.load(tmp_path / "got.pt")
    assert model_cls == "vllm.model_executor.models.qwen3_moe.Qwen3MoeForCausalLM", model_cls
    torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)


if __name__ == "__main__":  # python -m tests.test_export FOLDER TOKENS OUT: vLLM's native prompt logprobs
    import sys

    folder, tokens, result = sys.argv[1:]
    torch.save(vllm_native_prompt_logprobs(folder, torch.load(tokens)), result)
