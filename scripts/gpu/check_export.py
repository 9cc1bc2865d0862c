"""The exported policy in vLLM's own engine, unmodified: greedy held-out accuracy beside the training run's.

    python3 scripts/gpu/check_export.py --run-dir /tmp/runs/x --export /tmp/runs/x/hf --json $OUT/export.json

Loads the folder that ``job.export_dir`` wrote with vLLM's native model class
(the architecture named in its config.json, not our TorchTitan wrapper),
answers the first ``eval.num_prompts`` held-out problems greedily and scores
them with the task's reward; the run's last evaluation scored the same
problems on the training generator. Both run bf16 with different kernels, so
a few answers may differ.
"""

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--export", required=True)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from torchtitan_rl.config import load_toml
    from torchtitan_rl.run.folder import run_to_resume
    from torchtitan_rl.run.parts import run_task

    run_dir = run_to_resume(Path(args.run_dir))  # a job.output_dir: its latest run
    cfg = load_toml(run_dir / "config.toml")
    task = run_task(cfg)
    evals = [r for r in map(json.loads, (run_dir / "metrics.jsonl").open()) if "eval_accuracy" in r]
    prompts = task.heldout_prompts()[: evals[-1]["eval_prompts"]]
    architectures = json.loads((Path(args.export) / "config.json").read_text())["architectures"]
    llm = LLM(model=args.export, dtype=cfg.model.dtype, gpu_memory_utilization=0.3,
              max_model_len=cfg.generator.max_model_len, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=cfg.eval.max_tokens or cfg.generator.sampling.max_tokens,
                            stop_token_ids=[task.eos_id])
    outputs = llm.generate([{"prompt_token_ids": p.token_ids} for p in prompts], params)
    hits = [task.correct(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outputs)]
    result = {
        "architectures": architectures,
        "prompts": len(prompts),
        "native_vllm_accuracy": sum(hits) / len(hits),
        "training_generator_accuracy": evals[-1]["eval_accuracy"],
        "training_generator_step": evals[-1]["step"],
        "sample": task.completion_text(list(outputs[0].outputs[0].token_ids))[:300],
    }
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
