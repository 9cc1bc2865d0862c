"""job.fit auto (run/fit.py): what it changes, in its stated order, for the README's sizes on an 80 GB GPU, and its
refusal when nothing fits. Pure function: no GPU, the device's size is an argument."""

import re
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO
from torchtitan_rl.config import load_toml
from torchtitan_rl.models.families import resolve_shape
from torchtitan_rl.config.checks import replace
from torchtitan_rl.run.fit import HEADROOM, fit, fit_this_rank
from torchtitan_rl.run.memory import GIB, check_fits, estimate

H100 = int(79.2 * GIB)
"""What torch.cuda.mem_get_info says an 80 GB H100 holds."""


def _config(flavor: str, **fields):
    cfg = replace(load_toml(REPO / "run_configs" / "qwen3_0.6b.toml"), "model.flavor", flavor)
    for path, value in fields.items():
        cfg = replace(cfg, path.replace("__", "."), value)
    return cfg


def _fit(flavor: str, *, gpus: int = 1, total: int = H100, role: str = "colocated", **fields):
    cfg = _config(flavor, **fields)
    shape = resolve_shape(flavor=flavor, hf_checkpoint=None, vocab_size=0, max_seq_len=cfg.model.max_seq_len)
    return cfg, fit(cfg, shape, world_size=gpus, role=role, device_total=total)


def test_a_run_that_fits_as_written_is_unchanged():
    cfg, result = _fit("0.6B")
    assert result.config is cfg and result.changes == {} and result.line is None
    assert result.estimate.peak <= (1 - HEADROOM) * H100


def test_the_engine_sleeps_first():
    """Qwen3-4B colocated on two 80 GB GPUs: sleeping the engine while the trainer steps is enough."""
    cfg, result = _fit("4B", gpus=2)
    assert result.changes == {"generator.sleep": "weights"}
    assert result.config.generator.sleep == "weights" and cfg.generator.sleep == "off"  # the given config unchanged
    assert result.estimate.peak <= (1 - HEADROOM) * H100
    assert re.fullmatch(r"job\.fit auto: generator\.sleep weights: the estimate's peak [\d.]+ GiB per GPU is above "
                        r"75\.2 of 79\.2 GiB; now [\d.]+ \(job\.fit off keeps the config as written\)", result.line)


def test_then_bfloat16_masters():
    """Qwen3-4B on one 80 GB GPU (issue 41: 68.7 GiB estimated before activations counted, then OOM): sleep and
    bfloat16 masters, the by-hand setting that trained at 15.5 s a step."""
    _, result = _fit("4B")
    assert result.changes == {"generator.sleep": "weights", "trainer.master_dtype": "bfloat16"}


def test_then_smaller_micro_batches():
    """Qwen3-8B on two 80 GB GPUs: the recompute's micro-batch is halved; on one GPU the train step's too."""
    _, result = _fit("8B", gpus=2)
    assert result.changes == {"generator.sleep": "weights", "trainer.master_dtype": "bfloat16",
                              "trainer.recompute_micro_batch_tokens": 131072}
    _, result = _fit("8B")
    assert list(result.changes) == ["generator.sleep", "trainer.master_dtype", "trainer.micro_batch_tokens",
                                    "trainer.recompute_micro_batch_tokens"]
    assert result.config.trainer.micro_batch_tokens < 65536


def test_then_offload_with_the_micro_batches_it_still_needs():
    """A larger engine share leaves too little for the trainer state: offloaded, with the micro-batches undone."""
    _, result = _fit("8B", generator__gpu_memory_utilization=0.4)
    assert result.changes == {"generator.sleep": "weights", "trainer.master_dtype": "bfloat16",
                              "trainer.cpu_offload": True}
    assert result.estimate.trainer_resident == 0


def test_nothing_fits_is_one_line():
    with pytest.raises(ValueError, match=r"^memory: this run needs at least [\d.]+ GiB per GPU even after job\.fit "
                                         r"auto set generator\.sleep weights, trainer\.master_dtype bfloat16, "
                                         r"trainer\.cpu_offload true.*make room with "
                                         r"generator\.gpu_memory_utilization") as e:
        _fit("8B", total=16 * GIB)
    assert "\n" not in str(e.value)


def test_without_weight_sync_the_engine_sleeps_at_level_1():
    """weight_sync.enable false syncs once: level 2 would drop the weights for good (config.validation refuses it)."""
    _, result = _fit("4B", gpus=2, weight_sync__enable=False)
    assert result.changes == {"generator.sleep": "kv_cache"}


def test_the_nccl_layout_has_no_engine_to_sleep():
    _, result = _fit("8B", gpus=2, role="trainer", weight_sync__transport="nccl")
    assert "generator.sleep" not in result.changes and "trainer.cpu_offload" not in result.changes
    assert result.changes["trainer.master_dtype"] == "bfloat16"
    _, result = _fit("8B", gpus=2, role="generator", weight_sync__transport="nccl")
    assert result.changes == {}  # a generator rank has nothing to change


