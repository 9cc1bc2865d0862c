"""Shared by the tests: tiny models (Qwen3 or Llama family), a generator on them, and the bf16 checks."""

import copy
import importlib.util
import os
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from torchtitan_rl.config import GeneratorConfig, ModelConfig, WeightSyncConfig
from torchtitan_rl.models.families import resolve_shape
from torchtitan_rl.models.shape import ModelShape, build_titan_model
from torchtitan_rl.run.metrics import is_measured
from torchtitan_rl.weight_sync.sync import WeightSync

REPO = Path(__file__).resolve().parents[1]
SAMPLE_DATASET = REPO / "torchtitan_rl" / "grpo" / "tasks" / "data" / "gsm8k_style_sample.jsonl"
"""The shipped GSM8K-style sample (grpo.task = "dataset")."""

PROMPTS = [[1, 4, 5, 6, 14], [1, 7, 7, 2, 14], [1, 13, 4, 9, 14]]

# How close "the generator serves these weights" is, in bf16, on any CPU.
#
# The generator and our reference forward both evaluate the model in bf16
# (bf16 weights and activations, fp32 accumulation) but through different
# kernels, and which kernels run depends on the CPU (AVX2, AVX512-BF16, AMX
# take different GEMM and attention paths with different rounding). So no
# fixed tolerance holds everywhere. Instead every check measures this CPU's
# bf16 noise for the weights and tokens at hand: the mean |bf16 reference -
# exact| logprob, where "exact" is an fp32 forward of the same bf16 weights.
# The generator must be within a small multiple of that, and weights it does
# not serve must be far outside it. Means, not maxima: one token's error is a
# heavy-tailed draw (max/mean ~ 10 in the LoRA tests), the mean of ~50 is stable.

NOISE_FACTOR = 3.0
"""The generator's mean error may be this many times the bf16 reference's: it rounds at the same
places through other kernels (vLLM's attention and sampler). Measured ratio <= 1.8 with the CPU's
default kernels (AVX512-BF16) and pinned to AVX2 (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2)."""

FP32_FLOOR = 1e-5
"""Lower bound of the measured noise: fp32 log-softmax rounding (~1e-7 relative) of O(1-10) logits;
it only keeps a tolerance from reaching 0 where bf16 happens to round nothing."""

SEPARATION = 3.0
"""Weights the generator does not serve must miss by this many tolerances, or the check could not tell."""

BF16_MISMATCH_MEAN = 1e-2
"""Mean |generator - trainer| logprob of the tiny model in the GRPO loop, where no fp32 forward is at
hand: two bf16 evaluations of the same weights, each within NOISE_FACTOR x its measured noise (mean
<= 2.2e-3 in tests/weight_sync on AVX512-BF16 and AVX2), so <= ~7e-3 apart; a generator one
optimizer step behind (lr 3e-3) is >= 4e-2 away (test_without_weight_sync_the_run_does_not_learn)."""


def not_measured(record: dict) -> dict:
    """A metrics.jsonl line without what the machine decides: timings, memory readings (run/metrics.is_measured)."""
    return {k: v for k, v in record.items() if not is_measured(k)}


def free_port() -> int:
    """A free local TCP port for a torchrun rendezvous, below the kernel's ephemeral range.

    A port the kernel hands out (bind to 0) is in the ephemeral range, which every outgoing connection of the
    other test worker draws from too: between our close and torchrun's bind it was taken (EADDRINUSE, seen in CI).
    """
    import random
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) \
        if Path("/proc/sys/net/ipv4/ip_local_port_range").exists() else 32768
    for port in random.Random().sample(range(20000, min(low, 32768)), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 20000..ephemeral range")


def load_script(relative: str) -> types.ModuleType:
    """A script under the repository (not a package: scripts/gpu/*.py) imported as a module, for its functions."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    from torchtitan_rl.engine.engine import Engine

    config = GeneratorConfig(**overrides)
    return Engine(
        config, model_config=ModelConfig(), shape=tiny_shape(flavor), seed=0, device="cpu", workdir=workdir
    )


def trainer_model(seed: int) -> torch.nn.Module:
    return build_titan_model(tiny_shape(), seed=seed)


def sync_model(generator, model: torch.nn.Module, *, version: int) -> None:
    """One sync (the default WeightSyncConfig) of ``model``'s weights into ``generator``, which then serves
    ``version``."""
    WeightSync(WeightSyncConfig(), reference=native_state(model), generator=generator).sync(native_state(model),
                                                                                              version=version)


@torch.no_grad()
def reference_logprobs(model, prompt: list[int], completion: list[int], *, dtype=torch.bfloat16) -> torch.Tensor:
    """Independent forward of the trainer's model with its weights rounded to bf16, computed in ``dtype``
    (bf16: a reference computed as the generator computes; fp32: exact arithmetic on the same weights)."""
    m = copy.deepcopy(model)
    for p in m.parameters():
        p.data = p.data.bfloat16().to(dtype)
    tokens = torch.tensor([prompt + completion])
    logits = m(tokens).float()
    lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, tokens[0, 1:, None])[:, 0]
    return lp[len(prompt) - 1 :]


@dataclass
class LogprobCheck:
    """How far the generator's sampled-token logprobs are from a model's, against this CPU's bf16 noise."""

    error: float
    """Mean |generator - exact| over the sampled tokens."""
    noise: float
    """Mean |bf16 reference - exact|: what bf16 rounding alone costs for these weights and tokens here."""
    max_error: float
    """Max |generator - exact|, for the failure message."""

    @property
    def tolerance(self) -> float:
        return NOISE_FACTOR * max(self.noise, FP32_FLOOR)


def logprob_check(rollouts, model) -> LogprobCheck:
    gen, ref, exact = [], [], []
    for p, c, lps in zip(rollouts.prompt_ids, rollouts.completion_ids, rollouts.logprobs):
        gen.append(torch.tensor(lps))
        ref.append(reference_logprobs(model, p, c))
        exact.append(reference_logprobs(model, p, c, dtype=torch.float32))
    gen, ref, exact = torch.cat(gen), torch.cat(ref), torch.cat(exact)
    return LogprobCheck(
        error=(gen - exact).abs().mean().item(),
        noise=(ref - exact).abs().mean().item(),
        max_error=(gen - exact).abs().max().item(),
    )


def assert_serves(rollouts, model, *, not_=()) -> None:
    """The rollouts were sampled from ``model``'s weights and from none of the models in ``not_``."""
    assert_within_noise(logprob_check(rollouts, model), misses=[logprob_check(rollouts, m).error for m in not_])


def assert_within_noise(check: LogprobCheck, *, misses=()) -> None:
    """``check`` passes, and each error in ``misses`` (other weights' mean error) is clearly outside it."""
    assert check.error <= check.tolerance, check
    for miss in misses:
        assert miss > SEPARATION * check.tolerance, (miss, check)


# ------------------------------------------------------------- the CLI as a user runs it


def repo_env(**extra: str | None) -> dict[str, str]:
    """This process's environment with PYTHONPATH this tree (a child imports this checkout's package, not an
    installed one), plus ``extra``; a variable given as None is left out (unset in the child)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **extra}
    return {key: value for key, value in env.items() if value is not None}


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


def assert_one_line_error(proc, *expected, prefix="config error: "):
    """Exit 2 and one '<prefix>...' line on stderr holding every ``expected`` text.

    The prefix is "config error: " for what parsing finds, "torchtitan_rl: error: " for
    what the run finds before it starts (a dataset, a tokenizer, a checkpoint)."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(prefix), lines[0]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]

