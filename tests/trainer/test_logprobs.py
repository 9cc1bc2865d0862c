"""token_logprobs and sync_state: what the trainer computes with and exposes."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_rl.config.job_config import LoRAConfig, ModelConfig
from torchtitan_rl.models.shape import build_titan_model
from torchtitan_rl.trainer.logprobs import chunked_token_logprobs, chunked_token_logprobs_and_entropy
from torchtitan_rl.trainer.logprobs import entropy_of_logits as _entropy_of_logits, token_entropy as _entropy

from .helpers import make_batch

pytestmark = pytest.mark.bf16_numerics


def test_token_logprobs_match_manual_bf16_forward(make_trainer, shape):
    trainer = make_trainer(micro_batch_size=3)  # 8 rows: micro-batches of 3, 3, 2
    tokens_BL = make_batch(seed=1).tokens_BL

    got_BL = trainer.token_logprobs(tokens_BL, temperature=0.7)

    # The generator's view: a plain model with bf16 copies of the fp32 masters
    # and fp32 buffers (RoPE cache), logits / temperature, log_softmax in fp32.
    masters = {k: v.full_tensor() for k, v in trainer.model.named_parameters()}
    plain = build_titan_model(shape, seed=123)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.data = masters[name].to(torch.bfloat16)
    assert all(b.dtype == torch.float32 for b in plain.buffers())
    with torch.no_grad():
        logits_BLV = plain(tokens_BL)
    assert logits_BLV.dtype == torch.bfloat16
    logprobs_BLV = torch.log_softmax(logits_BLV[:, :-1].float() / 0.7, dim=-1)
    want_BL = F.pad(logprobs_BLV.gather(-1, tokens_BL[:, 1:, None]).squeeze(-1), (1, 0))

    assert got_BL.dtype == torch.float32 and got_BL.shape == tokens_BL.shape
    assert torch.equal(got_BL[:, 0], torch.zeros(8))
    assert torch.equal(got_BL, want_BL)  # same bf16 weights, same ops: bitwise


def test_token_logprobs_do_not_depend_on_micro_batch_size(make_trainer):
    tokens_BL = make_batch(seed=2).tokens_BL
    one = make_trainer(micro_batch_size=8).token_logprobs(tokens_BL, temperature=1.0)
    many = make_trainer(micro_batch_size=3).token_logprobs(tokens_BL, temperature=1.0)
    # Each row is the same bf16 computation whatever its micro-batch; 1e-6 admits only fp32
    # log-softmax rounding, far below one bf16 step of a logit (~4e-3 at |logit| ~ 1).
    torch.testing.assert_close(one, many, rtol=0, atol=1e-6)


def test_sync_state_is_the_live_fp32_shards_and_buffers(make_trainer):
    trainer = make_trainer()
    # A no-grad forward leaves FSDP's root group unsharded unless resharded.
    trainer.token_logprobs(make_batch(seed=3).tokens_BL, temperature=1.0)

    state = trainer.sync_state()
    params = dict(trainer.model.named_parameters())
    buffers = dict(trainer.model.named_buffers())
    assert set(state) == set(params) | set(buffers)
    for name, p in params.items():
        assert state[name] is p  # no copies: the weight sync reads live tensors
        assert isinstance(p, DTensor) and p.dtype == torch.float32, name
    assert buffers and all(b.dtype == torch.float32 for b in buffers.values())
    opt_params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert all(a is b for a, b in zip(opt_params, params.values(), strict=True))


def test_chunked_token_logprobs_match_full_logits_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    hidden_ND = torch.randn(13, 8, generator=g, dtype=torch.float32).requires_grad_()
    weight_VD = torch.randn(32, 8, generator=g, dtype=torch.float32).requires_grad_()
    targets_N = torch.randint(0, 32, (13,), generator=g)
    upstream_N = torch.randn(13, generator=g)

    want_N = torch.log_softmax(F.linear(hidden_ND, weight_VD) / 0.7, dim=-1).gather(-1, targets_N[:, None])[:, 0]
    want_grads = torch.autograd.grad((want_N * upstream_N).sum(), (hidden_ND, weight_VD))
    for chunk in (1, 5, 13, 64):
        got_N = chunked_token_logprobs(hidden_ND, weight_VD, targets_N, temperature=0.7, chunk_tokens=chunk)
        got_grads = torch.autograd.grad((got_N * upstream_N).sum(), (hidden_ND, weight_VD))
        # fp32 throughout: the same ops per row, the weight gradient summed over chunks in another
        # order; 1e-5 is ~100 fp32 steps at these magnitudes (|logprob| ~ 5, |grad| ~ 1).
        torch.testing.assert_close(got_N, want_N, rtol=0, atol=1e-5)
        for got, want in zip(got_grads, want_grads):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_chunked_entropy_matches_a_direct_computation_forward_and_backward():
    g = torch.Generator().manual_seed(1)
    hidden_ND = torch.randn(13, 8, generator=g, dtype=torch.float32).requires_grad_()
    weight_VD = torch.randn(32, 8, generator=g, dtype=torch.float32).requires_grad_()
    targets_N = torch.randint(0, 32, (13,), generator=g)
    up_lp_N, up_ent_N = torch.randn(13, generator=g), torch.randn(13, generator=g)

    p_NV = torch.softmax(F.linear(hidden_ND, weight_VD) / 0.7, dim=-1)
    want_lp_N = p_NV.log().gather(-1, targets_N[:, None])[:, 0]
    want_ent_N = -(p_NV * p_NV.log()).sum(-1)  # H = -sum_v p log p, written out
    want = torch.autograd.grad((want_lp_N * up_lp_N + want_ent_N * up_ent_N).sum(), (hidden_ND, weight_VD))
    for chunk in (1, 5, 64):
        lp_N, ent_N = chunked_token_logprobs_and_entropy(
            hidden_ND, weight_VD, targets_N, temperature=0.7, chunk_tokens=chunk, entropy="grad"
        )
        got = torch.autograd.grad((lp_N * up_lp_N + ent_N * up_ent_N).sum(), (hidden_ND, weight_VD))
        torch.testing.assert_close(ent_N, want_ent_N, rtol=0, atol=1e-5)
        torch.testing.assert_close(lp_N, want_lp_N, rtol=0, atol=1e-5)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # As a metric: the same values, no gradient through them, the logprobs' gradient bit for bit as without.
    lp_N, ent_N = chunked_token_logprobs_and_entropy(hidden_ND, weight_VD, targets_N, temperature=0.7, chunk_tokens=5)
    assert not ent_N.requires_grad
    plain = torch.autograd.grad((chunked_token_logprobs(hidden_ND, weight_VD, targets_N, temperature=0.7,
                                                        chunk_tokens=5) * up_lp_N).sum(), hidden_ND)[0]
    assert torch.equal(torch.autograd.grad((lp_N * up_lp_N).sum(), hidden_ND)[0], plain)


class _LargestFloat32(TorchDispatchMode):
    """Records the most elements of any float32 tensor an op creates."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.numel = max(self.numel, t.numel())
        return out


