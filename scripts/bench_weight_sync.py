"""Weight sync: ours vs vLLM's reload_weights vs a plain copy of the same bytes.

Same process, same model shape, median of several runs. The source is the
trainer's fp32 master weights; the generator holds bf16, so the floor is a
cast-copy of the same number of elements (read 4 bytes, write 2 per
parameter). vLLM's reload_weights runs on vLLM's native Qwen3 (its intended
use); its weight-transfer engines need CUDA (IPC) or a second process group
(NCCL) and are measured on the GPU (scripts/gpu/).

    python scripts/bench_weight_sync.py --flavors tiny debugmodel 0.6B
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import median_seconds, table, write_section  # noqa: E402

from torchtitan_rl import compat  # noqa: E402
from torchtitan_rl.config import GeneratorConfig, ModelConfig, WeightSyncConfig  # noqa: E402
from torchtitan_rl.generator.generator import Generator  # noqa: E402
from torchtitan_rl.models.qwen3 import build_titan_model, resolve_shape, titan_config  # noqa: E402
from torchtitan_rl.weight_sync import WeightSync  # noqa: E402


def native_engine(shape, workdir: Path, device: str):
    """vLLM's own Qwen3 (fused qkv_proj/gate_up_proj), dummy weights."""
    model_dir = workdir / "native"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(
        json.dumps({**shape.to_hf_config(), "architectures": ["Qwen3ForCausalLM"]})
    )
    return compat.build_llm_engine(
        model=str(model_dir), load_format="dummy", dtype="bfloat16", max_model_len=128,
        max_num_seqs=8, enforce_eager=True, tensor_parallel_size=1, seed=0, device=device,
        gpu_memory_utilization=0.2, kv_cache_memory_bytes=64 << 20, batch_invariant=False,
    )


def bench_flavor(flavor: str, *, device: str, repeats: int, workdir: Path) -> list:
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    shape = resolve_shape(flavor=flavor, hf_checkpoint=None, vocab_size=0 if flavor != "tiny" else 16, max_seq_len=128)
    trainer = build_titan_model(shape, seed=0, device=device)
    state = {**dict(trainer.named_parameters()), **dict(trainer.named_buffers())}
    n_params = sum(p.numel() for p in trainer.parameters())

    gen = Generator(
        GeneratorConfig(max_model_len=128, max_num_seqs=8, gpu_memory_utilization=0.2),
        model_config=ModelConfig(flavor=flavor), shape=shape, seed=0, device=device, workdir=workdir,
    )
    rows = {}
    for verify in ("off", "sampled", "full"):
        ws = WeightSync(WeightSyncConfig(verify=verify), reference=state, generator=gen)
        version = iter(range(1, 10_000))
        rows[f"ours (verify={verify})"] = median_seconds(
            lambda: ws.sync(state, version=next(version)), device=device, repeats=repeats
        )
    moved = ws.plan.nbytes

    # Floors: one flat buffer of the same element count.
    src32 = torch.randn(n_params, device=device)
    dst16 = torch.empty(n_params, device=device, dtype=torch.bfloat16)
    src16 = src32.bfloat16()
    rows["floor: fp32->bf16 cast copy"] = median_seconds(lambda: dst16.copy_(src32), device=device, repeats=repeats)
    rows["floor: bf16 copy"] = median_seconds(lambda: dst16.copy_(src16), device=device, repeats=repeats)
    del src32, src16, dst16

    # vLLM's reload_weights on its native Qwen3, fed the same weights in HF names.
    del gen
    engine = native_engine(shape, workdir, device)
    hf_state = Qwen3StateDictAdapter(titan_config(shape), None).to_hf(trainer.state_dict())
    if shape.tie_word_embeddings:
        hf_state.pop("lm_head.weight", None)

    def reload():
        engine.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": iter(hf_state.items()), "is_checkpoint_format": True}
        )

    rows["vLLM reload_weights (native Qwen3)"] = median_seconds(reload, device=device, repeats=repeats)
    del engine

    floor = rows["floor: fp32->bf16 cast copy"]
    return [
        [flavor, f"{n_params / 1e6:.1f} M", name, f"{t * 1e3:.2f}", f"{t / floor:.2f}x"]
        for name, t in rows.items()
    ] + [[flavor, "", f"bytes written by ours: {moved / 2**20:.1f} MiB", "", ""]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavors", nargs="+", default=["tiny", "debugmodel"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--section", default=None, help="section name in docs/benchmarks.md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for flavor in args.flavors:
            rows += bench_flavor(flavor, device=args.device, repeats=args.repeats, workdir=Path(tmp) / flavor)
    body = table(["model", "params", "method", "median ms", "vs cast floor"], rows)
    body += (
        "\nSource: fp32 trainer master weights (+ RoPE buffers); destination: the generator's bf16 "
        "tensors, in place. 'ours' includes validation (names, shapes, NaN/inf scan) before writing.\n"
    )
    write_section(args.section or f"Weight sync ({args.device})", device=args.device, body=body)


if __name__ == "__main__":
    main()
