"""Two processes under torchrun (gloo, CPU): FSDP and TP give the single-process step; EP gives FSDP's."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchtitan_rl.config.job_config import GRPOConfig, ModelConfig

from tests.helpers import REPO, free_port, repo_env

from .dp_worker import SPLITS
from .helpers import make_batch

pytestmark = pytest.mark.slow  # one torchrun world of two trainers for all of them: ~20 s, out of the quick loop


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The global batch and what each of the two torchrun ranks wrote."""
    folder = tmp_path_factory.mktemp("two_ranks")
    batch = make_batch(seed=20)
    torch.save(
        {k: v for k, v in vars(batch).items() if v is not None}, folder / "batch.pt"
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()),
        str(Path(__file__).with_name("dp_worker.py")), str(folder / "batch.pt"), str(folder),
    ]
    env = repo_env()
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return batch, [torch.load(folder / f"rank{r}.pt") for r in range(2)]


def test_fsdp_ranks_end_with_identical_full_parameters(two_ranks):
    _, (r0, r1) = two_ranks
    assert r0["metrics"] == r1["metrics"]
    for name, p0 in r0["params"].items():
        assert torch.equal(p0, r1["params"][name]), name


def test_fsdp_step_equals_single_process_full_batch(two_ranks, make_trainer):
    batch, (r0, r1) = two_ranks
    # fp32, as the worker's FSDP trainer: a rank's micro-batches are cut to their longest row, so
    # a row meets other GEMM shapes than in one process, which bf16 kernels may round differently.
    single = make_trainer(micro_batch_size=2, model_config=ModelConfig(dtype="float32"))
    logprobs = single.token_logprobs(batch.tokens_BL, temperature=1.0)
    metrics = single.train_step(batch, temperature=1.0, grpo=GRPOConfig())

    # Per row, the forward is the same fp32 computation in both layouts, up to the order of sums.
    torch.testing.assert_close(r0["logprobs"], logprobs[SPLITS[0]], rtol=0, atol=1e-5)
    torch.testing.assert_close(r1["logprobs"], logprobs[SPLITS[1]], rtol=0, atol=1e-5)
    # The loss is a sum of fp32 per-token terms over the global token count;
    # only the order of sums differs (GEMM shapes, micro-batches and ranks).
    assert r0["metrics"]["tokens"] == metrics["tokens"]
    assert r0["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=2e-6)  # measured <= 2e-7 relative
    # Gradients: per-rank fp32 partial sums reduced in fp32, in another order.
    assert r0["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)


def test_two_rank_checkpoint_resume_is_exact(two_ranks):
    _, ranks = two_ranks
    for r in ranks:
        assert r["second_resumed"] == r["second"]


def test_tensor_parallel_matches_single_process(two_ranks, make_trainer):
    batch, (r0, r1) = two_ranks
    single = make_trainer(micro_batch_size=2)
    logprobs = single.token_logprobs(batch.tokens_BL, temperature=1.0)
    metrics = single.train_step(batch, temperature=1.0, grpo=GRPOConfig())

    assert r0["tp_metrics"] == r1["tp_metrics"]
    # TP splits the bf16 matmuls (partial sums per rank): close, not bitwise. 1e-2: the tiny model's bf16
    # noise is ~7e-4 mean / 3e-3 max per token (tests/helpers.py measures it); the row-split sums add as much again.
    torch.testing.assert_close(r0["tp_logprobs"], logprobs, rtol=0, atol=1e-2)
    # Absolute: the loss is a mean of ratio * advantage, O(1) terms that cancel.
    assert r0["tp_metrics"]["loss"] == pytest.approx(metrics["loss"], abs=1e-3)


def test_fsdp_epochs_and_mini_batches_equal_single_process(two_ranks, make_trainer):
    batch, (r0, r1) = two_ranks
    assert r0["epoch_metrics"] == r1["epoch_metrics"]
    # Rank r holds rows [4r, 4r + 4); mini-batch m of the global batch is each rank's m-th half: rows
    # 0, 1, 4, 5 then 2, 3, 6, 7, which one process sees in this order.
    order = torch.tensor([0, 1, 4, 5, 2, 3, 6, 7])
    single = make_trainer(micro_batch_size=2, model_config=ModelConfig(dtype="float32"))
    permuted = type(batch)(**{k: v[order] for k, v in vars(batch).items() if v is not None})
    metrics = single.train_step(permuted, temperature=1.0, grpo=GRPOConfig(epochs=2, mini_batches=2))
    assert r0["epoch_metrics"]["optimizer_steps"] == metrics["optimizer_steps"] == 4
    assert r0["epoch_metrics"]["ratio_max"] == pytest.approx(metrics["ratio_max"], rel=1e-5)
    assert r0["epoch_metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-7)
    for name, p in single.model.named_parameters():
        torch.testing.assert_close(r0["epoch_params"][name], p.full_tensor(), rtol=0, atol=1e-6)


def test_expert_parallel_step_equals_fsdp_and_resumes_exactly(two_ranks):
    _, ranks = two_ranks
    for r in ranks:
        ep = r["ep"]
        assert ep[1]["meshes"] == [("fsdp",)]
        assert ep[2]["meshes"] == [("efsdp", "ep"), ("fsdp",)]  # the experts really are placed by expert
        # Each expert sees the same tokens in both layouts (moved there by all-to-all under EP): fp32 sums in
        # another order at most.
        torch.testing.assert_close(ep[2]["logprobs"], ep[1]["logprobs"], rtol=0, atol=1e-5)
        assert ep[2]["metrics"]["loss"] == pytest.approx(ep[1]["metrics"]["loss"], rel=2e-6)
        assert ep[2]["metrics"]["grad_norm"] == pytest.approx(ep[1]["metrics"]["grad_norm"], rel=1e-5)
        assert ep[1]["params"].keys() == ep[2]["params"].keys()
        for name, p in ep[1]["params"].items():  # what the sync gathers for the generator: every expert in place
            assert torch.equal(ep[2]["params"][name], p), name
            assert torch.equal(ep[2]["params_bf16"][name], p.bfloat16()), name  # cast before it travels
            # (Compared before the step: Adam's first update is lr * sign(g), which fp32 noise flips where g ~ 0.)
            # torchtitan's experts run in bf16 and their weight gradients come out of grouped_mm in bf16: one
            # rounding of all tokens' sum under EP, one per rank's sum under FSDP (measured: 1 bf16 ulp of the
            # largest element); the other gradients are fp32 (measured 1e-7 relative).
            want = ep[1]["grads"][name]
            bound = (2**-6 if ".moe.routed_experts." in name else 1e-5) * want.abs().max().item()
            torch.testing.assert_close(ep[2]["grads"][name], want, rtol=0, atol=bound, msg=name)
        assert ep["second_resumed"] == ep["second"]
