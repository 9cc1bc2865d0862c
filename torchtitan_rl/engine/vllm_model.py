"""torchtitan's decoder (every family: models/families.py), run by vLLM.

The generator runs the trainer's own model definition: same modules, same
parameter names, same op sequence. One vLLM architecture serves every
family; the family is read from the config's ``model_type``. Only the inner
attention is swapped for vLLM's paged attention (vLLM owns the KV cache). Because the linear layers
are torchtitan's plain ``nn.Linear``, vLLM's CPU backend does not repack them,
so writing a parameter in place changes what the generator computes.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn

from torchtitan_rl import compat
from torchtitan_rl.config import LoRAConfig
from torchtitan_rl.kernels.batch_invariant import attention as bi_attention, make_batch_invariant, padded_len, seqs_per_chunk
from torchtitan_rl.models.lora import apply_lora
from torchtitan_rl.engine.moe import FusedMoE, RouteRecorder, load_through_targets
from torchtitan_rl.models.families import family_by_model_type, from_hf, load_hf_state, shape_from_hf_config
from torchtitan_rl.models.shape import ModelShape, qkv_views, titan_config
from torchtitan_rl.models.destination import Destination

TITAN_ARCH = "TorchTitanForCausalLM"
"""Architecture name under which the generator's model is registered in vLLM."""

LORA_KEY = "torchtitan_rl_lora"
"""hf_overrides key: LoRAConfig fields when the generator applies adapters unmerged."""

COMPILE_KEY = "torchtitan_rl_compile"
"""hf_overrides key: true lets vLLM torch.compile the model (generator.compile)."""

BATCH_INVARIANT_KEY = "torchtitan_rl_batch_invariant"
"""hf_overrides key: true switches the generator's model to the batch-invariant
kernels (kernels/batch_invariant.py, on CUDA with kernels/paged_attention.py),
the same the trainer runs."""


class PagedAttention(nn.Module):
    """Stands in for torchtitan's inner attention; vLLM's layer keeps the KV cache.

    In batch-invariant mode it attends with the kernel the trainer uses. On
    CUDA (``paged_attention.attention``) that kernel reads vLLM's paged cache
    directly, after vLLM's own op wrote this step's K/V: no host work, so
    vLLM's CUDA graphs capture it. On CPU (``batch_invariant.attention``) it
    keeps its own copy of each token's K/V by vLLM's slot mapping and attends
    over chunks of sequences whose keys are gathered from that copy and padded
    to a multiple of ``KEY_TILE``.
    """

    def __init__(self, *, shape: ModelShape, cache_config, prefix: str, batch_invariant: bool = False) -> None:
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
        self.batch_invariant = batch_invariant
        self.scale = shape.head_dim**-0.5
        self._kv_rows: torch.Tensor | None = None  # [2, n_kv, rows, head_dim], row = slot + 2

    def forward(self, q_BLNH, k_BLNH, v_BLNH, **_unused) -> torch.Tensor:
        B, L, N, H = q_BLNH.shape
        if self.batch_invariant:
            bi_attention = self._batch_invariant_paged if q_BLNH.is_cuda else self._batch_invariant
            return bi_attention(q_BLNH[0], k_BLNH[0], v_BLNH[0]).view(B, L, N, H)
        out_TD = self.attn(
            q_BLNH.reshape(B * L, N * H),
            k_BLNH.reshape(B * L, -1),
            v_BLNH.reshape(B * L, -1),
        )
        return out_TD[: B * L].view(B, L, N, H)

    def _metadata(self):
        """This layer's attention metadata for the current forward (None when profiling)."""
        return compat.attention_metadata(self.layer_name)

    def _batch_invariant_paged(self, q_TNH, k_TKH, v_TKH) -> torch.Tensor:
        from torchtitan_rl.kernels.paged_attention import attention, plan_tiles

        md = self._metadata()
        if md is None:  # vLLM's profiling run: no sequences, nothing to attend to
            return torch.zeros_like(q_TNH)
        tiles = _once_per_forward(md, lambda: plan_tiles(
            md.query_start_loc, num_tokens=q_TNH.shape[0], heads=q_TNH.shape[1], kv_heads=k_TKH.shape[1]))
        key_cache, value_cache = compat.vllm_paged_kv_cache(self.attn, k_TKH, v_TKH)
        return attention(q_TNH, key_cache, value_cache, block_table=md.block_table, query_start_loc=md.query_start_loc,
                         seq_lens=md.seq_lens, scale=self.scale, tiles=tiles)

    def _batch_invariant(self, q_TNH, k_TKH, v_TKH) -> torch.Tensor:
        out = torch.zeros_like(q_TNH)
        md = self._metadata()
        if md is None:  # vLLM's profiling run: no sequences, nothing to attend to
            return out
        plan = _once_per_forward(md, lambda: _bi_plan(md, block_size=self.block_size, heads=q_TNH.shape[1],
                                                      head_dim=q_TNH.shape[2]))
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
            kv = self._kv_rows[:, :, c.kv_rows]  # [2, n_kv, seqs, keys, head_dim], row 0 (zeros) past each end
            out_BRNH = bi_attention(q_TNH[c.q_index], kv[0], kv[1], c.positions, scale=self.scale)
            if c.real is None:
                out[c.q_index.flatten()] = out_BRNH.flatten(0, 1)
            else:
                out[c.out_index] = out_BRNH.flatten(0, 1)[c.real]
        return out


