"""LoRA sync: adapter-only vs merged vs the full model, same process, same model.

    python scripts/bench_lora_sync.py --flavors tiny debugmodel --rank 8
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import median_seconds, table, write_section  # noqa: E402

from torchtitan_rl.config import GeneratorConfig, LoRAConfig, ModelConfig, TrainerConfig, WeightSyncConfig  # noqa: E402
from torchtitan_rl.engine.engine import Engine  # noqa: E402
from torchtitan_rl.models.families import resolve_shape  # noqa: E402
from torchtitan_rl.trainer import Trainer  # noqa: E402
from torchtitan_rl.weight_sync.sync import WeightSync  # noqa: E402


def one_mode(flavor: str, lora: LoRAConfig, *, device: str, repeats: int, workdir: Path) -> dict:
    shape = resolve_shape(flavor=flavor, hf_checkpoint=None, vocab_size=16 if flavor == "tiny" else 0, max_seq_len=128)
    model_config = ModelConfig(flavor=flavor, lora=lora, max_seq_len=128)
    trainer = Trainer(TrainerConfig(), model_config=model_config, shape=shape, seed=0,
                      device=torch.device(device), output_dir=workdir)
    gen = Engine(GeneratorConfig(max_model_len=128, max_num_seqs=8, gpu_memory_utilization=0.2),
                 model_config=model_config, shape=shape, seed=0, device=device, workdir=workdir)
    ws = WeightSync(WeightSyncConfig(verify="off"), reference=trainer.sync_state(), generator=gen, lora=lora)
    version = iter(range(10_000))
    first = ws.sync(trainer.sync_state(), version=next(version))
    seconds = median_seconds(lambda: ws.sync(trainer.sync_state(), version=next(version)), device=device,
                             repeats=repeats)
    moved = ws.sync(trainer.sync_state(), version=next(version)).bytes_written
    del gen
    return {"first_s": first.seconds, "steady_s": seconds, "bytes": moved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavors", nargs="+", default=["tiny", "debugmodel"])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for flavor in args.flavors:
            modes = {
                "full model (no LoRA)": LoRAConfig(rank=0),
                f"LoRA r={args.rank}, adapter-only": LoRAConfig(rank=args.rank, sync="adapter"),
                f"LoRA r={args.rank}, merged": LoRAConfig(rank=args.rank, sync="merged"),
            }
            results = {
                name: one_mode(flavor, lora, device=args.device, repeats=args.repeats, workdir=Path(tmp) / flavor)
                for name, lora in modes.items()
            }
            full = results["full model (no LoRA)"]["steady_s"]
            for name, r in results.items():
                rows.append([flavor, name, f"{r['first_s'] * 1e3:.2f}", f"{r['steady_s'] * 1e3:.2f}",
                             f"{r['bytes'] / 2**20:.2f}", f"{full / r['steady_s']:.1f}x"])
    body = table(["model", "mode", "first sync ms", "later syncs ms (median)", "MiB moved per later sync",
                  "speed-up vs full"], rows)
    body += ("\nFirst sync in adapter mode moves base + adapter; every later one only the adapter, "
             "as one flat buffer. Merged mode moves W + scale*B@A for every weight each time.\n")
    write_section(f"LoRA sync ({args.device})", device=args.device, body=body)


if __name__ == "__main__":
    main()
