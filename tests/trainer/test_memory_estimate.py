"""The memory estimate printed at start, against what a real trainer holds (CPU: RSS)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchtitan.config import ParallelismConfig as TitanParallelismConfig

from tests.helpers import REPO, assert_one_line_error, run_cli
from torchtitan_rl.config import JobConfig
from torchtitan_rl.config.job_config import GeneratorConfig, ModelConfig, TrainerConfig
from torchtitan_rl.run.memory import GIB, check_fits, count_parameters, estimate, one_line_oom
from torchtitan_rl.models.families import resolve_shape
from torchtitan_rl.models.shape import titan_config
from torchtitan_rl.trainer.build import build_model

WORKER = Path(__file__).with_name("memory_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("master_dtype", ["float32", "bfloat16"])
def test_trainer_estimate_matches_measured_rss(master_dtype):
    """RSS growth from before the Trainer to after its first step (weights, gradients, AdamW state and what a step
    leaves: the tokens, the allocator's slack) is at least the estimate and at most 15% + 256 MiB above it; the
    build's peak likewise (20% + 64 MiB)."""
    # glibc's mmap threshold fixed at its 128 KiB default: left dynamic, it rises once big tensors are freed and
    # later freed ones stay resident, so the RSS varied from run to run (docs/design.md, "incidents").
    proc = subprocess.run([sys.executable, str(WORKER), "smollm2-135m", master_dtype], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(REPO), "PATH": "", "MALLOC_MMAP_THRESHOLD_": str(128 << 10)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["estimate"] <= got["measured"] <= 1.15 * got["estimate"] + (256 << 20), got
    # The build's peak: with bfloat16 masters one float32 block at a time (a whole float32 model first measured
    # 568 MiB against this estimate's 324).
    assert got["build_estimate"] <= got["build_measured"] <= 1.2 * got["build_estimate"] + (64 << 20), got


def test_qwen3_sizes_are_counted_exactly():
    shape = resolve_shape(flavor="8B", hf_checkpoint=None, vocab_size=0, max_seq_len=512)
    assert count_parameters(shape)[:2] == (8_190_735_360, 8_190_735_360)  # Qwen3-8B's published count


def test_an_8b_colocated_run_on_one_80gb_gpu_is_refused_naming_the_fields():
    shape = resolve_shape(flavor="8B", hf_checkpoint=None, vocab_size=0, max_seq_len=512)
    cfg = JobConfig(model=ModelConfig(flavor="8B"), generator=GeneratorConfig(gpu_memory_utilization=0.3))
    est = estimate(cfg, shape, world_size=1, device_total=80 * GIB, role="colocated")
    assert est.trainer_resident == 16 * 8_190_735_360  # fp32 weights + grads + 2 AdamW moments
    with pytest.raises(ValueError, match=r"^memory: this run needs at least 191\.\d GiB on cuda:0 .*"
                                         r"generator\.gpu_memory_utilization .*generator\.sleep .*trainer\.cpu_offload"):
        check_fits(est, free=79 * GIB, device="cuda:0")
    # Two ranks (layout b), bfloat16 masters, the engine asleep while the trainer steps: 8B fits on each 80 GB GPU.
    cfg.trainer = TrainerConfig(master_dtype="bfloat16")
    cfg.generator.sleep = "weights"
    est = estimate(cfg, shape, world_size=2, device_total=80 * GIB, role="colocated")
    check_fits(est, free=79 * GIB, device="cuda:0")
    assert est.generate_peak < est.train_peak == est.peak < 79 * GIB  # the micro-batch's activations come on top


def test_a_run_that_cannot_fit_is_refused_in_one_line_before_it_starts(tmp_path):
    """Qwen3-8B's trainer state alone (131 GB in float32) exceeds this machine's memory: one line, no run folder."""
    proc = run_cli("--config", "run_configs/cpu_tiny.toml", "--model.flavor", "8B", "--job.output_dir", str(tmp_path))
    assert_one_line_error(proc, "memory: this run needs at least 183.", "trainer.master_dtype bfloat16",
                          prefix="torchtitan_rl: error: ")
    assert not any(tmp_path.iterdir())


def test_an_allocation_the_machine_refuses_becomes_one_line():
    """A real refusal of torch's CPU allocator (a petabyte); CUDA's OutOfMemoryError takes the same path on a GPU."""
    import torch

    with pytest.raises(ValueError, match=r"^memory: the host ran out of memory at step 3's train step \(.*\); make "
                                         r"room with trainer.master_dtype bfloat16") as e:
        with one_line_oom("step 3's train step"):
            torch.empty(1 << 50, dtype=torch.uint8)
    assert "\n" not in str(e.value)
    # CUDA's refusal keeps torch's account of the card and the process (its opening as an H200 printed it, 2026-11-28),
    # not its advice.
    cuda = ("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 1 has a total capacity of 139.80 GiB of which 109.43 "
            "GiB is free. Including non-PyTorch memory, this process has 30.17 GiB memory in use. Of the allocated "
            "memory 27.52 GiB is allocated by PyTorch, and 1.13 GiB is reserved by PyTorch but unallocated. If "
            "reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to "
            "avoid fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html"
            "#environment-variables)")
    with pytest.raises(ValueError) as e:
        with one_line_oom("step 0's train step"):
            raise torch.OutOfMemoryError(cuda)
    assert str(e.value).startswith("memory: CUDA ran out of memory at step 0's train step (CUDA out of memory. Tried "
                                   "to allocate 1.50 GiB. GPU 1 has a total capacity of 139.80 GiB of which 109.43 "
                                   "GiB is free. Including non-PyTorch memory, this process has 30.17 GiB memory in "
                                   "use. Of the allocated memory 27.52 GiB is allocated by PyTorch, and 1.13 GiB is "
                                   "reserved by PyTorch but unallocated.); make room with job.fit auto")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in str(e.value)
    with pytest.raises(RuntimeError, match="other"):  # anything else passes through
        with one_line_oom("x"):
            raise RuntimeError("other")


ACTIVATION_WORKER = Path(__file__).with_name("activation_worker.py")
# debugmodel's blocks (0.6B's attention and feed-forward widths) at hidden size 64, two of them: a CPU without AVX-512
# multiplies bfloat16 with torch's reference gemm, and the whole debugmodel outlived the worker's timeout there
# (docs/design.md, "incidents"). The cases stay in bfloat16, the dtype the estimate's float32 copies are counted for.
NARROW = {"hidden_size": 64, "num_hidden_layers": 2}
ACTIVATION_CASES = [
    {"flavor": "tiny", "rows": 64, "length": 64, "micro_batch_size": 64},
    {"flavor": "tiny", "rows": 64, "length": 64, "micro_batch_size": 64, "logprob_chunk_tokens": 0},
    {"flavor": "debugmodel", "shape": NARROW, "rows": 16, "length": 128, "micro_batch_size": 64},
    {"flavor": "debugmodel", "shape": NARROW, "rows": 32, "length": 128, "micro_batch_size": 64,
     "activation_checkpoint": "full", "logprob_chunk_tokens": 256},
    {"flavor": "debugmodel", "shape": NARROW, "rows": 32, "length": 128, "micro_batch_size": 8,
     "micro_batch_tokens": 512, "recompute_micro_batch_tokens": 2048},
]
"""Whole and chunked logits, with and without activation checkpointing, cut by rows and by tokens."""


@pytest.mark.slow  # five CPU trainers, two steps and a recompute each
def test_the_activation_terms_bound_the_measured_peaks():
    """A train step's and a logprob recompute's peak allocations on CPU (torch.profiler's memory events: the bytes
    torch's allocator holds, the same on any CPU) stay at or below the estimate, which is at most 25% + 8 MiB above
    them: the terms that make a 4B run refused before it starts (tests/test_fit.py) are the trainer's real ones."""
    proc = subprocess.run([sys.executable, str(ACTIVATION_WORKER), json.dumps(ACTIVATION_CASES)], cwd=REPO,
                          capture_output=True, text=True, timeout=900, env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(ACTIVATION_CASES)
    for got in results:
        for phase in ("train", "recompute"):
            measured, estimated = got[phase], got[f"{phase}_estimate"]
            assert measured <= estimated <= 1.25 * measured + (8 << 20), (phase, got)


# the MoE flavor's build takes ~16 s on 2 cores: out of the quick loop, the dense one's the same code
@pytest.mark.parametrize("flavor", ["debugmodel", pytest.param("debugmodel_moe", marks=pytest.mark.slow)])
def test_the_block_by_block_build_draws_the_whole_float32_models_values(flavor):
    """trainer/build.py brings one block at a time to the device and casts it to the master dtype after its init:
    the same values as torchtitan's whole-model float32 init cast after (tied embeddings stay tied)."""
    shape = resolve_shape(flavor=flavor, hf_checkpoint=None, vocab_size=0, max_seq_len=64)
    with torch.device("meta"):
        whole = titan_config(shape).build()
    whole.to_empty(device="cpu")
    torch.manual_seed(3)
    with torch.no_grad():
        whole.init_states(buffer_device=torch.device("cpu"))
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(shape, seed=3, device=torch.device("cpu"), parallelism=TitanParallelismConfig(),
                            dtype=dtype)
        params = dict(model.named_parameters())
        assert params.keys() == dict(whole.named_parameters()).keys()
        for name, p in whole.named_parameters():
            assert params[name].dtype == (dtype if name.startswith("layers.") else torch.float32), name
            assert torch.equal(p.to(params[name].dtype), params[name]), name
        for name, b in whole.named_buffers():
            assert torch.equal(b, dict(model.named_buffers())[name]), name
        assert (model.tok_embeddings.weight is model.lm_head.weight) == shape.tie_word_embeddings


def test_the_build_of_a_30b_moe_on_four_80gb_gpus_is_counted():
    """scripts/gpu/moe.sh's a3b_4gpu row: every rank builds the whole model before FSDP keeps its shard, in bf16
    masters 57 GiB plus a float32 block and the embeddings (a whole float32 model, 114 GiB, ran out of memory on
    4 H100s); the build is part of the peak."""
    shape = resolve_shape(flavor="30B-A3B", hf_checkpoint=None, vocab_size=0, max_seq_len=256)
    cfg = JobConfig(model=ModelConfig(flavor="30B-A3B", max_seq_len=256),
                    generator=GeneratorConfig(gpu_memory_utilization=0.8, sleep="weights", max_model_len=256),
                    trainer=TrainerConfig(master_dtype="bfloat16", cpu_offload=True))
    est = estimate(cfg, shape, world_size=4, device_total=80 * GIB, role="colocated")
    assert 57 * GIB < est.trainer_build < 62 * GIB and f"build {est.trainer_build / GIB:.1f};" in est.summary()
    check_fits(est, free=79 * GIB, device="cuda:0")
    cfg.trainer.cpu_offload, cfg.generator.gpu_memory_utilization = False, 0.1
    cfg.trainer.master_dtype = "float32"
    est = estimate(cfg, shape, world_size=8, device_total=80 * GIB, role="colocated")
    assert est.peak == est.trainer_build > 114 * GIB  # the build alone refuses it
