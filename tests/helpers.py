"""Shared by the tests: a tiny Qwen3, a generator on it, and a reference forward."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import torch

from torchtitan_rl.config import GeneratorConfig, ModelConfig
from torchtitan_rl.models.families import resolve_shape
from torchtitan_rl.models.shape import ModelShape, build_titan_model

REPO = Path(__file__).resolve().parents[1]

PROMPTS = [[1, 4, 5, 6, 14], [1, 7, 7, 2, 14], [1, 13, 4, 9, 14]]

# bf16 keeps 8 mantissa bits (relative rounding 2^-9 ~ 2e-3 per op). vLLM's CPU
# attention kernel and the trainer's SDPA sum in different orders over bf16
# activations, so logprobs of the tiny model differ by ~2e-3 (measured max
# 1.9e-3); 2e-2 leaves headroom while two different weight sets differ by ~0.5.
LOGPROB_ATOL = 2e-2


def free_port() -> int:
    """A free local TCP port for a torchrun rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_shape(flavor: str = "tiny") -> ModelShape:
    """The tiny Qwen3, or with flavor="tiny-llama" the same size as a Llama."""
    return resolve_shape(flavor=flavor, hf_checkpoint=None, vocab_size=16, max_seq_len=64)


def native_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainer's live tensors: parameters and buffers, torchtitan names."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def checkpoint_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """torchtitan's checkpoint-format state dict (wqkv split into wq/wk/wv) + buffers."""
    return {**model.state_dict(), **dict(model.named_buffers())}


def make_generator(workdir: Path, *, flavor: str = "tiny", **overrides):
    from torchtitan_rl.generator.generator import Generator

    config = GeneratorConfig(**overrides)
    return Generator(
        config, model_config=ModelConfig(), shape=tiny_shape(flavor), seed=0, device="cpu", workdir=workdir
    )


def trainer_model(seed: int) -> torch.nn.Module:
    return build_titan_model(tiny_shape(), seed=seed)


@torch.no_grad()
def reference_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Independent forward of the trainer's model: bf16 weights, fp32 buffers."""
    m = copy.deepcopy(model)
    for p in m.parameters():
        p.data = p.data.bfloat16()
    tokens = torch.tensor([prompt + completion])
    logits = m(tokens).float()
    lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, tokens[0, 1:, None])[:, 0]
    return lp[len(prompt) - 1 :]


def max_logprob_error(rollouts, model) -> float:
    return max(
        (torch.tensor(lps) - reference_logprobs(model, p, c)).abs().max().item()
        for p, c, lps in zip(rollouts.prompt_ids, rollouts.completion_ids, rollouts.logprobs)
    )


# ------------------------------------------------------------- the CLI as a user runs it


def run_module(module, *args, world_size=None, cwd=None, timeout=60):
    """python -m MODULE ARGS in a subprocess (WORLD_SIZE only when given)."""
    cwd = cwd or REPO
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    if world_size is not None:
        env["WORLD_SIZE"] = str(world_size)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def run_cli(*args, world_size=None, cwd=None):
    """python -m torchtitan_rl.simple_grpo ARGS in a subprocess (WORLD_SIZE only when given)."""
    return run_module("torchtitan_rl.simple_grpo", *args, world_size=world_size, cwd=cwd)


def assert_one_line_error(proc, *expected):
    """Exit 2 and one 'config error: ...' line on stderr holding every ``expected`` text."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("config error: "), lines[0]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]
