"""The trainer: torchtitan's decoder (Qwen3 or Llama, models/families.py) under FSDP2, fp32 master weights, bf16 compute.

Built once per run from TrainerConfig. Every method is collective: all ranks
call it in the same order, each with its own shard of the data.

Mixed precision is FSDP2's: parameters live in fp32 (the optimizer's master
weights) and each forward all-gathers a ``model.dtype`` copy of them, so the
trainer computes with exactly the bf16 weights the generator gets from the
same fp32 masters. Gradients are reduced in fp32. The model is wrapped even
as a single process, so one process and many compute alike.

Long: the logprob forward and the training step share the wrapped model, its micro-batch plan and its
data-parallel sums, so they stay one class; building is in build.py, the chunked logprob and entropy math
in logprobs.py, the checkpoint files in checkpoint.py.
"""

import contextlib
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.distributed import utils as dist_utils

from torchtitan_rl import compat
from torchtitan_rl.config.job_config import GRPOConfig, ModelConfig, TrainerConfig
from torchtitan_rl.grpo.batch import TrainBatch, logprob_mismatch
from torchtitan_rl.grpo.loss import grpo_loss, importance_weights
from torchtitan_rl.trainer import checkpoint
from torchtitan_rl.kernels.batch_invariant import sampler_token_logprobs
from torchtitan_rl.models.moe import recorded, routers, routing, synced_state
from torchtitan_rl.models.shape import ModelShape
from torchtitan_rl.trainer.build import build_parallel_model
from torchtitan_rl.trainer.logprobs import (
    chunked_token_logprobs_and_entropy, entropy_of_logits, score_positions, token_entropy,
)
from torchtitan_rl.distributed.determinism import deterministic_algorithms, set_determinism
from torchtitan_rl.distributed.process_group import build_parallel_dims, init_process_group, local_device
from torchtitan_rl.trainer.lr_schedule import build_lr_scheduler, lr_factor
from torchtitan_rl.trainer.micro_batches import MicroBatch, plan, row_lengths


_TOKEN_MEANS = ("clip_fraction", "clip_frac_low", "clip_frac_high", "kl", "approx_kl", "ratio_mean", "entropy")
"""grpo_loss metrics that train_step reports as token-weighted means over ranks, micro- and mini-batches."""
_SUMS = ("loss", "tokens", *_TOKEN_MEANS, "mismatch_sum", "mismatch_frac_sum", "is_weight_sum", "is_capped_sum")
"""What _accumulate_gradients sums per rank and _optimizer_step over ranks."""