@dataclass
class _Chunk:
    q_index: torch.Tensor
    """[seqs, rows] token index of each query row (a shorter sequence repeats its last row)."""
    positions: torch.Tensor
    """[seqs, rows] position of each query row in its sequence."""
    kv_rows: torch.Tensor
    """[seqs, keys] store row of positions 0..keys-1 (0, the zero row, past the end)."""
    real: torch.Tensor | None
    """Indices of the real rows among the flattened [seqs * rows]; None when all are (one row each)."""
    out_index: torch.Tensor | None
    """Token index of each real row (with ``real``)."""


@dataclass
class _Plan:
    rows_T: torch.Tensor
    """Store row of each new token: its slot + 2 (row 0 stays zero, row 1 takes padded tokens)."""
    rows_needed: int
    chunks: list[_Chunk]


_block_size_checked = False


def _once_per_forward(md, build):
    """``build()`` at the forward's first layer, the same result at the others.

    Kept on the forward's attention metadata, which vLLM builds anew each
    forward (a per-layer copy of it keeps the result: only the block table
    may differ between layers, and only for models with several KV-cache groups).
    """
    value = getattr(md, "_torchtitan_rl_plan", None)
    if value is None:
        value = build()
        md._torchtitan_rl_plan = value
    return value


def _bi_plan(md, *, block_size: int, heads: int, head_dim: int) -> _Plan:
    """CPU batch-invariant attention: what every layer of this forward gathers (built once per forward).

    Keys are padded to ``padded_len`` of the longest sequence in the forward
    (md.max_seq_len, known on the host). Built from the metadata's tensors on
    their device; the host only learns the store size (one small copy per
    forward, when vLLM has just synchronised for the previous step's tokens)
    and, in forwards with prefills, each sequence's number of new tokens, to
    group sequences by it (few padded rows).
    """
    global _block_size_checked
    device = md.slot_mapping.device
    slots = md.slot_mapping[: md.num_actual_tokens].long()
    rows_T = torch.where(slots >= 0, slots + 2, 1)
    starts = md.query_start_loc.long()
    n_seqs = starts.shape[0] - 1
    n_q = starts[1:] - starts[:-1]
    seq_lens = md.seq_lens[:n_seqs].long()
    keys = padded_len(md.max_seq_len)
    pos_S = torch.arange(keys, device=device)
    block_of_S = (pos_S // block_size).clamp(max=md.block_table.shape[1] - 1)
    if md.max_query_len == 1:  # decodes only: one row per sequence (eager: the batch holds scheduled requests only)
        groups = [(torch.arange(n_seqs, device=device), 1, None)]
    else:  # sequences with the same number of new tokens together
        n_q_host = n_q.tolist()
        order = sorted((i for i in range(n_seqs) if n_q_host[i]), key=n_q_host.__getitem__)
        groups = []
        i = 0
        while i < len(order):
            j = i + 1
            while j < len(order) and j + 1 - i <= seqs_per_chunk(
                n_q_host[order[j]], keys, heads=heads, head_dim=head_dim
            ):
                j += 1
            seqs = order[i:j]
            groups.append((torch.tensor(seqs, device=device), n_q_host[seqs[-1]], [n_q_host[s] for s in seqs]))
            i = j
    chunks = []
    for seqs, rows, n_q_group in groups:
        step = seqs_per_chunk(rows, keys, heads=heads, head_dim=head_dim)
        for c in range(0, len(seqs), step):
            s = seqs[c : c + step]
            nq, seq_len = n_q[s][:, None], seq_lens[s][:, None]
            offset = torch.minimum(torch.arange(rows, device=device), nq - 1)
            q_index = starts[s][:, None] + offset
            blocks = md.block_table[s].long()[:, block_of_S]
            kv_rows = torch.where(pos_S < seq_len, blocks * block_size + pos_S % block_size + 2, 0)
            real = out_index = None
            if rows > 1:
                real_host = torch.tensor([r < n for n in n_q_group[c : c + step] for r in range(rows)])
                real = real_host.nonzero().squeeze(1).to(device)
                out_index = q_index.flatten()[real]
            chunks.append(_Chunk(q_index=q_index, positions=seq_len - nq + offset, kv_rows=kv_rows,
                                 real=real, out_index=out_index))
    if not _block_size_checked:  # once: the block table and the slot mapping agree on where new tokens go
        for c in chunks:
            assert torch.equal(c.kv_rows.gather(1, c.positions[:, -1:]), rows_T[c.q_index[:, -1:]]), (
                "block table and slot mapping disagree (block size?)"
            )
        _block_size_checked = True
    return _Plan(rows_T=rows_T, rows_needed=int(rows_T.max()) + 1 if len(rows_T) else 2, chunks=chunks)


class TorchTitanForCausalLM(nn.Module):
    """vLLM model class (registered as ``TITAN_ARCH``) wrapping torchtitan's decoder."""

    is_text_generation_model = True
    supports_pp = False
    supports_multimodal = False

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        hf_config = vllm_config.model_config.hf_config.to_dict()
        # architectures is TITAN_ARCH here (hf_overrides); model_type is still the family's.
        family = family_by_model_type(hf_config["model_type"])
        self.shape = shape_from_hf_config(hf_config, family=family, where="generator: the model's config.json")
        self.routes: RouteRecorder | None = None
        """MoE: the expert ids each layer chose for the current forward's tokens (engine/moe.py)."""
        if self.shape.moe:
            self.model, self.routes = _build_moe(self.shape, max_tokens=vllm_config.scheduler_config.max_num_batched_tokens)
        else:
            self.model = titan_config(self.shape).build()
        # Batch-invariant mode (flag carried in hf_overrides).
        batch_invariant = bool(hf_config.get(BATCH_INVARIANT_KEY, False))
        for i, layer in enumerate(self.model.layers.values()):
            layer.attention.inner_attention = PagedAttention(
                shape=self.shape,
                cache_config=vllm_config.cache_config,
                prefix=f"{prefix}model.layers.{i}.attention.inner_attention",
                batch_invariant=batch_invariant,
            )
        if batch_invariant:
            device = torch.device("cpu" if compat.vllm_on_cpu() else "cuda")
            make_batch_invariant(self.model, replace_attention=False, device=device)
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
        if self.shape.moe:  # the experts live in the fused layout: written through the sync's views
            load_through_targets(self.sync_targets(), from_hf(dict(weights), self.shape), self.shape)
            return {name for name, _ in self.named_parameters()}
        # vLLM's attention layer owns its KV-cache scales (engine_constants), no checkpoint holds them.
        load_hf_state(self.model, dict(weights), self.shape, where="model.hf_checkpoint",
                      owned_elsewhere=".inner_attention.attn.")
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


def sync_targets(model: nn.Module, shape: ModelShape) -> dict[str, Destination]:
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
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):  # the trainer's stacked experts, as views into the fused layout
            for key, view in module.expert_views().items():
                targets[f"{name}.routed_experts.inner_experts.{key}"] = Destination(view, view.shape)
    for name in [n for n in targets if n.endswith("qkv_linear.wqkv.weight")]:
        prefix = name[: -len("wqkv.weight")]
        for key, view in qkv_views(targets[name].view, shape).items():
            rows = view.numel() // view.shape[-1]
            targets[f"{prefix}{key}.weight"] = Destination(view, torch.Size([rows, view.shape[-1]]))
    return targets


