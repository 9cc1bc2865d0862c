"""Batch-invariant CPU kernels shared by the trainer and the generator.

A token's result must not depend on what else is in the batch, nor on
whether it is computed in a decode step (generator) or inside a full
sequence (trainer). On CPU we get that by construction: every reduction a
token's output depends on runs over a fixed length in a fixed order, with
the same ops on both sides.

- Linear: fp32 multiply-and-sum over K per row (products of bf16 are exact in
  fp32), so no GEMM blocking that depends on the number of rows.
- Attention: each sequence's keys/values are zero-padded to one fixed length
  (the generator's max_model_len) and reduced with elementwise ops; masked
  positions contribute exact zeros.
- Single-threaded intra-op: a parallel reduction could split differently
  depending on the tensor's size.

The backward passes use ordinary kernels: only the forward values must match.
On GPU, vLLM's batch-invariant kernels do this job instead (compat).
"""

import torch
import torch.nn as nn

_ROW_CHUNK = 256  # rows per chunk: bounds the (rows, N, K) fp32 temporary


def _bi_matmul(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
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


def attend(q_RHD: torch.Tensor, k_SHD: torch.Tensor, v_SHD: torch.Tensor, positions_R: torch.Tensor,
           *, max_len: int, scale: float) -> torch.Tensor:
    """Causal attention of R query rows over one sequence's keys, batch-invariantly.

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
        positions = torch.arange(L, device=q_BLNH.device)
        return torch.stack(
            [
                attend(q_BLNH[b], expand_kv(k_BLNH[b], H), expand_kv(v_BLNH[b], H), positions,
                       max_len=self.max_len, scale=scale)
                for b in range(B)
            ]
        )


def make_batch_invariant(model: nn.Module, *, max_len: int, replace_attention: bool) -> None:
    """Switch a torchtitan Qwen3 to the batch-invariant CPU kernels in place."""
    torch.set_num_threads(1)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = bi_linear_forward.__get__(module)
            module.batch_invariant = True  # LoRA adapters added later use these kernels too
    if replace_attention:
        for layer in model.layers.values():
            layer.attention.inner_attention = BatchInvariantAttention(max_len=max_len)