class Trainer:
    """torchtitan's decoder, Qwen3 or Llama family (FSDP2, fp32 masters, bf16 compute) trained with the GRPO loss."""

    def __init__(
        self,
        config: TrainerConfig,
        *,
        model_config: ModelConfig,
        shape: ModelShape,
        seed: int,
        device: torch.device,
        output_dir: Path,
        batch_invariant: bool = False,
        sharded_hf_load: bool = True,
    ) -> None:
        """``sharded_hf_load``: with model.hf_checkpoint (no LoRA, no batch-invariant mode), build the model on
        the meta device and let each rank read only its shards' rows; False: every rank reads the whole
        checkpoint into a whole model first (the reference the sharded load is tested against)."""
        if config.micro_batch_size < 1:
            raise ValueError(f"trainer.micro_batch_size: must be >= 1, got {config.micro_batch_size}")
        for name in ("micro_batch_tokens", "recompute_micro_batch_tokens", "logprob_chunk_tokens"):
            if getattr(config, name) < 0:
                raise ValueError(f"trainer.{name}: must be >= 0, got {getattr(config, name)}")
        if config.max_grad_norm < 0:
            raise ValueError(f"trainer.max_grad_norm: must be >= 0, got {config.max_grad_norm}")
        self.config = config
        self.device = local_device(device)
        self.output_dir = Path(output_dir)
        set_determinism(self.device)
        if batch_invariant and self.device.type == "cuda":
            compat.enable_batch_invariant_kernels()
        init_process_group(self.device, timeout_s=config.collective_timeout_s, cpu_tensors=config.cpu_offload)
        self.parallel_dims = build_parallel_dims(
            config.parallelism, world_size=dist.get_world_size(), device=self.device
        )
        batch_mesh = self.parallel_dims.get_optional_mesh("batch")
        self.dp_rank = batch_mesh.get_local_rank() if batch_mesh is not None else 0
        """This rank's index among data-parallel ranks: which shard of the data it trains on."""
        self.dp_size = batch_mesh.size() if batch_mesh is not None else 1
        """Number of data-parallel ranks (distinct data shards)."""
        loss_mesh = self.parallel_dims.get_optional_mesh("loss")
        self._dp_group = loss_mesh.get_group() if loss_mesh is not None else None

        self.model, self._compile, self._chunk_tokens = build_parallel_model(
            config, model_config=model_config, shape=shape, seed=seed, device=self.device,
            parallel_dims=self.parallel_dims, output_dir=self.output_dir, batch_invariant=batch_invariant,
            sharded_hf_load=sharded_hf_load,
        )
        self._sampler_logprobs = batch_invariant and self.device.type == "cuda"
        """Compute token logprobs with vLLM's GPU sampler kernels (batch-invariant mode on CUDA)."""
        self.model.train()  # RoPE buffers stay fp32: FSDP's mixed precision casts parameters only

        opt = config.optimizer
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],  # LoRA: adapters only
            lr=opt.lr,
            betas=tuple(opt.betas),
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            foreach=True,  # one implementation on CPU and GPU, DTensor-aware
        )
        self.scheduler = build_lr_scheduler(
            self.optimizer, config.lr_scheduler, total_steps=config.steps
        )
        self.step = 0
        """Optimizer steps taken."""
        # Looked up once: walking the module tree costs ~2 ms a sync at
        # debugmodel size. These are FSDP's sharded fp32 parameters, which the
        # optimizer and checkpoint loads update in place; while FSDP holds a
        # group unsharded, the module shows bf16 copies instead, never these.
        self._sync_state = synced_state(self.model)
        self._routers = routers(self.model)
        """The MoE layers' routers in layer order (none for a dense model): routing replay and recording."""
        if shape.load_balance_coeff:
            # torchtitan's expert-bias update runs as a pre-hook of every optimizer step, as in its trainer.
            register_moe_load_balancing_hook(self.optimizer, [self.model], self.parallel_dims)

    # ------------------------------------------------------------------ weights

    def sync_state(self) -> dict[str, torch.Tensor]:
        """The live parameters and buffers by name (DTensors when sharded), no copies."""
        return dict(self._sync_state)

    # ----------------------------------------------------------------- logprobs

    def token_logprobs(
        self, tokens_BL: torch.Tensor, *, temperature: float, mask_BL: torch.Tensor | None = None,
        replay_BLNK: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """float32 [B, L]: log p(tokens_BL[:, t] | tokens_BL[:, :t]) at temperature; column 0 is 0.

        mask_BL: positions whose logprob is wanted (the loss mask); the others
        are 0 and cost nothing (padding past a row's last one is not computed).
        None: every position of every row. replay_BLNK (MoE): the experts each
        position is routed to at each MoE layer (-1: the trainer's router decides).
        """
        return self.token_logprobs_and_routes(tokens_BL, temperature=temperature, mask_BL=mask_BL,
                                              replay_BLNK=replay_BLNK)[0]

    def token_logprobs_and_routes(
        self, tokens_BL: torch.Tensor, *, temperature: float, mask_BL: torch.Tensor | None = None,
        replay_BLNK: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """token_logprobs, and (MoE) int16 [B, L, MoE layers, top-k] the experts the trainer's own routers chose
        at every position it computed (-1 past a row's last scored one); None for a dense model."""
        _check_temperature(temperature)
        score_BL = score_positions(tokens_BL, mask_BL)
        tokens_BL = tokens_BL.to(self.device)
        out_BL = torch.zeros(tokens_BL.shape, dtype=torch.float32, device=self.device)
        routes_BLNK = None
        if self._routers:
            K = self._routers[0].top_k
            routes_BLNK = torch.full((*tokens_BL.shape, len(self._routers), K), -1, dtype=torch.int16)
        with torch.no_grad(), deterministic_algorithms(), _eval_mode(self.model):
            budget = self.config.recompute_micro_batch_tokens or self.config.micro_batch_tokens
            for mb in self._micro_batches(score_BL, max_tokens=budget):
                if mb is None:
                    with routing(self._routers):
                        self._logprobs(_dummy_tokens(tokens_BL), temperature, None)
                    continue
                rows, cols = mb.rows.to(self.device), slice(0, mb.length)
                replay = None if replay_BLNK is None else replay_BLNK[mb.rows, cols]
                with routing(self._routers, replay_BLNK=replay, record=routes_BLNK is not None):
                    out_BL[rows, cols] = self._logprobs(tokens_BL[rows, cols], temperature, score_BL[mb.rows, cols])
                    if routes_BLNK is not None:
                        routes_BLNK[mb.rows, cols] = recorded(self._routers).cpu().to(torch.int16)
        self._reshard()
        return out_BL, routes_BLNK

    def _reshard(self) -> None:
        """Register the fp32 shards again after no-grad forwards.

        FSDP keeps the last groups (embedding, norm, lm_head) unsharded after a
        forward, expecting a backward; without one, the model would expose
        their bf16 unsharded copies to sync_state and the optimizer-state lookup.
        """
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _logprobs(
        self, tokens_BL: torch.Tensor, temperature: float, score_BL: torch.Tensor | None, *, entropy: str = "off"
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """float32 [B, L] logprobs at the positions score_BL (CPU bool; None: all but column 0), 0 elsewhere.

        entropy "metric" or "grad" (differentiable): also the float32 [B, L] entropy of the tempered
        next-token distribution at the same positions, from the same logits (returns a pair).
        """
        if score_BL is None:
            score_BL = score_positions(tokens_BL, None)
        if self._chunk_tokens:
            return self._chunked_logprobs(tokens_BL, temperature, score_BL, entropy=entropy)
        logits_BLV = self.model(tokens_BL)
        if isinstance(logits_BLV, DTensor):  # tensor parallel: vocab-sharded logits
            logits_BLV = logits_BLV.full_tensor()
        entropy_BL = None
        if self._sampler_logprobs:
            logprobs_BL = F.pad(sampler_token_logprobs(logits_BLV[:, :-1], tokens_BL[:, 1:], temperature), (1, 0))
            if entropy != "off":
                with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
                    entropy_BL = F.pad(entropy_of_logits(logits_BLV, temperature)[:, :-1], (1, 0))
        else:
            # As vLLM's sampler: fp32 logits, divided by the temperature, then log_softmax.
            logits_BLV = logits_BLV[:, :-1].float() / temperature
            logprobs_BLV = torch.log_softmax(logits_BLV, dim=-1)
            if entropy != "off":
                with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
                    entropy_BL = F.pad(token_entropy(logprobs_BLV), (1, 0))
            logprobs_BL = logprobs_BLV.gather(-1, tokens_BL[:, 1:, None]).squeeze(-1)
            logprobs_BL = F.pad(logprobs_BL, (1, 0))  # position 0 has no context to be predicted from
        score_BL = score_BL.to(self.device)
        logprobs_BL = torch.where(score_BL, logprobs_BL, 0.0)
        if entropy == "off":
            return logprobs_BL
        return logprobs_BL, torch.where(score_BL, entropy_BL, 0.0)

    def _chunked_logprobs(
        self, tokens_BL: torch.Tensor, temperature: float, score_BL: torch.Tensor, *, entropy: str = "off"
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        hidden_BLD = self.model(tokens_BL)  # lm_head returns its input: the final normed hidden states
        weight_VD = self.model.lm_head.weight
        # After the forward FSDP holds the lm_head group unsharded (it is not resharded after
        # forward), so this is the compute-dtype weight whose gradient FSDP reduces.
        assert not isinstance(weight_VD, DTensor), "lm_head weight still sharded after the forward"
        b_N, t_N = (i.to(self.device) for i in score_BL.nonzero(as_tuple=True))
        logprobs_N, entropy_N = chunked_token_logprobs_and_entropy(
            hidden_BLD[b_N, t_N - 1], weight_VD, tokens_BL[b_N, t_N],
            temperature=temperature, chunk_tokens=self._chunk_tokens, compile=self._compile, entropy=entropy,
        )
        out_BL = hidden_BLD.new_zeros(tokens_BL.shape, dtype=torch.float32)
        if entropy == "off":
            return out_BL.index_put((b_N, t_N), logprobs_N)
        return out_BL.index_put((b_N, t_N), logprobs_N), out_BL.index_put((b_N, t_N), entropy_N)

    def _micro_batches(self, score_BL: torch.Tensor, *, max_tokens: int) -> list[MicroBatch | None]:
        """This rank's micro-batches (trainer/micro_batches.py), padded with None to the most any rank has.

        FSDP all-gathers parameters in every forward and reduce-scatters in every
        backward, so all ranks must run the same number of micro-batches.
        """
        batches = plan(row_lengths(score_BL), max_rows=self.config.micro_batch_size, max_tokens=max_tokens)
        count = len(batches)
        if dist.get_world_size() > 1:
            count_t = torch.tensor(count, device=self.device)
            dist.all_reduce(count_t, op=dist.ReduceOp.MAX)
            count = int(count_t.item())
        return batches + [None] * (count - len(batches))

    # ------------------------------------------------------------------- train

    def release_gradients(self) -> None:
        """Free the last step's gradients now rather than at the next step's start (they are kept for
        inspection otherwise): room for a woken engine (generator.sleep)."""
        self.optimizer.zero_grad(set_to_none=True)

    def train_step(
        self, batch: TrainBatch, *, temperature: float, grpo: GRPOConfig, max_tokens: int = 0
    ) -> dict[str, float]:
        """One GRPO step on the global batch (every rank passes its own shard): grpo.epochs passes of
        grpo.mini_batches optimizer steps each, all against the batch's pi_old (batch.old_logprobs_BL);
        the lr schedule and ``self.step`` advance once, so checkpoints fall on batch boundaries.

        max_tokens: the completion-length limit, grpo.loss_aggregation seq_mean_token_sum_norm's constant.
        Returns metrics over every optimizer step of the batch: token-weighted means, ratio_max the
        largest, loss and grad_norm the mean per optimizer step.
        """
        _check_temperature(temperature)
        if grpo.kl_coef > 0 and batch.ref_logprobs_BL is None:
            raise ValueError("grpo.kl_coef: > 0 needs TrainBatch.ref_logprobs_BL")
        tokens_BL = batch.tokens_BL.to(self.device)
        mask_cpu_BL = batch.loss_mask_BL.cpu()  # the micro-batch plan is made on the host: no device syncs
        mask_BL = batch.loss_mask_BL.to(self.device)
        old_BL = batch.old_logprobs_BL.to(self.device) if batch.old_logprobs_BL is not None else None
        assert old_BL is not None or (grpo.epochs == 1 and grpo.mini_batches == 1), "config checks grpo.old_logprobs"
        gen_BL = batch.generator_logprobs_BL.to(self.device) if batch.generator_logprobs_BL is not None else None
        adv_B = batch.advantages_B.to(self.device)
        ref_BL = batch.ref_logprobs_BL
        ref_BL = ref_BL.to(self.device) if ref_BL is not None else None
        is_BL = batch.is_weights_BL.to(self.device) if batch.is_weights_BL is not None else None
        replay_BLNK = batch.replay_routes_BLNK  # stays on the host: sliced per micro-batch
        assert not mask_BL[:, 0].any(), "loss_mask_BL[:, 0] must be 0: position 0 has no logprob"
        if self._dp_sum(mask_BL.sum(dtype=torch.float64).reshape(1)).item() == 0:
            raise ValueError("train_step: the batch has no scored tokens (loss_mask_BL is all 0)")

        whole = [torch.arange(tokens_BL.shape[0])]  # one mini-batch: the tensors as they are, no copies
        parts = whole if grpo.mini_batches == 1 else list(torch.arange(tokens_BL.shape[0]).tensor_split(grpo.mini_batches))
        sums: dict[str, float] = {}
        ratio_max, mismatch_max, rho_max, grad_norms, lr = 0.0, 0.0, 0.0, [], self.optimizer.param_groups[0]["lr"]
        with deterministic_algorithms():
            for _ in range(grpo.epochs):
                for rows in parts:
                    def take(x):
                        return x if parts is whole or x is None else x[rows.to(x.device)]

                    mb_sums, (mb_ratio_max, mb_mismatch_max, mb_rho_max), grad_norm = self._optimizer_step(
                        take(tokens_BL), take(mask_BL), take(old_BL), take(adv_B), take(ref_BL), take(is_BL),
                        mask_cpu_BL=take(mask_cpu_BL), temperature=temperature, grpo=grpo, max_tokens=max_tokens,
                        replay_BLNK=take(replay_BLNK), gen_BL=take(gen_BL),
                    )
                    if grad_norm is None:  # no scored token on any rank: no step
                        continue
                    grad_norms.append(grad_norm)
                    ratio_max = max(ratio_max, mb_ratio_max)
                    mismatch_max, rho_max = max(mismatch_max, mb_mismatch_max), max(rho_max, mb_rho_max)
                    for key, value in mb_sums.items():
                        sums[key] = sums.get(key, 0.0) + value
            self.scheduler.step()
        self.step += 1

        tokens = sums["tokens"]
        metrics = {
            "loss": sums["loss"] / len(grad_norms),
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "lr": lr,
            **{key: sums[key] / tokens for key in _TOKEN_MEANS},
            "ratio_max": ratio_max,
            "tokens": tokens / len(grad_norms),
            "optimizer_steps": float(len(grad_norms)),
        }
        if gen_BL is not None:  # what the builder measures on its recompute otherwise (its measured_in_training)
            metrics |= {"mismatch_mean": sums["mismatch_sum"] / tokens, "mismatch_max": mismatch_max,
                        "mismatch_frac_tokens": sums["mismatch_frac_sum"] / tokens,
                        "is_weight_mean": sums["is_weight_sum"] / tokens, "is_weight_max": rho_max,
                        "is_capped_frac": sums["is_capped_sum"] / tokens}
        return metrics

    def _optimizer_step(
        self, tokens_BL, mask_BL, old_BL, adv_B, ref_BL, is_BL, *, mask_cpu_BL: torch.Tensor, temperature: float,
        grpo: GRPOConfig, max_tokens: int, replay_BLNK: torch.Tensor | None = None, gen_BL: torch.Tensor | None = None,
    ) -> tuple[dict[str, float], tuple[float, float, float], float | None]:
        """Accumulate the gradient of one mini-batch over all ranks and step the optimizer once.

        Returns the data-parallel sums (_SUMS), the largest ratio, logprob gap and pi_old / mu (with ``gen_BL``),
        and the gradient norm (None, and no step, when no rank has a scored token).
        """
        # One normaliser for the global mini-batch: summed over micro-batches and ranks, the
        # per-micro-batch losses and gradients are the full mini-batch ones.
        # Sequences: GRPO's mean counts those with a scored token; Dr. GRPO's constant counts every row.
        seqs = mask_BL.shape[0] if grpo.loss_aggregation == "seq_mean_token_sum_norm" else (mask_BL.sum(dim=1) > 0).sum()
        counts = self._dp_sum(torch.stack([
            mask_BL.sum(dtype=torch.float64), torch.as_tensor(seqs, dtype=torch.float64, device=mask_BL.device)
        ]))
        num_tokens, num_sequences = (int(c) for c in counts.tolist())
        if num_tokens == 0:
            return {}, (0.0, 0.0, 0.0), None
        self.optimizer.zero_grad(set_to_none=True)
        totals, peaks = self._accumulate_gradients(
            tokens_BL, mask_BL, old_BL, adv_B, ref_BL,
            mask_cpu_BL=mask_cpu_BL, temperature=temperature, grpo=grpo, num_tokens=num_tokens, is_BL=is_BL,
            num_sequences=num_sequences, max_tokens=max_tokens, replay_BLNK=replay_BLNK, gen_BL=gen_BL,
        )
        grad_norm = self._clip_grad_norm()
        self.optimizer.step()
        reduced = self._dp_sum(torch.tensor(totals, dtype=torch.float64, device=self.device)).tolist()
        peak = torch.tensor(peaks, dtype=torch.float64, device=self.device)
        if self._dp_group is not None:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self._dp_group)
        return dict(zip(_SUMS, reduced)), tuple(peak.tolist()), grad_norm

    def _accumulate_gradients(
        self,
        tokens_BL: torch.Tensor,
        mask_BL: torch.Tensor,
        old_BL: torch.Tensor,
        adv_B: torch.Tensor,
        ref_BL: torch.Tensor | None,
        *,
        mask_cpu_BL: torch.Tensor,
        temperature: float,
        grpo: GRPOConfig,
        num_tokens: int,
        is_BL: torch.Tensor | None = None,
        num_sequences: int | None = None,
        max_tokens: int = 0,
        replay_BLNK: torch.Tensor | None = None,
        gen_BL: torch.Tensor | None = None,
    ) -> tuple[list[float], list[float]]:
        """Forward/backward per micro-batch; returns this rank's metric sums and its largest ratio,
        generator-vs-trainer logprob gap and pi_old / mu. ``old_BL`` None: pi_old is each forward's own
        logprobs, detached.

        The sums (_SUMS): loss, tokens, the token-weighted _TOKEN_MEANS, then with ``gen_BL`` the token-weighted
        logprob_mismatch and importance_weights statistics (else 0).
        With ``gen_BL`` the importance weights (grpo.importance_correction) come from pi_old / mu here.
        """
        totals = [0.0] * len(_SUMS)
        ratio_max = mismatch_max = rho_max = 0.0
        entropy = "grad" if grpo.entropy_coef else "metric"
        for mb in self._micro_batches(mask_cpu_BL, max_tokens=self.config.micro_batch_tokens):
            if mb is None:
                # Another rank has more micro-batches: join its collectives, add nothing.
                (self._logprobs(_dummy_tokens(tokens_BL), temperature, None).sum() * 0.0).backward()
                continue
            rows, cols = mb.rows.to(self.device), slice(0, mb.length)
            replay = None if replay_BLNK is None else replay_BLNK[mb.rows, cols]
            # Activation checkpointing recomputes inside backward: the replayed routes stay set through it.
            with routing(self._routers, replay_BLNK=replay):
                logprobs_BL, entropy_BL = self._logprobs(
                    tokens_BL[rows, cols], temperature, mask_cpu_BL[mb.rows, cols].bool(), entropy=entropy
                )
                old_mb = old_BL[rows, cols] if old_BL is not None else logprobs_BL.detach()
                is_mb = is_BL[rows, cols] if is_BL is not None else None
                if gen_BL is not None:  # pi_old is this forward's: its correction, and what the builder would measure
                    gap = logprob_mismatch(old_mb, gen_BL[rows, cols], mask_BL[rows, cols])
                    is_mb, rho = importance_weights(
                        old_mb, gen_BL[rows, cols], mask_BL[rows, cols], mode=grpo.importance_correction,
                        cap=grpo.importance_cap, level=grpo.ratio_level)
                    mismatch_max = max(mismatch_max, gap["mismatch_max"])
                    rho_max = max(rho_max, rho["is_weight_max"])
                loss, m = grpo_loss(
                    logprobs_BL,
                    old_mb,
                    adv_B[rows],
                    mask_BL[rows, cols],
                    clip_eps_low=grpo.clip_eps_low,
                    clip_eps_high=grpo.clip_eps_high,
                    ref_logprobs_BT=ref_BL[rows, cols] if ref_BL is not None else None,
                    kl_coef=grpo.kl_coef,
                    num_tokens=num_tokens,
                    is_weights_BT=is_mb,
                    aggregation=grpo.loss_aggregation,
                    num_sequences=num_sequences,
                    max_tokens=max_tokens or None,
                    ratio_level=grpo.ratio_level,
                    entropy_BT=entropy_BL,
                    entropy_coef=grpo.entropy_coef,
                )
                loss.backward()
            n = m["tokens"]
            measured = (0.0, 0.0, 0.0, 0.0)  # token-weighted, as the recompute's means are over all tokens
            if gen_BL is not None:
                measured = tuple(d[key] * n for d, key in ((gap, "mismatch_mean"), (gap, "mismatch_frac_tokens"),
                                                           (rho, "is_weight_mean"), (rho, "is_capped_frac")))
            sums = (m["loss"], n, *(m[key] * n for key in _TOKEN_MEANS), *measured)
            totals = [t + v for t, v in zip(totals, sums)]
            ratio_max = max(ratio_max, m["ratio_max"])
        return totals, [ratio_max, mismatch_max, rho_max]

    def _dp_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over data-parallel ranks (tensor-parallel peers hold the same data)."""
        if self._dp_group is not None:
            dist.all_reduce(x, group=self._dp_group)
        return x

    def _clip_grad_norm(self) -> float:
        """Global gradient norm before clipping; clips to max_grad_norm unless it is 0."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.parallel_dims.ep_enabled:
            # Experts live on the (efsdp, ep) mesh, the rest on FSDP's: torchtitan adds the two norms.
            norm = dist_utils.clip_grad_norm_(params, self.config.max_grad_norm or math.inf, foreach=True,
                                              ep_enabled=True)
            return norm.item()
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if isinstance(norm, DTensor):  # partial per-shard norms -> the global one
            norm = norm.full_tensor()
        if self.config.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(
                params, self.config.max_grad_norm, norm, foreach=True
            )
        return norm.item()

    # -------------------------------------------------------------- checkpoint

    @property
    def checkpoint_folder(self) -> Path:
        """Where step-N checkpoints live: output_dir / trainer.checkpoint.folder."""
        return self.output_dir / self.config.checkpoint.folder

    def save_checkpoint(self, step: int, *, extra: dict | None = None, files: dict[str, str] | None = None) -> Path:
        """Write step-``step`` (model, optimizer, step, extra; ``files``: small text files beside it) with its
        manifest, and prune older ones."""
        return checkpoint.save(
            self.checkpoint_folder,
            step=step,
            model=self.model,
            optimizer=self.optimizer,
            extra=extra,
            trainer_step=self.step,
            keep_latest=self.config.checkpoint.keep_latest,
            files=files,
        )

    def load_checkpoint(self, path: Path) -> dict:
        """Restore a verified checkpoint (every rank passes the same path); returns its ``extra`` ({} if none).

        The optimizer's hyperparameters and the learning-rate schedule come from this trainer's config, not the
        checkpoint's: a run resumed with another lr or schedule trains with it from the next step.
        """
        state = checkpoint.load(path, model=self.model, optimizer=self.optimizer)
        self.step = state["trainer_step"]
        opt = self.config.optimizer
        lr = opt.lr * lr_factor(self.step, config=self.config.lr_scheduler, total_steps=self.config.steps)
        for group in self.optimizer.param_groups:
            group.update(lr=lr, initial_lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay)
        self.scheduler.base_lrs = [opt.lr] * len(self.optimizer.param_groups)
        self.scheduler.last_epoch = self.step
        return state["extra"] if state["extra"] is not None else {}


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module):
    """No dropout (LoRA's) inside: a recomputed pi_old or pi_ref is the policy itself, not a random thinning."""
    model.eval()
    try:
        yield
    finally:
        model.train()


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"generator.sampling.temperature: must be > 0, got {temperature}")


def _dummy_tokens(tokens_BL: torch.Tensor) -> torch.Tensor:
    """One all-pad row shaped like the batch, for a rank that ran out of micro-batches."""
    return tokens_BL.new_zeros((1, tokens_BL.shape[1]))
