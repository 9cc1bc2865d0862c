"""One run, one folder: the same command twice keeps both runs, --resume continues the newest from a checkpoint
that verifies, lists what the config changed and refuses what cannot change."""

import gc
import json
import os
import stat
from pathlib import Path

import pytest

from tests.helpers import assert_one_line_error, run_cli, run_module
from torchtitan_rl import simple_grpo
from torchtitan_rl.config import JobConfig, load_toml, write_toml
from torchtitan_rl.run.folder import publish
from torchtitan_rl.run.plan import check_changes, plan_run
from torchtitan_rl.trainer import checkpoint

CPU_TINY = Path(__file__).resolve().parents[1] / "run_configs" / "cpu_tiny.toml"


def _config(output_dir: Path, *, steps: int) -> JobConfig:
    cfg = load_toml(CPU_TINY)
    cfg.job.output_dir = str(output_dir)
    cfg.trainer.steps, cfg.grpo.prompts_per_step = steps, 8
    cfg.trainer.checkpoint.enable, cfg.trainer.checkpoint.interval, cfg.trainer.checkpoint.keep_latest = True, 2, 1
    return cfg


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_with_nothing_to_resume_is_one_line_and_exit_2(tmp_path):
    proc = run_cli("--config", str(CPU_TINY), "--job.output_dir", str(tmp_path / "typo"), "--resume")
    assert_one_line_error(proc, "--resume: nothing to resume", str(tmp_path / "typo"), "--resume-if-any",
                          prefix="torchtitan_rl: error: ")
    assert not (tmp_path / "typo").exists()


def test_each_new_run_gets_its_own_folder_and_resume_if_any_starts_one(tmp_path, capsys):
    cfg = _config(tmp_path, steps=4)
    publish(plan_run(cfg).folder)
    assert (tmp_path / "latest").resolve() == (tmp_path / "run-1").resolve()
    cfg.resume_if_any = True  # run-1 has no checkpoint: nothing to resume
    assert plan_run(cfg).folder == tmp_path / "run-2"
    assert (tmp_path / "latest").resolve() == (tmp_path / "run-1").resolve()  # until run-2 starts training
    assert "--resume-if-any: no checkpoint that verifies in" in capsys.readouterr().out


def test_resume_lists_changed_fields_and_refuses_what_cannot_change(capsys):
    saved = load_toml(CPU_TINY)
    new = load_toml(CPU_TINY)
    new.trainer.optimizer.lr, new.trainer.steps, new.resume = 1e-4, 120, True
    new.grpo.group_size = 4  # no rollouts queued (max_staleness 0): the batch shape may change
    check_changes(saved, new, since="step-20")
    assert capsys.readouterr().out.splitlines() == [
        "torchtitan_rl: resume: trainer.optimizer.lr 0.003 -> 0.0001 (changed since step-20)",
        "torchtitan_rl: resume: trainer.steps 80 -> 120 (changed since step-20)",
        "torchtitan_rl: resume: grpo.group_size 8 -> 4 (changed since step-20)",
    ]
    for path, value in (("model.flavor", "tiny-llama"), ("grpo.task", "digits:sort"), ("model.lora.rank", 8)):
        changed = load_toml(CPU_TINY)
        section, _, name = path.rpartition(".")
        obj = changed
        for part in section.split("."):
            obj = getattr(obj, part)
        setattr(obj, name, value)
        with pytest.raises(ValueError, match=rf"^{path}: cannot change on resume"):
            check_changes(saved, changed, since="step-20")
    saved.grpo.max_staleness = new.grpo.max_staleness = 1  # the checkpoint holds rollouts of 8 samples a prompt
    with pytest.raises(ValueError, match=r"^grpo.group_size: cannot change on resume \(the rollouts queued"):
        check_changes(saved, new, since="step-20")


def test_resume_neither_prints_nor_compares_the_secrets(tmp_path, capsys):
    saved = load_toml(CPU_TINY)
    saved.serve.token = "s3cret-token"
    write_toml(saved, tmp_path / "config.toml")  # as the run's config.toml: the token redacted
    new = load_toml(CPU_TINY)
    new.serve.token = "s3cret-token"  # from the CLI or TORCHTITAN_RL_SERVE_TOKEN on resume
    new.serve.api_key = "other-key"
    check_changes(load_toml(tmp_path / "config.toml"), new, since="step-4")
    assert capsys.readouterr().out == ""


def test_a_user_error_found_by_the_run_leaves_no_run_folder_and_latest_as_it_was(tmp_path):
    cfg = _config(tmp_path / "out", steps=4)
    publish(plan_run(cfg).folder)
    assert (tmp_path / "out" / "run-1").is_dir()
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "mine.txt").write_text("not to be mixed with an export")
    cfg.job.export_dir = str(tmp_path / "hf")
    with pytest.raises(ValueError, match="^export: .* exists and is not empty"):
        simple_grpo.train(cfg)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["latest", "run-1"]
    assert (tmp_path / "out" / "latest").resolve() == (tmp_path / "out" / "run-1").resolve()


