"""Token logprobs from the final hidden states, a chunk of tokens at a time: no [B, L, V] logits.

The plain path (``log_softmax(lm_head(h).float() / T).gather(token)``) holds a
micro-batch's logits three to five times over ([32, 280, 151936]: 2.7 GB in
bf16, 5.4 GB per fp32 copy), and its elementwise passes over them cost more
than the lm_head matmul itself. Here the lm_head matmul and the log-softmax run
over ``chunk_tokens`` rows at a time; the forward keeps only the hidden states
(autograd saves those anyway) and the backward recomputes each chunk's logits
(one more [chunk, D] x [D, V] matmul) to form their gradient, which it turns
into the hidden-state and weight gradients at once. Peak extra memory: one
chunk's logits and their gradient.

Per chunk the ops are the plain path's: bf16 logits, cast to fp32, divided by
the temperature, log_softmax, gather. A row's value can differ from the plain
path only where the matmul's kernel depends on how many rows it is given
(the chunk vs the whole micro-batch), i.e. by bf16 rounding of a logit.
Batch-invariant mode does not use this module (the trainer keeps its plain,
bitwise-checked path there).

With ``compile=True`` (CUDA) the per-chunk elementwise work (cast, scale,
log-softmax, gather; in backward softmax minus one-hot) is fused by
torch.compile into a few passes over the bf16 logits, where eager runs about
ten passes over fp32 copies.
"""

import functools

import torch
import torch.nn.functional as F
from torch import Tensor


def _chunk_logprobs(logits_CV: Tensor, targets_C: Tensor, temperature: float) -> Tensor:
    """float32 [C]: log softmax(logits / T)[target], as vLLM's sampler (fp32 logits, then temperature)."""
    logprobs_CV = torch.log_softmax(logits_CV.float() / temperature, dim=-1)
    return logprobs_CV.gather(-1, targets_C[:, None]).squeeze(-1)


def _chunk_grad_logits(logits_CV: Tensor, targets_C: Tensor, grad_C: Tensor, temperature: float) -> Tensor:
    """d(sum_c grad_c * logprob_c) / d logits, in the logits' dtype (what autograd gives the plain path)."""
    probs_CV = torch.softmax(logits_CV.float() / temperature, dim=-1)
    onehot_CV = torch.arange(logits_CV.shape[-1], device=logits_CV.device) == targets_C[:, None]
    grad_CV = (onehot_CV.float() - probs_CV) * (grad_C.float()[:, None] / temperature)
    return grad_CV.to(logits_CV.dtype)


