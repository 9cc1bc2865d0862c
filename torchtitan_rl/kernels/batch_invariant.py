"""Batch-invariant kernels shared by the trainer and the generator.

A token's result must not depend on what else is in the batch, nor on
whether it is computed in a decode step (generator) or inside a full
sequence (trainer). We get that by construction: every reduction a token's
output depends on runs in an order fixed by the token itself, with the same
ops on both sides.

CPU attention keys are zero-padded to a multiple of ``KEY_TILE``
(``padded_len``) of the longest sequence in the call, not to
model.max_seq_len: the same row sees 16 keys in one batch and 272 in another.
That is exact because every reduction over keys assigns a key to the same
accumulator in the same order whatever the padded length, and the keys past a
row's position add exact zeros (masked scores are -inf, exp(-inf) = 0,
0 * v = 0; adding 0 to a partial sum changes no bit): CPU softmax sums lane
by lane (key i in lane i % vector width) and the key sum of ``attention`` is
torch's cascade sum over rows of 4 keys; for any length that is a multiple of
16 neither has a tail handled differently. ``tests/kernels/test_batch_invariant.py``
checks it: the same sequence in batches whose longest member differs gives
the same bits.

CPU:

- Linear: fp32 GEMMs of a fixed shape (64 rows, zero-padded), one per block
  of rows, so the GEMM a row goes through never depends on the batch (a
  test checks every row position of the block gives the same bits).
- Attention (``attention``): elementwise products and torch's reductions over
  contiguous, fixed-layout temporaries, so the reduction order per element
  depends on the head dim and key tile only.
- Single-threaded intra-op: a parallel reduction could split differently
  depending on the tensor's size.

CUDA (vLLM's batch-invariant Triton kernels, compat.batch_invariant_ops;
each output row is reduced by one program in a fixed order, whatever the
number of rows):

- Linear: vLLM's persistent matmul (on Hopper vLLM's aten overrides leave
  mm to cuBLAS, configured through environment variables that only count
  before the process's first matmul, so we call the kernel directly).
- RMSNorm: vLLM's per-row kernel (torch's fused rms_norm makes no promise).
- Attention: our Triton kernel (kernels/paged_attention.py), which the
  generator runs on vLLM's paged KV cache and the trainer on its contiguous
  K/V; no padding.
- Sampled-token logprobs: the trainer calls the kernels of vLLM's GPU
  sampler (``sampler_token_logprobs``): vLLM keeps the processed logits in
  bf16, and a max/log-sum-exp kernel reading bf16 sums in a different order
  than one reading fp32 (measured: 1-ulp differences in 2% of tokens).

The backward passes use ordinary kernels (attention: SDPA, as default mode):
only the forward values must match.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_rl import compat

KEY_TILE = 16
"""Attention keys are padded to a multiple of this (see the module docstring)."""

_ROW_BLOCK = 64  # CPU linear: rows per GEMM, a fixed shape whatever the batch
_CPU_ATTN_ELEMENTS = 1 << 24  # CPU attention: sequences x rows x keys x heads x head_dim per chunk (fp32)


def padded_len(n: int) -> int:
    """Keys an attention call over sequences of at most ``n`` tokens pads to."""
    return max(1, -(-n // KEY_TILE)) * KEY_TILE


def _bi_matmul(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    if x_MK.is_cuda:
        if x_MK.shape[0] == 0:
            return x_MK.new_empty(0, w_NK.shape[0])
        return compat.batch_invariant_ops().matmul_persistent(x_MK, w_NK.t())
    # fp32 GEMMs (products of bf16 values are exact) of shape [_ROW_BLOCK, K] x [K, N]:
    # one per block, the same shape for every row whatever M is.
    M, K = x_MK.shape
    blocks = -(-M // _ROW_BLOCK)
    x = x_MK.new_zeros(blocks * _ROW_BLOCK, K, dtype=torch.float32)
    x[:M] = x_MK
    w_KN = w_NK.float().t()
    out = torch.bmm(x.view(blocks, _ROW_BLOCK, K), w_KN.expand(blocks, K, w_KN.shape[1]))
    return out.view(-1, w_KN.shape[1])[:M].to(x_MK.dtype)


class _BILinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        shape = x.shape
        return _bi_matmul(x.reshape(-1, shape[-1]), weight).view(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        g = grad_out.reshape(-1, weight.shape[0])
        grad_x = (g @ weight).view(x.shape)
        grad_w = g.t() @ x.reshape(-1, x.shape[-1])
        return grad_x, grad_w.to(weight.dtype)


def bi_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _BILinear.apply(x, weight)


def bi_linear_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    assert module.bias is None, "our decoder's linears have no bias"
    return _BILinear.apply(x, module.weight)


class _BIRMSNorm(torch.autograd.Function):
    """CUDA: vLLM's per-row RMSNorm forward; backward through torch's rms_norm."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return compat.batch_invariant_ops().rms_norm_batch_invariant(x, weight, eps)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x_, w_ = x.detach().requires_grad_(), weight.detach().requires_grad_()
            y = F.rms_norm(x_, (x.shape[-1],), w_, ctx.eps)
            grad_x, grad_w = torch.autograd.grad(y, (x_, w_), grad_out)
        return grad_x, grad_w, None