def test_a_run_whose_engine_cannot_start_names_the_field_and_leaves_latest_on_the_previous_run(tmp_path):
    """A start that fails once its run folder exists (here vLLM refusing a KV cache too small for one sequence)
    keeps --resume on the run before it."""
    cfg = _config(tmp_path, steps=4)
    publish(plan_run(cfg).folder)
    cfg.generator.kv_cache_memory_gb = 1e-5
    with pytest.raises(ValueError, match=r"^generator\.kv_cache_memory_gb: too little memory for the engine's KV") as e:
        simple_grpo.train(cfg)
    gc.collect()
    assert (tmp_path / "run-2" / "config.toml").is_file()  # the failed start's own folder, kept for its config
    assert f"[this start left {tmp_path / 'run-2'} holding config.toml" in str(e.value)  # named in the one line
    assert str(e.value).endswith("; --resume stays on run-1]")
    assert (tmp_path / "latest").resolve() == (tmp_path / "run-1").resolve()


def test_a_model_folder_without_weights_is_refused_before_a_run_folder_exists(tmp_path, tiny_hf_checkpoint):
    folder = tmp_path / "tokenizer_only"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_hf_checkpoint("qwen3") / "config.json").read_text())
    cfg = _config(tmp_path / "out", steps=4)
    cfg.model.hf_checkpoint, cfg.grpo.task = str(folder), "digits"
    with pytest.raises(ValueError, match=rf"^model.hf_checkpoint: no \*.safetensors files in {folder}"):
        simple_grpo.train(cfg)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_same_command_twice_keeps_both_runs_and_resume_continues_the_newest(tmp_path, capsys):
    for _ in range(2):
        simple_grpo.train(_config(tmp_path, steps=4))
        gc.collect()
    run1, run2 = tmp_path / "run-1", tmp_path / "run-2"
    assert (tmp_path / "latest").resolve() == run2.resolve()
    before = (run1 / "metrics.jsonl").read_text()
    for run in (run1, run2):  # keep_latest 1: each run keeps its own step-4, whatever the other did
        assert _steps(run) == [0, 1, 2, 3]
        assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-4"]
    capsys.readouterr()

    resumed = _config(tmp_path, steps=6)
    resumed.resume, resumed.trainer.optimizer.lr = True, 1e-4
    records = simple_grpo.train(resumed)
    gc.collect()
    out = capsys.readouterr().out
    assert "torchtitan_rl: resume: trainer.optimizer.lr 0.003 -> 0.0001 (changed since step-4)" in out
    assert f"resuming {run2.resolve()} from step-4" in out
    assert "steps 0..5 (resumed at 4)" in out  # the summary covers the whole run (steps 0 to 5)
    assert [(r["step"], r["lr"]) for r in records] == [(4, 1e-4), (5, 1e-4)]  # the new lr, not the saved one
    assert _steps(run2) == list(range(6))
    assert (run1 / "metrics.jsonl").read_text() == before
    assert checkpoint.verify(run1 / "checkpoints" / "step-4") is None

    # export follows latest to run-2's newest checkpoint; its files are readable like the rest of the folder
    proc = run_module("torchtitan_rl.export", "--run-dir", str(tmp_path), "--out", str(tmp_path / "hf"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"exporting {run2.resolve() / 'checkpoints' / 'step-6'}" in proc.stderr
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir()}
    assert modes and set(modes.values()) == {0o666 & ~umask}, modes


def _finished_run(run: Path, cfg: JobConfig) -> None:
    """A run folder as a run of ``cfg`` leaves it at its end: config.toml and its final checkpoint (tiny trainer)."""
    import torch

    from torchtitan_rl.run.parts import run_shape, run_task
    from torchtitan_rl.trainer import Trainer

    trainer = Trainer(cfg.trainer, model_config=cfg.model, shape=run_shape(cfg, run_task(cfg)), seed=0,
                      device=torch.device("cpu"), output_dir=run)
    write_toml(cfg, run / "config.toml")
    trainer.save_checkpoint(cfg.trainer.steps, files={"config.toml": (run / "config.toml").read_text()})
    publish(run)


@pytest.mark.parametrize("staleness", [0, 2])
def test_extending_a_finished_async_run_says_its_new_steps_draw_other_rollouts(tmp_path, capsys, staleness):
    """An asynchronous run requests no rollouts past its last step; --resume with more steps draws them with
    newer weights than a longer run straight through would have: the resume line says so (sync runs: nothing)."""
    cfg = _config(tmp_path, steps=4)
    cfg.grpo.max_staleness = staleness
    (tmp_path / "run-1").mkdir(parents=True)
    _finished_run(tmp_path / "run-1", cfg)
    capsys.readouterr()
    cfg.trainer.steps, cfg.resume = 10, True
    plan_run(cfg)
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith(f"torchtitan_rl: resuming {tmp_path / 'run-1'} from step-4"), line
    if staleness:
        assert "never drew the rollouts of steps 4..5" in line and "differ from a 10-step run straight through" in line
    else:
        assert line == f"torchtitan_rl: resuming {tmp_path / 'run-1'} from step-4"
