"""Checkpoints: exact resume, atomic step-N folders, keep_latest pruning."""

import pickle

import torch
import torch.distributed.checkpoint as dcp

from torchtitan_rl.config.job_config import CheckpointConfig, GRPOConfig, LoRAConfig, ModelConfig
from torchtitan_rl.trainer import checkpoint

from .helpers import load_newest, make_batch

GRPO = GRPOConfig()


def _step(trainer, seed: int) -> dict[str, float]:
    return trainer.train_step(make_batch(seed=seed), temperature=1.0, grpo=GRPO)


def test_resume_is_bitwise_exact(make_trainer):
    extra = {"rng": torch.get_rng_state(), "prompt_index": 7}
    run = make_trainer(micro_batch_size=3, steps=6)
    for seed in (0, 1):
        _step(run, seed)
    path = run.save_checkpoint(2, extra=extra)
    uninterrupted = [_step(run, seed) for seed in (2, 3, 4)]

    resumed = make_trainer(micro_batch_size=3, steps=6, seed=99)  # seed is overwritten by the load
    loaded = load_newest(resumed)

    assert path.name == "step-2" and resumed.step == 2
    assert loaded["prompt_index"] == 7 and torch.equal(loaded["rng"], extra["rng"])
    # Same losses, grad norms and learning rates, to the last bit.
    assert [_step(resumed, seed) for seed in (2, 3, 4)] == uninterrupted
    for (name, a), b in zip(run.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name


def test_resume_with_lora_dropout_is_bitwise_exact(make_trainer):
    lora = ModelConfig(lora=LoRAConfig(rank=4, dropout=0.5))
    run = make_trainer(model_config=lora, steps=4)
    _step(run, 0)
    path = run.save_checkpoint(1)
    uninterrupted = [_step(run, seed) for seed in (1, 2)]
    resumed = make_trainer(model_config=lora, steps=4)  # building it seeds the global RNG again
    resumed.load_checkpoint(path)
    assert [_step(resumed, seed) for seed in (1, 2)] == uninterrupted  # the same dropout masks


def test_checkpoint_without_rng_state_still_loads(make_trainer, tmp_path):
    """A checkpoint written before the RNG states were saved: its trainer blob lacks them."""
    run = make_trainer()
    _step(run, 0)
    blob = {"trainer_step": 1, "has_optimizer_state": False, "extra": {"k": 1}}
    dcp.save({"model": checkpoint._model_state(run.model), "trainer": pickle.dumps(blob)},
             checkpoint_id=tmp_path / "old")
    resumed = make_trainer(seed=5)
    assert resumed.load_checkpoint(tmp_path / "old") == {"k": 1} and resumed.step == 1
    for a, b in zip(run.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor())


def test_checkpoint_before_first_step_does_not_perturb_training(make_trainer, tmp_path):
    run = make_trainer()
    run.save_checkpoint(0)
    first = _step(run, 0)
    fresh = make_trainer(output_dir=tmp_path / "fresh")
    resumed = make_trainer()
    assert load_newest(resumed) == {}
    assert _step(fresh, 0) == first == _step(resumed, 0)


def test_leftover_tmp_is_ignored_and_keep_latest_prunes(make_trainer, tmp_path):
    trainer = make_trainer(checkpoint=CheckpointConfig(keep_latest=2))
    folder = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        _step(trainer, step)
        trainer.save_checkpoint(step, extra={"step": step})
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-3"]

    # A crash mid-save leaves step-N.tmp; a step-N without DCP metadata is not complete.
    (folder / "step-9.tmp").mkdir()
    (folder / "step-9.tmp" / "__0_0.distcp").write_bytes(b"partial")
    (folder / "step-8").mkdir()

    resumed = make_trainer()
    assert load_newest(resumed) == {"step": 3}
    assert resumed.step == 3


def test_no_checkpoint_loads_nothing(make_trainer):
    assert load_newest(make_trainer()) is None
