"""generator.sleep on a GPU, state by state (tests/engine/test_sleep.py's machine, with vLLM's real sleep mode):

    python scripts/gpu/sleep_check.py [--flavor 0.6B] [--json OUT.json]

A CUDA-graph engine (enforce_eager false) with enable_sleep_mode gets trainer weights, generates (the reference),
sleeps at level 2 (device memory freed: measured), wakes (refuses to generate; every tensor NaN), takes a sync
(every tensor moved and verified) and generates again: the outputs must equal the reference token for token and
logprob for logprob (graph replay after wake). Then a level-1 cycle: sleep, generate (wakes the engine), equal again.
Exits 1 on any difference.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from torchtitan_rl.config import GeneratorConfig, ModelConfig, WeightSyncConfig  # noqa: E402
from torchtitan_rl.engine.engine import Engine, WeightsNotSyncedError  # noqa: E402
from torchtitan_rl.models.families import resolve_shape  # noqa: E402
from torchtitan_rl.models.shape import build_titan_model  # noqa: E402
from torchtitan_rl.weight_sync.sync import WeightSync  # noqa: E402

GIB = 1 << 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="0.6B")
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (vLLM frees nothing there)")
    args = p.parse_args()
    shape = resolve_shape(flavor=args.flavor, hf_checkpoint=None, vocab_size=0, max_seq_len=256)
    cuda = args.device == "cuda"
    gen = Engine(GeneratorConfig(sleep="weights" if cuda else "off", enforce_eager=not cuda,
                                    gpu_memory_utilization=0.3, max_model_len=256, max_num_seqs=64),
                    model_config=ModelConfig(flavor=args.flavor, max_seq_len=256), shape=shape, seed=0,
                    device=args.device, workdir=Path(tempfile.mkdtemp()))
    model = build_titan_model(shape, seed=1, device=args.device)

    def free() -> int:
        if not cuda:
            return 0
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    ws = WeightSync(WeightSyncConfig(verify="sampled", verify_samples=4), reference=state, generator=gen)
    ws.sync(state, version=1)
    ws.sync(state, version=2)  # frozen buffers skipped from now on
    prompts = [[int(t) for t in torch.randint(0, shape.vocab_size, (24,), generator=torch.Generator().manual_seed(i))]
               for i in range(16)]

    def rollouts():
        r = gen.generate(prompts, n=4, seed=7)
        return r.completion_ids, r.logprobs

    reference = rollouts()
    out = {"flavor": args.flavor, "tensors": len(ws.keys), "constants": len(ws.plan.constants)}
    free_awake = free()
    gen.sleep(2)
    ws.weights_discarded()
    out["freed_by_level_2_gib"] = (free() - free_awake) / GIB
    try:
        gen.generate(prompts[:1])
        out["refused_while_asleep"] = False
    except WeightsNotSyncedError:
        out["refused_while_asleep"] = True
    gen.wake()
    out["all_nan_after_wake"] = all(bool(t.isnan().all()) for t in gen.model.all_tensors().values())
    try:
        gen.generate(prompts[:1])
        out["refused_after_wake"] = False
    except WeightsNotSyncedError as e:
        out["refused_after_wake"] = str(e)
    stats = ws.sync(state, version=3)
    out["first_sync_after_wake"] = {"bytes": stats.bytes_written, "all_bytes": sum(ws.sizes.values()),
                                    "verified": stats.tensors_verified, "seconds": stats.seconds}
    out["level_2_equal"] = rollouts() == reference
    again = ws.sync(state, version=4)
    out["next_sync"] = {"bytes": again.bytes_written, "verified": again.tensors_verified, "seconds": again.seconds}
    gen.sleep(1)
    out["freed_by_level_1_gib"] = (free() - free_awake) / GIB
    out["level_1_equal"] = rollouts() == reference  # generate wakes the engine: weights back from host memory
    ok = (out["refused_while_asleep"] and out["all_nan_after_wake"] and out["refused_after_wake"]
          and stats.bytes_written == out["first_sync_after_wake"]["all_bytes"]
          and stats.tensors_verified == len(ws.keys) + len(ws.plan.constants)
          and out["level_2_equal"] and out["level_1_equal"] and (out["freed_by_level_2_gib"] > 0 or not cuda))
    out["ok"] = bool(ok)
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    gen.close()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
