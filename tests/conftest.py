"""Session fixtures shared by every test folder."""

import collections
import os
import signal
from pathlib import Path

# Before torch loads OpenMP: the suite's two workers share CI's two cores, and many tests start more processes
# (torchrun ranks, a server) that inherit this. At one OpenMP thread each they take turns on the cores instead
# of spinning on each other (docs/benchmarks.md, "Test suite"); a test that needs more threads sets them itself.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# A suite started as a shell's background job inherits SIGINT ignored, and so would the runs the Ctrl-C tests start
# (run/startup.py keeps an ignored SIGINT ignored, as nohup asks): they get a terminal's default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest

from torchtitan_rl import collector

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    """The files holding the most slow tests first, each file's tests in their order.

    pytest-xdist hands each worker one file at a time (--dist loadfile), in collection order (pyproject's
    --no-loadscope-reorder; its own order, most tests first, left the one-test files of a minute or more,
    the AVX2 re-run and the kill -9 run, for last, one worker running them while the other idled): the long
    files start early and the short ones fill in at the end.
    """
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    first_seen = {path: i for i, path in enumerate(dict.fromkeys(item.path for item in items))}
    items.sort(key=lambda item: (-slow[item.path], first_seen[item.path]))


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """Collection imports torch, vLLM and transformers: the collector paused meanwhile, as a run's start-up is."""
    with collector.paused():
        return (yield)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF folder (written once per machine, ~20 s; git-ignored)."""
    from torchtitan_rl.fetch import fetch

    return fetch("smollm2-135m-instruct", REPO / "models" / "smollm2-135m-instruct")


TINY_HF = {
    # Two families, one of each embedding layout: Llama tied (as SmolLM2), Qwen3 untied.
    "llama": dict(tie_word_embeddings=True, rope_theta=100_000.0, rms_norm_eps=1e-5),
    "qwen3": dict(tie_word_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-6),
}


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    """Factory: family name -> a random transformers checkpoint folder of that family (made once).

    Built and saved by transformers itself (LlamaForCausalLM / Qwen3ForCausalLM,
    save_pretrained, fp32 safetensors; a tied model stores no lm_head.weight).
    Weights are redrawn larger than HF's init (norms 1 +- 0.2, projections
    ~1/sqrt(fan_in)) so that logprobs spread and a wrong layout cannot hide
    in near-uniform outputs.
    """
    made = {}

    def make(family: str) -> Path:
        if family not in made:
            import torch
            from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

            config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[family]
            config = config_cls(  # head_dim 32: the smallest vLLM's CPU attention supports
                vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=64, **TINY_HF[family],
            )
            torch.manual_seed(0)
            model = model_cls(config)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if p.dim() == 1:  # RMSNorm weights (Qwen3's q_norm/k_norm included)
                        p.copy_(1 + 0.2 * torch.randn_like(p))
                    else:
                        p.copy_(torch.randn_like(p) * (0.5 if "embed" in name else p.shape[1] ** -0.5))
            folder = tmp_path_factory.mktemp(f"hf_{family}")
            model.save_pretrained(folder)
            made[family] = folder
        return made[family]

    return make