def _build_moe(shape: ModelShape, *, max_tokens: int) -> tuple[nn.Module, RouteRecorder]:
    """torchtitan's decoder with each layer's MoE swapped for the fused layer (engine/moe.py). Built on the meta
    device first, so torchtitan's own expert tensors (most of the model's memory) are never allocated."""
    device = torch.empty(0).device  # vLLM builds the model under its target device
    recorder = RouteRecorder(max_tokens=max_tokens, layers=shape.num_hidden_layers, top_k=shape.num_experts_per_tok)
    recorder.ids_TNK = recorder.ids_TNK.to(device)
    # The swap happens on meta too: allocating torchtitan's experts first, even briefly, doubles the load's peak
    # and, freed inside vLLM's sleep-mode memory pool, makes vLLM's profile size the KV cache too large.
    with torch.device("meta"):
        model = titan_config(shape).build()
        for i, layer in enumerate(model.layers.values()):
            layer.moe = FusedMoE(titan_moe=layer.moe, shape=shape, layer=i, recorder=recorder)
    model.to_empty(device=device)
    for layer in model.layers.values():
        if layer.moe.expert_bias_E is not None:
            layer.moe.expert_bias_E.zero_()
    if shape.tie_word_embeddings:  # to_empty gives each module its own tensor
        model.lm_head.weight = model.tok_embeddings.weight
    return model, recorder


def _compile_requested(vllm_config) -> bool:
    return bool(getattr(vllm_config.model_config.hf_config, COMPILE_KEY, False))


def register() -> None:
    """Make ``TITAN_ARCH`` known to vLLM's model registry (idempotent); vLLM compiles it only when the
    config's ``COMPILE_KEY`` says so."""
    from vllm import ModelRegistry

    if TITAN_ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(TITAN_ARCH, compat.compilable(TorchTitanForCausalLM, enable_if=_compile_requested))