def bi_rms_norm_forward(module: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    assert module.weight is not None, "our decoder's norms have weights"
    eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
    return _BIRMSNorm.apply(x, module.weight, eps)


def attention(q_BRHD: torch.Tensor, k_GBSD: torch.Tensor, v_GBSD: torch.Tensor, positions_BR: torch.Tensor,
              *, scale: float) -> torch.Tensor:
    """CPU: causal attention of B sequences' query rows over their padded keys, batch-invariantly.

    ``k_GBSD``/``v_GBSD`` [kv heads, B, S, head_dim] hold each sequence's
    positions 0..S-1 (S a multiple of ``KEY_TILE``); what lies past a row's
    position is masked and only has to be finite. Query head h reads kv head
    h // (H // G). Row (b, r) attends to positions <= positions_BR[b, r]. A
    row's result depends on its own query, keys and position only: not on B,
    R, S or the other rows.

    Elementwise products and torch's reductions: every temporary is
    contiguous with head_dim innermost, which fixes torch's reduction kernels
    per element: the score sum over head_dim is an inner reduction, the sum
    over keys an outer one (4-way interleaved cascade over keys, vectorised
    across head_dim), softmax sums lane by lane.
    """
    assert not q_BRHD.is_cuda, "CUDA: paged_attention.attention"
    assert k_GBSD.shape[2] % KEY_TILE == 0, f"keys padded to {k_GBSD.shape[2]}, not a multiple of {KEY_TILE}"
    B, R, H, D = q_BRHD.shape
    G, _, S, _ = k_GBSD.shape
    q = q_BRHD.float().reshape(B, R, G, H // G, 1, D)
    k = k_GBSD.float().permute(1, 0, 2, 3).reshape(B, 1, G, 1, S, D)
    v = v_GBSD.float().permute(1, 0, 2, 3).reshape(B, 1, G, 1, S, D)
    scores = (q * k).sum(-1) * scale  # [B, R, G, rep, S]
    keep_BR11S = torch.arange(S, device=q.device) <= positions_BR[:, :, None, None, None]
    probs = torch.softmax(scores.masked_fill(~keep_BR11S, float("-inf")), dim=-1)
    out = (probs[..., None] * v).sum(-2)  # [B, R, G, rep, D]
    return out.reshape(B, R, H, D).to(q_BRHD.dtype)


def seqs_per_chunk(rows_per_seq: int, keys: int, *, heads: int, head_dim: int) -> int:
    """How many sequences one CPU ``attention`` call takes (bounds its fp32 temporaries)."""
    return max(1, _CPU_ATTN_ELEMENTS // (max(rows_per_seq, 1) * keys * heads * head_dim))


class _BIAttention(torch.autograd.Function):
    """Trainer attention: ``attention`` forward; backward through default mode's SDPA, recomputed."""

    @staticmethod
    def forward(ctx, q_BLHD, k_BLGD, v_BLGD, scale, sdpa):
        ctx.save_for_backward(q_BLHD, k_BLGD, v_BLGD)
        ctx.scale, ctx.sdpa = scale, sdpa
        if q_BLHD.is_cuda:
            from torchtitan_rl.kernels.paged_attention import contiguous_attention

            return contiguous_attention(q_BLHD, k_BLGD, v_BLGD, scale=scale)
        B, L, H, D = q_BLHD.shape
        G = k_BLGD.shape[2]
        S = padded_len(L)
        positions = torch.arange(L, device=q_BLHD.device).expand(B, L)
        out = torch.empty_like(q_BLHD)
        step = seqs_per_chunk(L, S, heads=H, head_dim=D)
        for b in range(0, B, step):
            n = min(step, B - b)
            # Keys past L are zeros; those between a row and L are masked.
            k = q_BLHD.new_zeros(G, n, S, D)
            v = torch.zeros_like(k)
            k[:, :, :L] = k_BLGD[b : b + n].permute(2, 0, 1, 3)
            v[:, :, :L] = v_BLGD[b : b + n].permute(2, 0, 1, 3)
            out[b : b + n] = attention(q_BLHD[b : b + n], k, v, positions[b : b + n], scale=scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            out = ctx.sdpa(*inputs, scale=ctx.scale, enable_gqa=q.shape[2] != k.shape[2])
            grads = torch.autograd.grad(out, inputs, grad_out)
        return *grads, None, None


class _SamplerLogprobs(torch.autograd.Function):
    """CUDA: each row's token logprob as vLLM's GPU sampler computes it; backward through fp32 log_softmax."""

    @staticmethod
    def forward(ctx, logits_NV, tokens_N, temperature):
        assert logits_NV.dtype == torch.bfloat16, "vLLM's sampler sees the model's bf16 logits"
        ctx.save_for_backward(logits_NV, tokens_N)
        ctx.temperature = temperature
        apply_temperature, token_logprobs = compat.vllm_sampler_logprob_kernels()
        if temperature in (0.0, 1.0):  # vLLM skips its temperature kernel then
            x = logits_NV.contiguous()
        else:  # in place, rounded to bf16, as vLLM does
            x = logits_NV.clone(memory_format=torch.contiguous_format)
            apply_temperature(x, torch.zeros(x.shape[0], dtype=torch.int32, device=x.device),
                              torch.tensor([temperature], dtype=torch.float32, device=x.device))
        return token_logprobs(x, tokens_N[:, None].contiguous())[:, 0]

    @staticmethod
    def backward(ctx, grad_N):
        logits, tokens = ctx.saved_tensors
        with torch.enable_grad():
            x = logits.detach().requires_grad_()
            lp = torch.log_softmax(x.float() / ctx.temperature, dim=-1).gather(-1, tokens[:, None])[:, 0]
            (grad,) = torch.autograd.grad(lp, x, grad_N)
        return grad, None, None


def sampler_token_logprobs(logits_BLV: torch.Tensor, tokens_BL: torch.Tensor, temperature: float) -> torch.Tensor:
    """CUDA batch-invariant mode: float32 [B, L] log p(tokens_BL[b, l]) from logits_BLV[b, l]."""
    B, L, V = logits_BLV.shape
    return _SamplerLogprobs.apply(logits_BLV.reshape(B * L, V), tokens_BL.reshape(B * L), temperature).view(B, L)


class BatchInvariantAttention(nn.Module):
    """Trainer-side inner attention: full right-padded sequences, causal."""

    def __init__(self) -> None:
        super().__init__()
        from torchtitan.models.common.attention import ScaledDotProductAttention

        # Default mode's attention (backend choice included): it gives the gradients.
        self.sdpa = ScaledDotProductAttention.Config().build()

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, scale: float | None = None, **_unused):
        scale = scale if scale is not None else q_BLNH.shape[-1] ** -0.5
        return _BIAttention.apply(q_BLNH, k_BLNH, v_BLNH, scale, self.sdpa)


def make_batch_invariant(model: nn.Module, *, replace_attention: bool, device: torch.device) -> None:
    """Switch a torchtitan decoder (either family) to the batch-invariant kernels of ``device`` in place."""
    if device.type == "cpu":
        compat.set_num_threads(1)
    else:
        from torchtitan_rl.kernels.paged_attention import check_shape

        attention = model.layers["0"].attention
        check_shape(heads=attention.n_heads, kv_heads=attention.n_kv_heads, head_dim=attention.head_dim)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = bi_linear_forward.__get__(module)
            module.batch_invariant = True  # LoRA adapters added later use these kernels too
        elif isinstance(module, nn.RMSNorm) and device.type == "cuda":
            module.forward = bi_rms_norm_forward.__get__(module)
    if replace_attention:
        for layer in model.layers.values():
            layer.attention.inner_attention = BatchInvariantAttention()
