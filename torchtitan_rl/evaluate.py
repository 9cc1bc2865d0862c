"""Score any Hugging Face folder on named evaluation sets, as the training loop does, in vLLM; a JSON report.

    python -m torchtitan_rl.evaluate --model DIR --set NAME=FILE [--set NAME=FILE ...] --out report.json
    python -m torchtitan_rl.evaluate --run-dir RUN [--step K] [--set NAME=FILE ...] --out report.json

``--model``: any folder vLLM loads as Qwen3 or Llama (the base checkpoint, a
run's export); prompts in its tokenizer's chat template. ``--run-dir``: a run
folder (or a job.output_dir: its latest run); checkpoint step K (default: the
newest that verifies) is exported to a temporary folder first (export.py),
and the run's config gives everything the loop's evaluation used: its task's
held-out set (when the run evaluated, reported as the set ``heldout``), its
eval.sets (``--set`` adds more), system prompt and instruction, length limits,
verifiers, sampling temperature (mean@k), generator settings, dtype and seed.
Both together (``--run-dir RUN --model RUN/hf``) score that folder, e.g. the
run's own export, with the run's settings. Either way the sets are read,
rendered and verified by the loop's own code (grpo/eval_sets.py,
grpo/evaluate.py) on the same engine class, so a run's exported weights score
here what its final evaluation logged.
"""

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from torchtitan_rl import collector
from torchtitan_rl.run.exits import one_line_errors
from torchtitan_rl.config import EvalConfig, EvalSetConfig, GeneratorConfig, ModelConfig, SamplingConfig, TaskConfig
from torchtitan_rl.config.toml_io import load_toml
from torchtitan_rl.config.validation import effective_task, tokenizer_dir

_TASK = TaskConfig()


def parse_sets(specs: list[str], *, prompt_field: str, answer_field: str, verifier: str, numeric_answer: str,
               num_prompts: int, mean_at_k: int) -> list[EvalSetConfig]:
    """``NAME=FILE`` arguments as set configs (checked as the loop checks eval.sets)."""
    sets = []
    for i, spec in enumerate(specs):
        name, eq, path = spec.partition("=")
        if not eq:
            raise ValueError(f"--set: expected NAME=FILE, got {spec!r}")
        s = EvalSetConfig(name=name, path=path, prompt_field=prompt_field, answer_field=answer_field,
                          verifier=verifier, numeric_answer=numeric_answer, num_prompts=num_prompts,
                          mean_at_k=mean_at_k)
        s.check(f"--set[{i}]")
        if not Path(path).exists():
            raise ValueError(f"--set {name}: not found: {path}")
        sets.append(s)
    return sets


