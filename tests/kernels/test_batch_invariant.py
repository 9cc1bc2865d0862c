"""Batch-invariant kernels: a row's result depends on nothing but the row.

Not on the other rows of the batch, not on where it sits among them, and (CPU
attention) not on how far the batch pads attention keys (a multiple of
KEY_TILE of its longest sequence): the trainer and the generator pad the same
sequence to different lengths. The CUDA attention kernel: test_paged_attention.py.
"""

import pytest
import torch

from torchtitan_rl import compat
from torchtitan_rl.config.job_config import ModelConfig, TrainerConfig
from torchtitan_rl.kernels import batch_invariant as bi
from torchtitan_rl.trainer import Trainer

from tests.helpers import tiny_shape

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def one_thread():
    """Batch-invariant mode runs torch single-threaded on CPU; restored for the other tests."""
    threads = torch.get_num_threads()
    compat.set_num_threads(1)
    yield
    compat.set_num_threads(threads)


def _randn(*shape, g, device):
    """bf16 values held in fp32: the kernels then return their fp32 result, which
    shows a last-bit difference that rounding to bf16 would mostly hide."""
    return torch.randn(*shape, generator=g).to(torch.bfloat16).to(device, torch.float32)


# The two largest cases are most of this test's time: in the full suite only (-m "not slow" stays quick).
@pytest.mark.parametrize("heads,kv_heads,head_dim,n", [
    pytest.param(*shape, n, marks=[pytest.mark.slow] if shape[2] == 128 and n > 6 else [])
    for n in (6, 37, 70) for shape in ((2, 1, 16), (4, 2, 32), (12, 4, 80), (16, 8, 128))])
def test_cpu_attention_rows_do_not_depend_on_padding_batch_or_decode(heads, kv_heads, head_dim, n):
    # Sensitive: with keys padded to the exact length (KEY_TILE = 1) torch's
    # CPU softmax and key sum differ in the last bit for some of these rows.
    # (CUDA: test_paged_attention.py.)
    device = "cpu"
    g = torch.Generator().manual_seed(n)
    q_LHD = _randn(n, heads, head_dim, g=g, device=device)  # one sequence: positions 0..n-1
    k_GLD, v_GLD = (_randn(kv_heads, n, head_dim, g=g, device=device) for _ in range(2))

    def run(rows: list[int], keys: int, *, others: int = 0, garbage: bool = False) -> torch.Tensor:
        """Our sequence's rows, last of 1 + others sequences, keys padded to ``keys``."""
        B = 1 + others
        q = _randn(B, len(rows), heads, head_dim, g=g, device=device)
        q[-1] = q_LHD[rows]
        # Past the sequence: zeros (the generator) or other tokens' keys (the trainer's pad tokens).
        k, v = (_randn(kv_heads, B, keys, head_dim, g=g, device=device) for _ in range(2))
        if not garbage:
            k[:, -1], v[:, -1] = 0, 0
        m = min(n, keys)
        k[:, -1, :m], v[:, -1, :m] = k_GLD[:, :m], v_GLD[:, :m]
        positions = torch.randint(0, keys, (B, len(rows)), generator=g).to(device)
        positions[-1] = torch.tensor(rows)
        return bi.attention(q, k, v, positions, scale=head_dim**-0.5)[-1]

    whole = run(list(range(n)), bi.padded_len(n))  # as the trainer, alone
    for keys in (bi.padded_len(n) + bi.KEY_TILE, bi.padded_len(n) + 3 * bi.KEY_TILE, 1024):
        for others, garbage in ((0, False), (5, True)):
            assert torch.equal(run(list(range(n)), keys, others=others, garbage=garbage), whole), (keys, others)
    for p in range(n):  # as the generator, one decode row per step, keys padded to the step's longest
        for keys in {bi.padded_len(p + 1), bi.padded_len(n), bi.padded_len(n + 20), 512}:
            assert torch.equal(run([p], keys, others=3)[0], whole[p]), (p, keys)
    rows = [n - 1, n // 2, 0]  # a prefill chunk, rows in any order
    assert torch.equal(run(rows, bi.padded_len(n) + bi.KEY_TILE, others=2), whole[rows])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_features,in_features", [(192, 64), (16, 64), (1024, 3072)])
def test_linear_rows_do_not_depend_on_their_batch_or_position(device, out_features, in_features):
    g = torch.Generator().manual_seed(1)
    # CPU: fp32 shows the GEMM's last bit; CUDA: bf16 runs the kernel config the model uses.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    w = _randn(out_features, in_features, g=g, device=device).to(dtype)
    row = _randn(1, in_features, g=g, device=device).to(dtype)
    want = bi.bi_linear(row, w)[0]
    for rows in (2, 7, 130):
        for pos in range(rows if rows < 130 else 128):  # every position of a row block
            x = _randn(rows, in_features, g=g, device=device).to(dtype)
            x[pos] = row[0]
            assert torch.equal(bi.bi_linear(x, w)[pos], want), (rows, pos)


def test_trainer_logprobs_do_not_depend_on_the_longest_sequence_in_the_batch(tmp_path):
    trainer = Trainer(TrainerConfig(micro_batch_size=8), model_config=ModelConfig(max_seq_len=64),
                      shape=tiny_shape(), seed=0, device=torch.device("cpu"), output_dir=tmp_path,
                      batch_invariant=True)
    g = torch.Generator().manual_seed(2)
    short = torch.randint(1, 16, (10,), generator=g)
    alone = trainer.token_logprobs(short[None], temperature=1.0)[0]  # keys padded to 16
    for longest in (17, 40, 64):  # 32, 48, 64 keys
        batch = torch.zeros(3, longest, dtype=torch.long)
        batch[0, :10] = short
        batch[1] = torch.randint(1, 16, (longest,), generator=g)
        batch[2, :5] = short[:5]
        together = trainer.token_logprobs(batch, temperature=1.0)
        assert torch.equal(together[0, :10], alone), longest
        assert torch.equal(together[2, :5], alone[:5]), longest


@pytest.mark.parametrize("device", DEVICES)
def test_trainer_attention_matches_sdpa_and_takes_its_gradients(device):
    from torchtitan.models.common.attention import ScaledDotProductAttention

    g = torch.Generator().manual_seed(3)
    q = _randn(3, 21, 4, 32, g=g, device=device).bfloat16().requires_grad_()
    k, v = (_randn(3, 21, 2, 32, g=g, device=device).bfloat16().requires_grad_() for _ in range(2))
    grad_out = _randn(3, 21, 4, 32, g=g, device=device).bfloat16()
    sdpa = ScaledDotProductAttention.Config().build()

    got = bi.BatchInvariantAttention()(q, k, v, scale=0.2)
    got_grads = torch.autograd.grad(got, (q, k, v), grad_out)
    want = sdpa(q, k, v, scale=0.2, enable_gqa=True)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)

    # bf16 outputs of O(1) (|v| <= ~3): one bf16 step is <= 2^-7 = 8e-3; 2e-2 allows the two sums' roundings.
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
    for a, b in zip(got_grads, want_grads):
        if device == "cpu":
            assert torch.equal(a, b)
        else:  # flash backward accumulates with atomics outside deterministic mode
            torch.testing.assert_close(a, b)
