"""token_logprobs and sync_state: what the trainer computes with and exposes."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan_rl.models.shape import build_titan_model

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
