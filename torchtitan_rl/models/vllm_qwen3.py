"""torchtitan's Qwen3, run by vLLM.

The generator runs the trainer's own model definition: same modules, same
parameter names, same op sequence. Only the inner attention is swapped for
vLLM's paged attention (vLLM owns the KV cache). Because the linear layers
are torchtitan's plain ``nn.Linear``, vLLM's CPU backend does not repack them,
so writing a parameter in place changes what the generator computes.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn

from torchtitan_rl import compat
from torchtitan_rl.config import LoRAConfig
from torchtitan_rl.models.lora import apply_lora
from torchtitan_rl.models.qwen3 import TITAN_ARCH, Qwen3Shape, titan_config
from torchtitan_rl.weight_sync.plan import Destination

LORA_KEY = "torchtitan_rl_lora"
"""hf_overrides key: LoRAConfig fields when the generator applies adapters unmerged."""

BATCH_INVARIANT_KEY = "torchtitan_rl_batch_invariant"
"""hf_overrides key: > 0 switches the generator's model to the batch-invariant
kernels (models/batch_invariant.py), whose attention pads every sequence to
this length (model.max_seq_len, the same length the trainer pads to)."""


class PagedAttention(nn.Module):
    """Stands in for torchtitan's inner attention; vLLM's layer keeps the KV cache.

    In batch-invariant mode (``bi_max_len`` set) it keeps its own copy of
    each token's K/V by vLLM's slot mapping and attends with the same
    fixed-length kernel the trainer uses (models/batch_invariant.py): on CPU
    ``attend`` per sequence, on CUDA ``attend_mm`` over chunks of sequences.
    """

    def __init__(self, *, shape: Qwen3Shape, cache_config, prefix: str, bi_max_len: int | None = None) -> None:
        super().__init__()
        self.attn = compat.vllm_attention_cls()(
            num_heads=shape.num_attention_heads,
            head_size=shape.head_dim,
            scale=shape.head_dim**-0.5,
            num_kv_heads=shape.num_key_value_heads,
            cache_config=cache_config,
            prefix=prefix,
        )
        self.layer_name = prefix
        self.block_size = cache_config.block_size
        self.bi_max_len = bi_max_len
        self.scale = shape.head_dim**-0.5
        self._kv_slots: torch.Tensor | None = None  # CPU: [slots, 2, n_kv, head_dim]
        self._kv_rows: torch.Tensor | None = None  # CUDA: [2, n_kv, rows, head_dim], row = slot + 2

    def forward(self, q_BLNH, k_BLNH, v_BLNH, **_unused) -> torch.Tensor:
        B, L, N, H = q_BLNH.shape
        if self.bi_max_len is not None:
            bi = self._batch_invariant_cuda if q_BLNH.is_cuda else self._batch_invariant
            return bi(q_BLNH[0], k_BLNH[0], v_BLNH[0]).view(B, L, N, H)
        out_TD = self.attn(
            q_BLNH.reshape(B * L, N * H),
            k_BLNH.reshape(B * L, -1),
            v_BLNH.reshape(B * L, -1),
        )
        return out_TD[: B * L].view(B, L, N, H)

    def _metadata(self):
        """This layer's attention metadata for the current forward (None when profiling)."""
        from vllm.forward_context import get_forward_context

        md = get_forward_context().attn_metadata
        return md.get(self.layer_name) if isinstance(md, dict) else None

    def _batch_invariant(self, q_TNH, k_TKH, v_TKH) -> torch.Tensor:
        from torchtitan_rl.models.batch_invariant import attend, expand_kv

        out = torch.zeros_like(q_TNH)
        md = self._metadata()
        if md is None:  # vLLM's profiling run: no sequences, nothing to attend to
            return out
        T = md.num_actual_tokens
        slots = md.slot_mapping[:T].long()
        needed = int(slots.max()) + 1
        if self._kv_slots is None or self._kv_slots.shape[0] < needed:
            grown = torch.zeros(max(needed, 2 * (0 if self._kv_slots is None else self._kv_slots.shape[0])),
                                2, *k_TKH.shape[1:], dtype=k_TKH.dtype, device=k_TKH.device)
            if self._kv_slots is not None:
                grown[: self._kv_slots.shape[0]] = self._kv_slots
            self._kv_slots = grown
        self._kv_slots[slots, 0] = k_TKH[:T]
        self._kv_slots[slots, 1] = v_TKH[:T]
        starts = md.query_start_loc.tolist()
        for i, seq_len in enumerate(md.seq_lens.tolist()[: len(starts) - 1]):
            q0, q1 = starts[i], starts[i + 1]
            if q1 == q0:
                continue
            pos = torch.arange(seq_len, device=q_TNH.device)
            seq_slots = md.block_table[i, pos // self.block_size].long() * self.block_size + pos % self.block_size
            kv = self._kv_slots[seq_slots]
            positions = torch.arange(seq_len - (q1 - q0), seq_len, device=q_TNH.device)
            out[q0:q1] = attend(
                q_TNH[q0:q1], expand_kv(kv[:, 0], q_TNH.shape[1]), expand_kv(kv[:, 1], q_TNH.shape[1]),
                positions, max_len=self.bi_max_len, scale=self.scale,
            )
        return out

    def _batch_invariant_cuda(self, q_TNH, k_TKH, v_TKH) -> torch.Tensor:
        from torchtitan_rl.models.batch_invariant import attend_mm

        out = torch.zeros_like(q_TNH)
        md = self._metadata()
        if md is None:  # vLLM's profiling run: no sequences, nothing to attend to
            return out
        plan = _bi_plan(md, max_len=self.bi_max_len, block_size=self.block_size)
        if self._kv_rows is None or self._kv_rows.shape[2] < plan.rows_needed:
            have = 0 if self._kv_rows is None else self._kv_rows.shape[2]
            grown = k_TKH.new_zeros(2, k_TKH.shape[1], max(plan.rows_needed, have + have // 4), k_TKH.shape[2])
            if have:
                grown[:, :, :have] = self._kv_rows
            self._kv_rows = grown
        T = plan.rows_T.shape[0]
        self._kv_rows[0][:, plan.rows_T] = k_TKH[:T].transpose(0, 1)
        self._kv_rows[1][:, plan.rows_T] = v_TKH[:T].transpose(0, 1)
        for c in plan.chunks:
            kv = self._kv_rows[:, :, c.kv_rows]  # [2, n_kv, seqs, max_len, head_dim], zeros past each end
            out_BRNH = attend_mm(q_TNH[c.q_index], kv[0], kv[1], c.positions, scale=self.scale)
            out[c.out_index] = out_BRNH.flatten(0, 1)[c.real]
        return out


@dataclass
class _Chunk:
    q_index: torch.Tensor
    """[seqs, rows] token index of each query row (a shorter sequence repeats its last row)."""
    positions: torch.Tensor
    """[seqs, rows] position of each query row in its sequence."""
    kv_rows: torch.Tensor
    """[seqs, max_len] store row of positions 0..max_len-1 (0, the zero row, past the end)."""
    real: torch.Tensor
    """Indices of the real rows among the flattened [seqs * rows]."""
    out_index: torch.Tensor
    """Token index of each real row."""


@dataclass
class _Plan:
    rows_T: torch.Tensor
    """Store row of each new token: its slot + 2 (row 0 stays zero, row 1 takes padded tokens)."""
    rows_needed: int
    chunks: list[_Chunk]


_last_plan: tuple[object, _Plan] | None = None


def _bi_plan(md, *, max_len: int, block_size: int) -> _Plan:
    """CUDA batch-invariant attention: what every layer of this forward gathers (built once per forward)."""
    global _last_plan
    if _last_plan is not None and _last_plan[0] is md:
        return _last_plan[1]
    from torchtitan_rl.models.batch_invariant import seqs_per_chunk

    device = md.slot_mapping.device
    slots = md.slot_mapping[: md.num_actual_tokens].long()
    rows_T = torch.where(slots >= 0, slots + 2, 1)
    starts = md.query_start_loc.tolist()
    n_q = [starts[i + 1] - starts[i] for i in range(len(starts) - 1)]
    seq_lens = md.seq_lens.tolist()[: len(n_q)]
    assert max(seq_lens, default=0) <= max_len, f"a sequence exceeds model.max_seq_len {max_len}"
    # Sequences with the same number of query rows together (decodes: 1), few padded rows.
    order = sorted((i for i in range(len(n_q)) if n_q[i]), key=n_q.__getitem__)
    pos_S = torch.arange(max_len, device=device)
    chunks = []
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and j + 1 - i <= seqs_per_chunk(n_q[order[j]], max_len):
            j += 1
        seqs = order[i:j]
        start = torch.tensor([starts[s] for s in seqs])
        nq = torch.tensor([n_q[s] for s in seqs])
        seq_len = torch.tensor([seq_lens[s] for s in seqs])
        r = torch.arange(int(nq.max()))
        offset = torch.minimum(r[None], nq[:, None] - 1)
        q_index = start[:, None] + offset
        real = (r[None] < nq[:, None]).flatten().nonzero().squeeze(1)
        blocks = md.block_table[torch.tensor(seqs, device=device)].long()
        blocks = blocks[:, (pos_S // block_size).clamp(max=blocks.shape[1] - 1)]
        kv_rows = torch.where(pos_S < seq_len.to(device)[:, None], blocks * block_size + pos_S % block_size + 2, 0)
        chunks.append(_Chunk(
            q_index=q_index.to(device), positions=(seq_len[:, None] - nq[:, None] + offset).to(device),
            kv_rows=kv_rows, real=real.to(device), out_index=q_index.flatten()[real].to(device),
        ))
        i = j
    for c in chunks:  # the block table and the slot mapping must agree on where new tokens go
        assert torch.equal(c.kv_rows.gather(1, c.positions[:, -1:]), rows_T[c.q_index[:, -1:]]), (
            "block table and slot mapping disagree (block size?)"
        )
    plan = _Plan(rows_T=rows_T, rows_needed=int(rows_T.max()) + 1 if len(rows_T) else 2, chunks=chunks)
    _last_plan = (md, plan)
    return plan


class TorchTitanQwen3ForCausalLM(nn.Module):
    """vLLM model class (registered as ``TITAN_ARCH``) wrapping torchtitan's Qwen3."""

    is_text_generation_model = True
    supports_pp = False
    supports_multimodal = False

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        hf_config = vllm_config.model_config.hf_config.to_dict()
        self.shape = Qwen3Shape.from_hf_config(hf_config)
        self.model = titan_config(self.shape).build()
        # Batch-invariant mode (flag carried in hf_overrides).
        bi_max_len = hf_config.get(BATCH_INVARIANT_KEY, 0) or None
        for i, layer in enumerate(self.model.layers.values()):
            layer.attention.inner_attention = PagedAttention(
                shape=self.shape,
                cache_config=vllm_config.cache_config,
                prefix=f"{prefix}model.layers.{i}.attention.inner_attention",
                bi_max_len=bi_max_len,
            )
        if bi_max_len:
            from torchtitan_rl.models.batch_invariant import make_batch_invariant

            device = torch.device("cpu" if compat.vllm_on_cpu() else "cuda")
            make_batch_invariant(self.model, max_len=bi_max_len, replace_attention=False, device=device)
        lora = hf_config.get(LORA_KEY)
        if lora:
            # Adapter applied unmerged at generation time, its tensors one flat buffer.
            apply_lora(self.model, LoRAConfig(**lora), flat=True, train=False)
        # vLLM never calls init_states; compute the RoPE cache as the trainer
        # does (fp32 whatever vLLM's default dtype) so auto-loaded weights work.
        for layer in self.model.layers.values():
            layer.attention.rope._init_self_buffers()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.tok_embeddings(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        h_BLD = inputs_embeds.unsqueeze(0)
        positions_BL = positions.unsqueeze(0)
        for layer in self.model.layers.values():
            h_BLD = layer(h_BLD, None, positions_BL)
        return self.model.norm(h_BLD).squeeze(0)

    def compute_logits(self, hidden_states_TD: torch.Tensor, *_args) -> torch.Tensor:
        return self.model.lm_head(hidden_states_TD)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a Hugging Face checkpoint (load_format=auto, debugging without a trainer)."""
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

        hf_state = dict(weights)
        adapter = Qwen3StateDictAdapter(titan_config(self.shape), None)
        titan_state = adapter.from_hf(hf_state)
        if self.shape.tie_word_embeddings:
            titan_state.pop("lm_head.weight", None)
        missing, unexpected = self.model.load_state_dict(titan_state, strict=False)
        missing = [
            k for k in missing
            if not k.endswith("lm_head.weight") and ".inner_attention.attn." not in k
        ]
        if missing or unexpected:
            raise ValueError(
                f"model.hf_checkpoint: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        return {name for name, _ in self.named_parameters()}

    def sync_targets(self) -> dict[str, Destination]:
        return sync_targets(self.model, self.shape)

    def engine_constants(self) -> dict[str, tuple[torch.Tensor, float]]:
        """Tensors vLLM's attention layer owns, with the value they must hold.

        These are fp8 KV-cache scales; with an unquantised cache they must be 1.
        """
        return {
            name: (buf, 1.0)
            for name, buf in self.model.named_buffers()
            if ".inner_attention.attn." in name
        }

    def all_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer the generator computes with."""
        return all_tensors(self.model)


def all_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of a torchtitan model, by name."""
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    return {k: v.detach() for k, v in tensors.items()}


def sync_targets(model: nn.Module, shape: Qwen3Shape) -> dict[str, Destination]:
    """Every tensor the trainer may write, by trainer names, as views.

    Native names (``wqkv``) map to the parameters themselves. torchtitan's
    checkpoint format splits the fused ``wqkv`` into ``wq``/``wk``/``wv``;
    those names map to strided views into the fused storage (rows are
    interleaved per KV group), so either form of the trainer's state dict
    lands in place. Buffers (the RoPE cache) are included; vLLM's attention
    scales are not (see ``engine_constants``).
    """
    targets = {
        name: Destination(t, t.shape)
        for name, t in all_tensors(model).items()
        if ".inner_attention.attn." not in name
    }
    if shape.tie_word_embeddings:
        targets["lm_head.weight"] = targets["tok_embeddings.weight"]
    n_kv = shape.num_key_value_heads
    heads_per_kv = shape.num_attention_heads // n_kv
    hd = shape.head_dim
    for name in [n for n in targets if n.endswith("qkv_linear.wqkv.weight")]:
        prefix = name[: -len("wqkv.weight")]
        w = targets[name].view.view(n_kv, heads_per_kv + 2, hd, -1)
        for key, view in (
            ("wq", w[:, :heads_per_kv]),
            ("wk", w[:, heads_per_kv]),
            ("wv", w[:, heads_per_kv + 1]),
        ):
            rows = view.numel() // view.shape[-1]
            targets[f"{prefix}{key}.weight"] = Destination(view, torch.Size([rows, view.shape[-1]]))
    return targets


def register() -> None:
    """Make ``TITAN_ARCH`` known to vLLM's model registry (idempotent)."""
    from vllm import ModelRegistry

    if TITAN_ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(TITAN_ARCH, TorchTitanQwen3ForCausalLM)
