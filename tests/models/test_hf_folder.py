"""A damaged Hugging Face folder is one line naming the setting and the file, exit 2, before anything loads.

Each damage is made for real on a copy: config.json cut off mid-file, the
safetensors shard cut short, tokenizer files cut off, the folder missing.
"""

import shutil
from pathlib import Path

import pytest

from tests.helpers import assert_one_line_error, run_cli
from torchtitan_rl import simple_grpo

ERROR = "torchtitan_rl: error: "


def _cut(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


@pytest.fixture
def checkpoint(tiny_hf_checkpoint, tmp_path) -> Path:
    """A copy of the tiny Llama checkpoint (config.json, generation_config.json, model.safetensors)."""
    return Path(shutil.copytree(tiny_hf_checkpoint("llama"), tmp_path / "ckpt"))


@pytest.fixture
def tokenizer(smollm2_dir, tmp_path) -> Path:
    """SmolLM2's tokenizer files (no weights), copied."""
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, folder / name)
    return folder


def _run(tmp_path, capsys, *args) -> str:
    """simple_grpo's main as the CLI calls it, in this process (no interpreter start per case): its one line."""
    with pytest.raises(SystemExit) as exit:
        simple_grpo.main(["--job.device", "cpu", "--job.output_dir", str(tmp_path / "out"), *args])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(ERROR), err
    return err.strip()


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "model.safetensors"])
def test_cut_off_checkpoint_file_is_named(checkpoint, tmp_path, capsys, name):
    _cut(checkpoint / name)
    line = _run(tmp_path, capsys, "--model.hf_checkpoint", str(checkpoint), "--grpo.task", "digits")
    assert f"model.hf_checkpoint: {checkpoint / name}: " in line
    assert ("safetensors" if name.endswith(".safetensors") else "JSON") in line


def test_missing_checkpoint_folder_says_so(tmp_path):
    proc = run_cli("--model.hf_checkpoint", str(tmp_path / "nope"), "--grpo.task", "math")
    assert_one_line_error(proc, f"model.hf_checkpoint: folder not found: {tmp_path / 'nope'}", prefix=ERROR)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_cut_off_tokenizer_file_is_named(tokenizer, tmp_path, capsys, name):
    _cut(tokenizer / name)
    line = _run(tmp_path, capsys, "--task.tokenizer", str(tokenizer), "--grpo.task", "math")
    assert f"task.tokenizer: {tokenizer / name}: not valid JSON" in line


def test_missing_tokenizer_folder_says_so(tmp_path, capsys):
    line = _run(tmp_path, capsys, "--task.tokenizer", str(tmp_path / "nope"), "--grpo.task", "math")
    assert f"task.tokenizer: folder not found: {tmp_path / 'nope'}" in line


def test_loaders_name_the_damaged_file_when_called_directly(checkpoint):
    """Callers that skip the up-front check (export, scripts) get the file named too."""
    import torch

    from torchtitan_rl.models.families import resolve_shape
    from torchtitan_rl.trainer.hf_weights import load_hf_weights

    shape = resolve_shape(flavor="tiny", hf_checkpoint=str(checkpoint), vocab_size=0, max_seq_len=64)
    _cut(checkpoint / "model.safetensors")
    with pytest.raises(ValueError, match=f"model.hf_checkpoint: {checkpoint / 'model.safetensors'}: "):
        load_hf_weights(torch.nn.Module(), shape=shape, hf_dir=checkpoint)
    _cut(checkpoint / "config.json")
    with pytest.raises(ValueError, match=f"model.hf_checkpoint: {checkpoint / 'config.json'}: not valid JSON"):
        resolve_shape(flavor="tiny", hf_checkpoint=str(checkpoint), vocab_size=0, max_seq_len=64)