def _chunk_logprobs_entropy(logits_CV: Tensor, targets_C: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """``_chunk_logprobs`` and the entropy -sum p log p of each row's tempered distribution, from one log-softmax."""
    logprobs_CV = torch.log_softmax(logits_CV.float() / temperature, dim=-1)
    entropy_C = -(logprobs_CV.exp() * logprobs_CV).sum(-1)
    return logprobs_CV.gather(-1, targets_C[:, None]).squeeze(-1), entropy_C


def _chunk_grad_logits_entropy(
    logits_CV: Tensor, targets_C: Tensor, grad_C: Tensor, grad_entropy_C: Tensor, temperature: float
) -> Tensor:
    """``_chunk_grad_logits`` plus the entropy's: dH/dz = -p (log p + H), z = logits / T."""
    logprobs_CV = torch.log_softmax(logits_CV.float() / temperature, dim=-1)
    probs_CV = logprobs_CV.exp()
    entropy_C1 = -(probs_CV * logprobs_CV).sum(-1, keepdim=True)
    onehot_CV = torch.arange(logits_CV.shape[-1], device=logits_CV.device) == targets_C[:, None]
    grad_CV = (onehot_CV.float() - probs_CV) * grad_C.float()[:, None]
    grad_CV = grad_CV - probs_CV * (logprobs_CV + entropy_C1) * grad_entropy_C.float()[:, None]
    return (grad_CV / temperature).to(logits_CV.dtype)


@functools.cache
def _kernels(compiled: bool):
    fns = (_chunk_logprobs, _chunk_grad_logits, _chunk_logprobs_entropy, _chunk_grad_logits_entropy)
    if not compiled:
        return fns
    # dynamic: the last chunk of a micro-batch is shorter; one graph for every length.
    return tuple(torch.compile(fn, dynamic=True) for fn in fns)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_N, temperature, chunk_tokens, compile, entropy):
        """entropy: "off" (an empty second output), "metric" (computed, no gradient) or "grad"."""
        logprobs_fn, _, both_fn, _ = _kernels(compile)
        out_N = hidden_ND.new_empty(hidden_ND.shape[0], dtype=torch.float32)
        ent_N = hidden_ND.new_empty(hidden_ND.shape[0] if entropy != "off" else 0, dtype=torch.float32)
        for start in range(0, hidden_ND.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logits_CV = F.linear(hidden_ND[rows], weight_VD)
            if entropy == "off":
                out_N[rows] = logprobs_fn(logits_CV, targets_N[rows], temperature)
            else:
                out_N[rows], ent_N[rows] = both_fn(logits_CV, targets_N[rows], temperature)
        ctx.save_for_backward(hidden_ND, weight_VD, targets_N)
        ctx.temperature, ctx.chunk_tokens, ctx.compile, ctx.entropy = temperature, chunk_tokens, compile, entropy
        if entropy != "grad":
            ctx.mark_non_differentiable(ent_N)
        return out_N, ent_N

    @staticmethod
    def backward(ctx, grad_N, grad_ent_N):
        hidden_ND, weight_VD, targets_N = ctx.saved_tensors
        _, grad_fn, _, grad_entropy_fn = _kernels(ctx.compile)
        with_entropy = ctx.entropy == "grad" and grad_ent_N is not None
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden_ND) if want_hidden else None
        # fp32 accumulator: each chunk's bf16 product is rounded once, the sum over chunks is not.
        grad_weight = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device) if want_weight else None
        for start in range(0, hidden_ND.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            h_CD = hidden_ND[rows]
            if with_entropy:
                g_CV = grad_entropy_fn(F.linear(h_CD, weight_VD), targets_N[rows], grad_N[rows], grad_ent_N[rows],
                                       ctx.temperature)
            else:
                g_CV = grad_fn(F.linear(h_CD, weight_VD), targets_N[rows], grad_N[rows], ctx.temperature)
            if want_hidden:
                grad_hidden[rows] = g_CV @ weight_VD
            if want_weight:
                grad_weight += (g_CV.t() @ h_CD).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight_VD.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def chunked_token_logprobs(
    hidden_ND: Tensor,
    weight_VD: Tensor,
    targets_N: Tensor,
    *,
    temperature: float,
    chunk_tokens: int,
    compile: bool = False,
) -> Tensor:
    """float32 [N]: log p(targets_N[n]) under logits ``hidden_ND[n] @ weight_VD.T`` at ``temperature``.

    hidden_ND: the decoder's final (normed) hidden states of the positions
    that predict the targets; weight_VD: the lm_head weight, in the compute
    dtype. Differentiable in both; memory for logits is one chunk's.
    """
    return chunked_token_logprobs_and_entropy(
        hidden_ND, weight_VD, targets_N, temperature=temperature, chunk_tokens=chunk_tokens, compile=compile,
        entropy="off",
    )[0]


def chunked_token_logprobs_and_entropy(
    hidden_ND: Tensor,
    weight_VD: Tensor,
    targets_N: Tensor,
    *,
    temperature: float,
    chunk_tokens: int,
    compile: bool = False,
    entropy: str = "metric",
) -> tuple[Tensor, Tensor]:
    """``chunked_token_logprobs`` and float32 [N] entropies of the same tempered distributions, from
    the same chunk of logits (no second pass). entropy "grad" makes them differentiable (an entropy
    bonus); "metric" computes them without gradient; "off" returns an empty tensor."""
    assert chunk_tokens > 0, chunk_tokens
    assert hidden_ND.dim() == 2 and targets_N.shape == hidden_ND.shape[:1], (hidden_ND.shape, targets_N.shape)
    assert entropy in ("off", "metric", "grad"), entropy
    return _ChunkedTokenLogprobs.apply(hidden_ND, weight_VD, targets_N, temperature, chunk_tokens, compile, entropy)


def score_positions(tokens_BL: torch.Tensor, mask_BL: torch.Tensor | None) -> torch.Tensor:
    """CPU bool [B, L]: the positions whose logprob is computed (mask_BL, else all but column 0)."""
    if mask_BL is not None:
        assert mask_BL.shape == tokens_BL.shape, (mask_BL.shape, tokens_BL.shape)
        assert not mask_BL[:, 0].any(), "position 0 has no logprob"
        return mask_BL.bool().cpu()
    score_BL = torch.ones(tokens_BL.shape, dtype=torch.bool)
    score_BL[:, 0] = False
    return score_BL


def token_entropy(x_BLV: torch.Tensor, to_logprobs=None, chunk: int = 1024) -> torch.Tensor:
    """[B, L] float32: -sum_v p log p of each position's distribution, log p = ``to_logprobs(x)`` (default:
    ``x`` holds log-probabilities already). Without autograd, ``chunk`` positions at a time: a metric must not
    add whole [B, L, V] buffers (a float32 copy of bf16 logits, p log p) to the peak."""
    to_logprobs = to_logprobs or identity
    if torch.is_grad_enabled():  # the entropy bonus: autograd keeps the log-probabilities anyway
        logprobs_BLV = to_logprobs(x_BLV)
        return -(logprobs_BLV.exp() * logprobs_BLV).sum(-1)
    flat_NV = x_BLV.flatten(0, 1)  # a view when x is contiguous (logits, log-probabilities)
    out_N = torch.empty(flat_NV.shape[0], dtype=torch.float32, device=flat_NV.device)
    for start in range(0, flat_NV.shape[0], chunk):
        logprobs_CV = to_logprobs(flat_NV[start : start + chunk])
        out_N[start : start + chunk] = -(logprobs_CV.exp() * logprobs_CV).sum(-1)
    return out_N.view(x_BLV.shape[:-1])


def entropy_of_logits(logits_BLV: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, L] float32 entropy of softmax(logits / temperature), chunked as ``token_entropy`` (batch-invariant mode
    on CUDA: never a whole float32 copy of the logits)."""
    return token_entropy(logits_BLV, lambda z: torch.log_softmax(z.float() / temperature, -1))


def identity(x: torch.Tensor) -> torch.Tensor:
    return x