def evaluate(args: argparse.Namespace) -> dict:
    """Build the sets and the engine, score, and return the report (also written to ``--out``)."""
    with collector.paused():  # start-up (collector.py)
        from torchtitan_rl.engine.engine import Engine
        from torchtitan_rl.grpo.eval_sets import EvalSet
        from torchtitan_rl.grpo.evaluate import Evaluator
        from torchtitan_rl.grpo.tasks.chat import load_chat_tokenizer
        from torchtitan_rl.run.parts import run_device, run_task
        from torchtitan_rl.models.families import resolve_shape
        from torchtitan_rl.models.hf_folder import check_hf_folder, check_weights
        from torchtitan_rl.run.folder import run_to_resume

    added = parse_sets(args.set or [], prompt_field=args.prompt_field, answer_field=args.answer_field,
                       verifier=args.verifier, numeric_answer=args.numeric_answer, num_prompts=args.num_prompts,
                       mean_at_k=args.mean_at_k)
    run = cfg = None
    if args.run_dir is not None:
        run = run_to_resume(Path(args.run_dir))
        if run is None:
            raise ValueError(f"--run-dir: {args.run_dir} has no config.toml and no latest run")
        cfg = load_toml(run / "config.toml")
    sets = list(cfg.eval.sets if cfg else ()) + added
    # The run's held-out set where its loop scored one (the task's own prompts, verifier and episodes).
    task = run_task(cfg) if cfg is not None and cfg.eval.every_n_steps else None
    if not sets and not (task and task.heldout_prompts()):
        raise ValueError("--set: no evaluation sets (give --set NAME=FILE, or a --run-dir whose config has eval.sets "
                         "or a task with a held-out set)")
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise ValueError(f"--set: set names must differ, got {names}")

    if cfg is not None:  # the run's settings, as its loop evaluated
        eval_config = dataclasses.replace(cfg.eval, every_n_steps=1, sets=tuple(sets))
        sampling, dtype, seed = cfg.generator.sampling, cfg.model.dtype, cfg.job.seed
        generator_config = dataclasses.replace(cfg.generator, load_format="auto")
        system_prompt, instruction, tokenizer_folder = cfg.task.system_prompt, cfg.task.instruction, tokenizer_dir(cfg)
    else:
        eval_config = EvalConfig(every_n_steps=1, max_tokens=args.max_tokens, sets=tuple(sets))
        sampling = SamplingConfig(temperature=args.temperature, max_tokens=args.max_tokens)
        dtype, seed = args.dtype, args.seed
        generator_config = GeneratorConfig(load_format="auto", max_model_len=args.max_model_len,
                                           kv_cache_memory_gb=args.kv_cache_gb,
                                           gpu_memory_utilization=args.gpu_memory_utilization,
                                           enforce_eager=args.enforce_eager)
        system_prompt = args.system_prompt if args.system_prompt is not None else _TASK.system_prompt
        instruction = args.instruction if args.instruction is not None else _TASK.instruction
        tokenizer_folder = args.model
    generator_config.sampling = sampling
    device = run_device(args.device)

    with tempfile.TemporaryDirectory(prefix="torchtitan_rl_evaluate_") as tmp:
        model_dir = args.model
        if args.model is None:
            from torchtitan_rl.export import export_checkpoint

            model_dir = str(export_checkpoint(run, out=Path(tmp) / "hf", step=args.step))
            tokenizer_folder = tokenizer_folder or model_dir
        check_hf_folder(model_dir, field="--model")
        check_weights(model_dir, field="--model")  # the trainer's check of model.hf_checkpoint: vLLM's is a traceback
        tokenizer = load_chat_tokenizer(tokenizer_folder, field="--model")
        max_len = generator_config.max_model_len
        loaded = [
            EvalSet(s, field=f"--set {s.name}" if s in added else f"eval.sets[{i}]", tokenizer=tokenizer,
                    system_prompt=system_prompt, instruction=instruction,
                    max_prompt_tokens=max_len - (s.max_tokens or eval_config.max_tokens or sampling.max_tokens))
            for i, s in enumerate(sets)
        ]  # every file read before the engine starts
        shape = resolve_shape(flavor="tiny", hf_checkpoint=model_dir, vocab_size=0, max_seq_len=max_len)
        if max(tokenizer.get_vocab().values()) >= shape.vocab_size:
            raise ValueError(f"--model: the tokenizer of {tokenizer_folder} has ids past {model_dir}'s vocab_size "
                             f"{shape.vocab_size}")
        generator = Engine(generator_config, model_config=ModelConfig(hf_checkpoint=model_dir, dtype=dtype),
                           shape=shape, seed=seed, device=device.type, workdir=Path(tmp))
        try:
            evaluator = Evaluator(eval_config, task=task, spec="", sampling=sampling, seed=seed,
                                  max_total_tokens=max_len, sets=loaded)
            metrics = evaluator.run(generator, step=args.step if args.step is not None else 0)
        finally:
            generator.close()
    report = {
        "model": str(args.model) if args.model is not None else None,
        "run_dir": str(run) if run is not None else None,
        "step": args.step,
        "dtype": dtype,
        "device": device.type,
        "metrics": metrics,
        "sets": {
            suite.name: {
                **({"task": effective_task(cfg), "numeric_answer": cfg.task.numeric_answer} if suite.source is task else
                   {"path": suite.source.path, "verifier": suite.source.config.verifier,
                    "numeric_answer": suite.source.config.numeric_answer}),
                **_suite_metrics(suite, metrics),
                "problems": evaluator.results[suite.name],
            }
            for suite in evaluator.suites
        },
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


def _suite_metrics(suite, metrics: dict[str, float]) -> dict[str, float]:
    """One set's metrics named without their eval_ prefix and /NAME suffix (accuracy, accuracy_se, ...)."""
    metric = {key: key.removeprefix("eval_").partition("/")[0] for key in metrics}
    return {metric[key]: value for key, value in metrics.items()
            if key == suite.key(metric[key]) and metric[key] not in ("weight_version", "s")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m torchtitan_rl.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="an HF folder (config.json, safetensors, tokenizer with a chat template)")
    parser.add_argument("--run-dir", help="a run folder, or a job.output_dir (its latest run): its checkpoint (or "
                                          "--model) is scored with the run's settings and sets")
    parser.add_argument("--step", type=int, default=None, help="--run-dir: checkpoint step (default: the newest)")
    parser.add_argument("--set", action="append", metavar="NAME=FILE",
                        help="a named set: .jsonl/.parquet file or datasets folder (repeatable)")
    parser.add_argument("--out", help="write the JSON report here")
    parser.add_argument("--prompt-field", default="question", help="--set files: field of the question")
    parser.add_argument("--answer-field", default="answer", help="--set files: field of the answer")
    parser.add_argument("--verifier", choices=("math_verify", "exact"), default="math_verify")
    parser.add_argument("--numeric-answer", choices=("number", "expression"), default="number",
                        help="--set files, math_verify: a numeric answer must be a number as written (number: "
                             "'38 + 81' does not count for 119), or any expression equal to it (expression); "
                             "as eval.sets[i].numeric_answer")
    parser.add_argument("--num-prompts", type=int, default=0, help="--set files: the first N problems; 0: all")
    parser.add_argument("--mean-at-k", type=int, default=0, help="--set files: also k samples per problem")
    g = parser.add_argument_group("without --run-dir (a --run-dir takes its run's)")
    g.add_argument("--max-tokens", type=int, default=256, help="completion length limit")
    g.add_argument("--temperature", type=float, default=1.0, help="mean@k's sampling temperature")
    g.add_argument("--system-prompt", default=None, help=f"default: {_TASK.system_prompt!r}")
    g.add_argument("--instruction", default=None, help=f"default: {_TASK.instruction!r}")
    g.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    g.add_argument("--max-model-len", type=int, default=1024, help="longest prompt + completion")
    g.add_argument("--kv-cache-gb", type=float, default=1.0, help="CPU: KV-cache size in GiB")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args = parser.parse_args(argv)
    if args.model is None and args.run_dir is None:
        parser.error("give --model DIR, --run-dir RUN, or both")
    if args.step is not None and (args.run_dir is None or args.model is not None):
        parser.error("--step needs --run-dir (it names a checkpoint; with --model the folder given is scored)")
    with one_line_errors():
        report = evaluate(args)
    for name, s in report["sets"].items():
        print(f"torchtitan_rl: {name}: accuracy {s['accuracy']:.3f} +- {s['accuracy_se']:.3f} "
              f"({s['prompts']} problems)", file=sys.stderr)
    if args.out:
        print(f"torchtitan_rl: report {args.out}", file=sys.stderr)
    else:
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
