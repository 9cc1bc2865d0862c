"""Batch-invariant kernels shared by the trainer and the generator.

A token's result must not depend on what else is in the batch, nor on
whether it is computed in a decode step (generator) or inside a full
sequence (trainer). We get that by construction: every reduction a token's
output depends on runs over a fixed length in a fixed order, with the same
ops on both sides.

CPU:

- Linear: fp32 multiply-and-sum over K per row (products of bf16 are exact in
  fp32), so no GEMM blocking that depends on the number of rows.
- Attention: each sequence's keys/values are zero-padded to one fixed length
  (model.max_seq_len) and reduced with elementwise ops; masked positions
  contribute exact zeros.
- Single-threaded intra-op: a parallel reduction could split differently
  depending on the tensor's size.

CUDA (vLLM's batch-invariant Triton kernels, compat.batch_invariant_ops;
each output row is reduced by one program in a fixed order, whatever the
number of rows):

- Linear: vLLM's persistent matmul (on Hopper vLLM's aten overrides leave
  mm to cuBLAS, configured through environment variables that only count
  before the process's first matmul, so we call the kernel directly).
- RMSNorm: vLLM's per-row kernel (torch's fused rms_norm makes no promise).
- Attention (``attend_mm``): the same fixed padded length, as two batched
  matmuls: q @ K^T, then exp(scores - max) @ [V, 1] (numerator and softmax
  denominator from the same kernel, so no sum reduction whose split could
  depend on the number of rows).
- Sampled-token logprobs: the trainer calls the kernels of vLLM's GPU
  sampler (``sampler_token_logprobs``): vLLM keeps the processed logits in
  bf16, and a max/log-sum-exp kernel reading bf16 sums in a different order
  than one reading fp32 (measured: 1-ulp differences in 2% of tokens).

The backward passes use ordinary kernels: only the forward values must match.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_rl import compat

_ROW_CHUNK = 256  # CPU rows per chunk: bounds the (rows, N, K) fp32 temporary
_ATTN_ROWS = 16384  # CUDA attention: sequences x query rows per chunk (scores: H x this x max_len fp32)
_ATTN_KEYS = 128 * 1024  # CUDA attention: sequences x max_len per chunk (padded fp32 K/V)


def _bi_matmul(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    if x_MK.is_cuda:
        if x_MK.shape[0] == 0:
            return x_MK.new_empty(0, w_NK.shape[0])
        return compat.batch_invariant_ops().matmul_persistent(x_MK, w_NK.t())
    w = w_NK.float()
    out = [
        (x_MK[i : i + _ROW_CHUNK].float()[:, None, :] * w[None]).sum(-1)
        for i in range(0, x_MK.shape[0], _ROW_CHUNK)
    ]
    return torch.cat(out).to(x_MK.dtype)


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
    assert module.bias is None, "Qwen3 linears have no bias"
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
    assert module.weight is not None, "Qwen3 norms have weights"
    eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
    return _BIRMSNorm.apply(x, module.weight, eps)


def attend(q_RHD: torch.Tensor, k_SHD: torch.Tensor, v_SHD: torch.Tensor, positions_R: torch.Tensor,
           *, max_len: int, scale: float) -> torch.Tensor:
    """CPU: causal attention of R query rows over one sequence's keys, batch-invariantly.

    ``k_SHD``/``v_SHD`` hold positions 0..S-1 of the sequence (S <= max_len,
    kv heads already expanded to the query heads); row r attends to
    positions <= positions_R[r].
    """
    S, H, D = k_SHD.shape
    assert S <= max_len, f"sequence of {S} tokens exceeds max_len {max_len}"
    k = torch.zeros(max_len, H, D, dtype=torch.float32, device=k_SHD.device)
    v = torch.zeros_like(k)
    k[:S], v[:S] = k_SHD.float(), v_SHD.float()
    scores_RHS = (q_RHD.float()[:, :, None, :] * k.transpose(0, 1)[None]).sum(-1) * scale
    keep = torch.arange(max_len, device=q_RHD.device)[None, :] <= positions_R[:, None]
    scores_RHS = scores_RHS.masked_fill(~keep[:, None, :], float("-inf"))
    probs_RHS = torch.softmax(scores_RHS, dim=-1)
    out_RHD = (probs_RHS[..., None] * v.transpose(0, 1)[None]).sum(-2)
    return out_RHD.to(q_RHD.dtype)


def attend_mm(q_BRHD: torch.Tensor, k_GBSD: torch.Tensor, v_GBSD: torch.Tensor, positions_BR: torch.Tensor,
              *, scale: float) -> torch.Tensor:
    """CUDA: causal attention of B sequences' query rows over their padded keys, batch-invariantly.

    ``k_GBSD``/``v_GBSD`` [kv heads, B, S, head_dim] hold each sequence's
    positions 0..S-1, exact zeros past its end (S: the fixed padded length);
    query head h reads kv head h // (H // G). Row (b, r) attends to positions
    <= positions_BR[b, r]. Both matmuls run in fp32 (tf32 products of
    bf16-valued inputs are exact) with vLLM's batch-invariant bmm: a row's
    result does not depend on B, R or which other rows share its tile.
    """
    bmm = compat.batch_invariant_ops().bmm_batch_invariant
    B, R, H, D = q_BRHD.shape
    G, _, S, _ = k_GBSD.shape
    rep = H // G
    # Rows of one kv head's batch entry: (query head in group, row).
    q_NMD = q_BRHD.float().reshape(B, R, G, rep, D).permute(2, 0, 3, 1, 4).reshape(G * B, rep * R, D)
    k_NSD = k_GBSD.to(torch.float32, memory_format=torch.contiguous_format).view(G * B, S, D)
    v1_GBSE = torch.ones(G, B, S, D + 1, dtype=torch.float32, device=q_BRHD.device)
    v1_GBSE[..., :D] = v_GBSD
    scores = bmm(q_NMD, k_NSD.transpose(1, 2)).view(G, B, rep, R, S)
    scores.mul_(scale)
    keep_B1RS = torch.arange(S, device=q_BRHD.device) <= positions_BR[:, None, :, None]
    scores.masked_fill_(~keep_B1RS, float("-inf"))
    scores.sub_(scores.amax(-1, keepdim=True)).exp_()  # max is exact in any order
    num_NME = bmm(scores.view(G * B, rep * R, S), v1_GBSE.view(G * B, S, D + 1))
    out_NMD = num_NME[..., :D] / num_NME[..., D:]
    return out_NMD.reshape(G, B, rep, R, D).permute(1, 3, 0, 2, 4).reshape(B, R, H, D).to(q_BRHD.dtype)


def seqs_per_chunk(rows_per_seq: int, max_len: int) -> int:
    """CUDA: how many sequences ``attend_mm`` takes at once (bounds its fp32 temporaries)."""
    return max(1, min(_ATTN_ROWS // max(rows_per_seq, 1), _ATTN_KEYS // max_len))


def _reference_attention(q_BLHD, k_BLGD, v_BLGD, scale):
    """Plain causal attention (fp32), differentiable: the CUDA backward recomputes through it."""
    B, L, H, D = q_BLHD.shape
    G = k_BLGD.shape[2]

    def expand(t_BLGD):  # a view, so the backward is a plain sum (repeat_interleave's is index_add)
        return t_BLGD.float()[:, :, :, None].expand(B, L, G, H // G, D).reshape(B, L, H, D).transpose(1, 2)

    q, k, v = q_BLHD.float().transpose(1, 2), expand(k_BLGD), expand(v_BLGD)
    scores = (q @ k.transpose(-1, -2)) * scale
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return (probs @ v).transpose(1, 2).to(q_BLHD.dtype)


class _BIAttention(torch.autograd.Function):
    """CUDA trainer attention: ``attend_mm`` forward, backward by recomputing plain attention."""

    @staticmethod
    def forward(ctx, q_BLHD, k_BLGD, v_BLGD, max_len, scale):
        ctx.save_for_backward(q_BLHD, k_BLGD, v_BLGD)
        ctx.scale = scale
        B, L, H, D = q_BLHD.shape
        G = k_BLGD.shape[2]
        assert L <= max_len, f"sequence of {L} tokens exceeds max_len {max_len}"
        positions = torch.arange(L, device=q_BLHD.device).expand(B, L)
        out = torch.empty_like(q_BLHD)
        step = seqs_per_chunk(L, max_len)
        for b in range(0, B, step):
            n = min(step, B - b)
            k = torch.zeros(G, n, max_len, D, dtype=torch.float32, device=q_BLHD.device)
            v = torch.zeros_like(k)
            k[:, :, :L] = k_BLGD[b : b + n].permute(2, 0, 1, 3)
            v[:, :, :L] = v_BLGD[b : b + n].permute(2, 0, 1, 3)
            out[b : b + n] = attend_mm(q_BLHD[b : b + n], k, v, positions[b : b + n], scale=scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            out = _reference_attention(*inputs, ctx.scale)
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


def expand_kv(k_SHD: torch.Tensor, n_heads: int) -> torch.Tensor:
    """GQA: kv head j serves query heads j*rep .. (j+1)*rep-1."""
    return k_SHD.repeat_interleave(n_heads // k_SHD.shape[1], dim=1)


class BatchInvariantAttention(nn.Module):
    """Trainer-side inner attention: full right-padded sequences, causal."""

    def __init__(self, *, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, scale: float | None = None, **_unused):
        B, L, H, D = q_BLNH.shape
        scale = scale if scale is not None else D**-0.5
        if q_BLNH.is_cuda:
            return _BIAttention.apply(q_BLNH, k_BLNH, v_BLNH, self.max_len, scale)
        positions = torch.arange(L, device=q_BLNH.device)
        return torch.stack(
            [
                attend(q_BLNH[b], expand_kv(k_BLNH[b], H), expand_kv(v_BLNH[b], H), positions,
                       max_len=self.max_len, scale=scale)
                for b in range(B)
            ]
        )


def make_batch_invariant(model: nn.Module, *, max_len: int, replace_attention: bool, device: torch.device) -> None:
    """Switch a torchtitan Qwen3 to the batch-invariant kernels of ``device`` in place."""
    if device.type == "cpu":
        torch.set_num_threads(1)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = bi_linear_forward.__get__(module)
            module.batch_invariant = True  # LoRA adapters added later use these kernels too
        elif isinstance(module, nn.RMSNorm) and device.type == "cuda":
            module.forward = bi_rms_norm_forward.__get__(module)
    if replace_attention:
        for layer in model.layers.values():
            layer.attention.inner_attention = BatchInvariantAttention(max_len=max_len)