def test_entropy_metric_of_whole_logits_never_holds_them_in_float32():
    """Batch-invariant mode on CUDA measures entropy from the model's whole bf16 logits: chunk by chunk."""
    logits_BLV = (3 * torch.randn(4, 600, 50, generator=torch.Generator().manual_seed(0))).bfloat16()
    whole = logits_BLV[:, :-1].numel()
    old = _LargestFloat32()
    with torch.no_grad(), old:  # what the trainer did before
        expected_BL = _entropy(torch.log_softmax(logits_BLV[:, :-1].float() / 0.7, -1))
    new = _LargestFloat32()
    with torch.no_grad(), new:
        got_BL = _entropy_of_logits(logits_BLV, 0.7)[:, :-1]
    assert old.numel >= whole  # the recorder sees the whole float32 copy when there is one
    assert new.numel <= 1024 * 50
    torch.testing.assert_close(got_BL, expected_BL, rtol=1e-6, atol=1e-5)  # the same per-row ops


def test_token_logprobs_with_a_mask_compute_only_the_masked_positions(make_trainer):
    batch = make_batch(seed=4)
    trainer = make_trainer(micro_batch_tokens=24, model_config=ModelConfig(dtype="float32"))

    full_BL = trainer.token_logprobs(batch.tokens_BL, temperature=1.0)
    masked_BL = trainer.token_logprobs(batch.tokens_BL, temperature=1.0, mask_BL=batch.loss_mask_BL)

    mask_BL = batch.loss_mask_BL.bool()
    assert torch.equal(masked_BL[~mask_BL], torch.zeros((~mask_BL).sum()))
    # Rows cut to their micro-batch's longest row and regrouped: fp32 sums in other orders only.
    torch.testing.assert_close(masked_BL[mask_BL], full_BL[mask_BL], rtol=0, atol=1e-5)


def test_recompute_runs_without_lora_dropout(make_trainer):
    """pi_old and pi_ref are the policy itself: the no-grad recompute drops nothing, training still does."""
    trainer = make_trainer(model_config=ModelConfig(lora=LoRAConfig(rank=4, dropout=0.5)))
    with torch.no_grad():  # B starts at 0, which would hide the dropout on the adapter's input
        for name, p in trainer.model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(generator=torch.Generator().manual_seed(1))
    tokens_BL = make_batch(seed=0).tokens_BL
    first_BL = trainer.token_logprobs(tokens_BL, temperature=1.0)
    torch.testing.assert_close(trainer.token_logprobs(tokens_BL, temperature=1.0), first_BL, rtol=0, atol=0)
    assert trainer.model.training  # the training forward keeps its dropout
