"""Trainers' activation peaks on CPU, measured (python tests/trainer/activation_worker.py JSON_LIST): for each spec the
bytes a train step and a logprob recompute allocate at their peak beyond what the trainer already held, beside the
estimate's terms; one JSON line per spec.

Measured with torch.profiler's memory events (every allocation and free of torch's CPU allocator, in order):
the live bytes a step added at its peak, independent of the C library's heap (no RSS), so the same on any CPU.
A spec: flavor, rows, length, optionally ``shape`` (ModelShape fields that replace the flavor's), and TrainerConfig
fields (activation_checkpoint, logprob_chunk_tokens, ...).
"""

import dataclasses
import gc
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from torchtitan_rl.config import JobConfig
from torchtitan_rl.config.job_config import GeneratorConfig, GRPOConfig, ModelConfig, TrainerConfig
from torchtitan_rl.models.families import resolve_shape
from torchtitan_rl.run.memory import estimate
from torchtitan_rl.trainer import TrainBatch, Trainer


def allocated_at_peak(fn) -> int:
    """Most bytes live at once during ``fn()`` among those it allocated (frees of older blocks are not seen)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def measure(spec: dict) -> dict:
    fields = dict(spec)
    flavor, rows, length = fields.pop("flavor"), fields.pop("rows"), fields.pop("length")
    base = resolve_shape(flavor=flavor, hf_checkpoint=None, vocab_size=16 if flavor == "tiny" else 0,
                         max_seq_len=max(64, length))
    shape = dataclasses.replace(base, **fields.pop("shape", {}))
    cfg = JobConfig(model=ModelConfig(flavor=flavor, max_seq_len=max(64, length)),
                    trainer=TrainerConfig(**fields), generator=GeneratorConfig(max_model_len=length),
                    grpo=GRPOConfig(prompts_per_step=rows // 2, group_size=2))
    est = estimate(cfg, shape, world_size=1, device_total=0, role="trainer")
    trainer = Trainer(cfg.trainer, model_config=cfg.model, shape=shape, seed=0, device=torch.device("cpu"),
                      output_dir=Path(tempfile.mkdtemp()))
    tokens_BL = torch.randint(1, min(1000, shape.vocab_size), (rows, length))
    mask_BL = torch.ones(rows, length)
    mask_BL[:, 0] = 0  # every position but the first is scored: the estimate's worst case
    batch = TrainBatch(tokens_BL=tokens_BL, loss_mask_BL=mask_BL, old_logprobs_BL=-5.0 * mask_BL,
                       advantages_B=torch.randn(rows))

    def step():
        trainer.train_step(batch, temperature=1.0, grpo=cfg.grpo, max_tokens=length)

    step()  # AdamW's state exists from here on, as in every later step
    trainer.release_gradients()
    gc.collect()
    train = allocated_at_peak(step)
    trainer.release_gradients()
    gc.collect()
    recompute = allocated_at_peak(lambda: trainer.token_logprobs(tokens_BL, temperature=1.0, mask_BL=mask_BL))
    return {
        "spec": spec, "train": train, "recompute": recompute,
        # What the estimate adds to the weights and AdamW state in a step: the gathered blocks and the activations,
        # the gradients the backward writes included (released above, as the step's zero_grad does).
        "train_estimate": est.trainer_gathered + est.trainer_activations,
        "recompute_estimate": est.trainer_gathered + est.trainer_recompute,
        "train_tokens": est.train_tokens, "recompute_tokens": est.recompute_tokens,
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    for spec in json.loads(sys.argv[1]):
        print(json.dumps(measure(spec)), flush=True)