def test_off_and_cpu_change_nothing():
    cfg, result = _fit("4B", job__fit="off")
    assert result.config is cfg and result.line is None
    with pytest.raises(ValueError, match=r"^memory: this run needs at least"):
        check_fits(result.estimate, free=H100, device="cuda:0")
    cfg, result = _fit("8B", total=0)  # CPU: no sleep mode, nothing to offload to
    assert result.config is cfg


@pytest.mark.slow  # a whole run or engine in its own process: 7-12 s, out of the quick loop
def test_the_readme_table_is_what_auto_chooses():
    """README's "which layout for my model" rows for 1.7B/4B/8B on one and two 80 GB GPUs come from
    scripts/fit_table.py, which calls ``fit``."""
    table = subprocess.run([sys.executable, str(REPO / "scripts" / "fit_table.py")], cwd=REPO, capture_output=True,
                           text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert table.returncode == 0, table.stderr
    readme = (REPO / "README.md").read_text()
    for row in table.stdout.strip().splitlines():
        assert row in readme, row


def test_the_estimate_counts_activations_and_refuses_the_4b_run_it_once_admitted():
    """Issue 41: Qwen3-4B, layout a, sleep weights, fp32 masters on one H100 was estimated at 68.7 GiB of 79.2 and
    ran out of memory in step 0's train step; counting the micro-batch's activations it is refused up front."""
    cfg = _config("4B", generator__sleep="weights", job__fit="off")
    shape = resolve_shape(flavor="4B", hf_checkpoint=None, vocab_size=0, max_seq_len=1024)
    est = estimate(cfg, shape, world_size=1, device_total=H100, role="colocated")
    assert est.generate_peak / GIB == pytest.approx(68.7, abs=0.1)  # what was printed then
    assert est.train_peak > H100 and est.trainer_activations > 20 * GIB
    with pytest.raises(ValueError, match=r"^memory: this run needs at least \d+\.\d GiB on cuda:0"):
        check_fits(est, free=H100, device="cuda:0")


@pytest.mark.parametrize(("transport", "rank", "role"), [
    ("inplace", "0", "colocated"), ("server", "0", "trainer"), ("nccl", "0", "trainer"), ("nccl", "1", "generator")])
def test_each_rank_estimates_what_its_device_holds(monkeypatch, transport, rank, role):
    """The memory check's estimate is fit_this_rank's: a trainer whose engine is a rollout server (transport server)
    or another rank (nccl) counts no engine on its own device; only inplace shares the device with one."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    cfg = _config("0.6B", weight_sync__transport=transport)
    shape = resolve_shape(flavor="0.6B", hf_checkpoint=None, vocab_size=0, max_seq_len=cfg.model.max_seq_len)
    est = fit_this_rank(cfg, shape, device=torch.device("cpu")).estimate
    assert est.role == role
    assert ("engine " in est.summary()) == (role != "trainer")


def test_an_fp8_kv_cache_counts_twice_the_tokens_in_the_same_budget():
    shape = resolve_shape(flavor="0.6B", hf_checkpoint=None, vocab_size=0, max_seq_len=1024)
    auto, fp8 = (estimate(_config("0.6B", generator__kv_cache_dtype=d), shape, world_size=1, device_total=H100,
                          role="colocated") for d in ("auto", "fp8"))
    assert fp8.kv_bytes == auto.kv_bytes and fp8.kv_token_bytes * 2 == auto.kv_token_bytes
    assert fp8.kv_tokens // 2 == auto.kv_tokens  # floor division of the same budget


def test_an_engine_share_without_room_for_one_sequence_is_refused():
    """The colocated engine is given the estimate's KV bytes (rollout/colocated.py): a share that leaves fewer
    tokens than one sequence is refused before anything is built, naming the field."""
    cfg = _config("0.6B", generator__gpu_memory_utilization=0.02)  # 1.6 GiB: the weights and the sampler's peak
    shape = resolve_shape(flavor="0.6B", hf_checkpoint=None, vocab_size=0, max_seq_len=cfg.model.max_seq_len)
    est = estimate(cfg, shape, world_size=1, device_total=H100, role="colocated")
    assert est.kv_tokens < cfg.generator.max_model_len
    with pytest.raises(ValueError, match=r"^generator.gpu_memory_utilization: its 1.6 GiB of cuda:0 leave the "
                                         r"engine \d+ tokens of KV cache"):
        check_fits(est, free=H100, device="cuda:0")
    roomy = estimate(replace(cfg, "generator.gpu_memory_utilization", 0.05), shape, world_size=1, device_total=H100,
                     role="colocated")
    check_fits(roomy, free=H100, device="cuda:0")
