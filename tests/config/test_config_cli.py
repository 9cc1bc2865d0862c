"""The real entry point as a user runs it: bad input is one line on stderr and exit 2."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import assert_one_line_error, run_cli
from torchtitan_rl.config import JobConfig, load_toml, parse_args
from torchtitan_rl.run.folder import run_to_resume

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def toml(tmp_path):
    def write(text):
        path = tmp_path / "bad.toml"
        path.write_text(text)
        return str(path)

    return write


# -- TOML file ------------------------------------------------------------------


def test_unknown_toml_key_suggests_closest(toml):
    path = toml("[trainer.optimzer]\nlr = 1e-4\n")
    line = assert_one_line_error(run_cli("--config", path))
    assert line == (
        f"config error: {path}: unknown key 'trainer.optimzer' (did you mean 'trainer.optimizer'?)"
    )


def test_unknown_toml_leaf_key_suggests_closest(toml):
    assert_one_line_error(
        run_cli("--config", toml("[generator.sampling]\ntemprature = 0.7\n")),
        "'generator.sampling.temprature'", "did you mean 'generator.sampling.temperature'",
    )  # fmt: skip


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[trainer]\nsteps = 'ten'\n", "trainer.steps: expected int, got str 'ten'"),
        ("[trainer]\nsteps = true\n", "trainer.steps: expected int, got bool True"),
        ("[trainer.optimizer]\nlr = '1e-4'\n", "trainer.optimizer.lr: expected float, got str"),
        ("[trainer.optimizer]\nbetas = [0.9]\n", "trainer.optimizer.betas: expected an array of 2"),
        ("[trainer.optimizer]\nbetas = [0.9, 'x']\n", "trainer.optimizer.betas[1]: expected float"),
        ("[model]\ndtype = 'fp8'\n", "model.dtype: expected one of 'bfloat16'"),
        ("[model]\nhf_checkpoint = 3\n", "model.hf_checkpoint: expected str, got int 3"),
        ("trainer = 3\n", "trainer: expected a table, got int 3"),
    ],
)
def test_wrong_toml_type_names_the_field(toml, text, expected):
    assert_one_line_error(run_cli("--config", toml(text)), expected)


def test_missing_config_file():
    assert_one_line_error(run_cli("--config", "no/such.toml"), "--config", "no/such.toml")


def test_toml_syntax_error_names_file_and_line(toml):
    path = toml("[trainer]\nsteps = 3\nlr 1e-4\n")
    assert_one_line_error(run_cli("--config", path), f"{path}:3: invalid TOML")


# -- command line -----------------------------------------------------------------


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--trainer.optimizer.lr", "abc"], "trainer.optimizer.lr: "),
        (["--trainer.micro-batch-size", "x"], "trainer.micro_batch_size: "),
        (["--model.dtype", "fp8"], "model.dtype: expected one of"),
        (["--trainer.optimzer.lr", "1"], "did you mean '--trainer.optimizer.lr'"),
        (["--trainer.steps"], "trainer.steps: expected 1 value"),
        (["--trainer.optimizer.betas", "0.9"], "trainer.optimizer.betas: expected 2 values"),
        (["--weight_sync.enable", "maybe"], "weight_sync.enable: expected true or false"),
        (["--config"], "--config: expected a path"),
    ],
)
def test_bad_cli_value_names_the_field(args, expected):
    assert_one_line_error(run_cli(*args), expected)


# -- impossible combinations (validate) ----------------------------------------------


@pytest.mark.parametrize(
    "args, world_size, expected",
    [
        (["--batch-invariant-mode", "--model.dtype", "float32"], 1, "batch_invariant_mode"),
        (
            ["--trainer.parallelism.data_parallel_shard_degree", "2"], 4,
            "trainer.parallelism: data_parallel_shard_degree (2) * ",
        ),
        (["--trainer.parallelism.tensor_parallel_degree", "3"], 4, "trainer.parallelism: "),
        (["--generator.parallelism.tensor_parallel_degree", "3"], 4, "generator.parallelism: "),
        (
            ["--batch-invariant-mode", "--generator.parallelism.tensor_parallel_degree", "2"], 2,
            "batch_invariant_mode: needs trainer.parallelism.tensor_parallel_degree and generator.parallelism."
            "tensor_parallel_degree 1, got 1 and 2",
        ),
        (
            ["--batch-invariant-mode", "--generator.sampling.top_p", "0.9"], 1,
            "batch_invariant_mode: needs generator.sampling.top_p 1",
        ),
        (
            ["--batch-invariant-mode", "--trainer.parallelism.tensor_parallel_degree",
             "2", "--generator.parallelism.tensor_parallel_degree", "2"], 2,
            "batch_invariant_mode: needs trainer.parallelism.tensor_parallel_degree and generator",
        ),
        (
            ["--batch-invariant-mode", "--generator.kv_cache_dtype", "fp8"], 1,
            "batch_invariant_mode: needs generator.kv_cache_dtype 'auto', got 'fp8'",
        ),
        (
            ["--batch-invariant-mode", "--generator.attention_backend", "TRITON_ATTN"], 1,
            "batch_invariant_mode: needs generator.attention_backend 'auto' or 'FLASH_ATTN', got 'TRITON_ATTN'",
        ),
        (
            ["--batch-invariant-mode", "--model.lora.rank", "4", "--model.lora.sync", "merged"], 1,
            "batch_invariant_mode: needs model.lora.sync 'adapter'",
        ),
        (["--model.lora.rank", "4", "--model.lora.target-modules", "wq"], 1, "model.lora.target_modules"),
        (["--generator.sleep", "weights", "--weight_sync.transport", "server", "--serve.token", "t"], 1,
         "generator.sleep: 'weights' frees a colocated engine's memory"),
        (["--trainer.cpu_offload", "--weight_sync.transport", "nccl"], 2,
         "trainer.cpu_offload: supported with weight_sync.transport 'inplace' only"),
        (["--generator.sleep", "weights", "--weight_sync.enable", "false"], 1,
         "generator.sleep: 'weights' drops the engine's weights every step"),
        (["--trainer.steps", "0"], 1, "trainer.steps: must be >= 1"),
        (["--grpo.group_size", "1"], 1, "grpo.group_size: must be >= 2"),
        (["--grpo.prompts_per_step", "0"], 1, "grpo.prompts_per_step: must be >= 1"),
        (["--trainer.micro_batch_size", "0"], 1, "trainer.micro_batch_size: must be >= 1"),
        (["--trainer.micro_batch_tokens", "32"], 1,
         "trainer.micro_batch_tokens: 32 tokens is less than generator.max_model_len 64, the longest row"),
        (["--trainer.recompute_micro_batch_tokens", "63"], 1, "trainer.recompute_micro_batch_tokens: 63 tokens"),
        (["--grpo.task_without_checkpoint", "digits", "--grpo.harness_lengths.distribution", "lognormal",
          "--weight_sync.transport", "server", "--serve.token", "t"], 1,
         "grpo.harness_lengths: drawn lengths are set by the in-process engine"),
        (["--grpo.partial.enable", "--grpo.max_staleness", "1"], 1,
         "grpo.partial.max_token_age: 1 is below 2 x grpo.max_staleness + 1 = 3"),
        (["--grpo.partial.enable", "--grpo.dynamic_sampling"], 1,
         "grpo.dynamic_sampling: not with grpo.partial.enable"),
        (["--grpo.partial.enable", "--weight_sync.transport", "server", "--serve.token", "t"], 1,
         "grpo.partial.enable: the rollout server (weight_sync.transport 'server') answers whole completions only"),
        (["--grpo.partial.enable", "--weight_sync.enable", "false"], 1, "grpo.partial.enable: its bound counts"),
        (["--grpo.partial.over_sample", "-1"], 1, "grpo.partial.over_sample: must be >= 0"),
        (["--generator.inflight_updates"], 1, "generator.inflight_updates: a sync lands in a running generate"),
        (["--generator.stream_groups"], 1, "generator.stream_groups: groups stream from a generator on its own rank"),
        (["--generator.overlap_training", "--grpo.max_staleness", "1", "--weight_sync.transport", "nccl"], 2,
         "generator.overlap_training: overlaps a colocated engine's generate with training"),
        (["--generator.overlap_training"], 1, "generator.overlap_training: needs grpo.max_staleness >= 1"),
        (["--generator.overlap_training", "--grpo.max_staleness", "1", "--generator.sleep", "weights"], 1,
         "generator.overlap_training: the engine generates while the trainer steps, so it cannot sleep"),
        (["--grpo.clip_eps_high", "1.0"], 1, "grpo.clip_eps_high: must be in [0, 1)"),
        (["--grpo.clip_eps_low", "-0.1"], 1, "grpo.clip_eps_low: must be in [0, 1)"),
        (["--grpo.max_staleness", "-1"], 1, "grpo.max_staleness: must be >= 0"),
        (["--grpo.importance_cap", "1"], 1, "grpo.importance_cap: must be > 1"),
        (["--generator.sampling.top_p", "0"], 1, "generator.sampling.top_p: must be in (0, 1]"),
        (["--generator.gpu_memory_utilization", "1.5"], 1, "generator.gpu_memory_utilization"),
        (["--generator.sampling.max_tokens", "64"], 1, "generator.sampling.max_tokens: 64"),
        (["--generator.load_format", "auto"], 1, "generator.load_format: 'auto' needs"),
        (["--weight_sync.verify_samples", "0"], 1, "weight_sync.verify_samples: must be >= 1"),
        (["--weight_sync.bucket_mb", "0"], 1, "weight_sync.bucket_mb: must be >= 1"),
        (["--grpo.task", "math"], 1, "task.tokenizer: grpo.task 'math' renders prompts with a chat template"),
        (["--grpo.task", "dataset", "--task.tokenizer", "tok"], 1, "task.path: grpo.task 'dataset' needs"),
        (
            ["--grpo.task", "dataset", "--task.tokenizer", "tok", "--task.path", "missing.jsonl"], 1,
            "task.path: file not found: missing.jsonl",
        ),
        (["--eval.every_n_steps", "5"], 1, "eval.every_n_steps: grpo.task 'digits' has no held-out set"),
        (["--eval.num_prompts", "-1"], 1, "eval.num_prompts: must be >= 0"),
        (["--eval.max_tokens", "64"], 1, "eval.max_tokens: 64 leaves no room for a prompt"),
        (["--task.levels", "0", "6"], 1, "task.levels: each must be in 1..5, got [0, 6]"),
        (["--task.heldout_fraction", "1"], 1, "task.heldout_fraction: must be in [0, 1)"),
        (["--task.format_reward_weight", "-1"], 1, "task.format_reward_weight: must be >= 0"),
        (["--trainer.checkpoint.folder", "/abs", "--dry-run"], 1, "trainer.checkpoint.folder: must be a sub-folder"),
        (["--trainer.checkpoint.folder", "../x", "--dry-run"], 1, "trainer.checkpoint.folder: must be a sub-folder"),
        (
            ["--grpo.prompts_per_step", "3", "--grpo.group_size", "3", "--dry-run"], 2,
            "grpo.prompts_per_step: grpo.prompts_per_step x grpo.group_size (9) must divide over the 2",
        ),
        (
            ["--grpo.prompts_per_step", "2", "--grpo.group_size", "2", "--grpo.mini_batches", "3", "--dry-run"], 2,
            "grpo.mini_batches: 3 is more than the 2 rows each data-parallel trainer rank trains on",
        ),
    ],
)  # fmt: skip
def test_impossible_combination_names_the_field(tmp_path, args, world_size, expected):
    proc = run_cli(*args, "--job.output_dir", str(tmp_path), world_size=world_size)
    assert_one_line_error(proc, expected)
    assert not (tmp_path / "config.toml").exists() and not (tmp_path / "dry-run.toml").exists()


def test_cpu_offload_on_a_cpu_run_is_refused_naming_the_field(tmp_path):
    """It moves the trainer's state into host memory, where a CPU run has it: it meant nothing and was accepted
    silently. job.device cpu is refused at parsing; 'auto' when the run finds no GPU, before anything loads."""
    import torch

    from torchtitan_rl import simple_grpo

    proc = run_cli("--config", "run_configs/cpu_tiny.toml", "--trainer.cpu_offload", "--job.output_dir",
                   str(tmp_path), "--dry-run")
    assert_one_line_error(proc, "trainer.cpu_offload: moves the trainer's state from the GPU into host memory, "
                                "where a CPU run (job.device cpu) keeps it already; set it false")
    if torch.cuda.is_available():
        return
    cfg = load_toml(REPO / "run_configs" / "cpu_tiny.toml")
    cfg.job.device, cfg.trainer.cpu_offload, cfg.job.output_dir = "auto", True, str(tmp_path / "out")
    with pytest.raises(ValueError, match=r"^trainer\.cpu_offload: moves the trainer's state"):
        simple_grpo.train(cfg)
    assert not (tmp_path / "out").exists()


def test_parallel_degrees_that_fit_the_world_size_are_accepted(tmp_path):
    proc = run_cli(
        "--trainer.parallelism.data_parallel_shard_degree", "2",
        "--trainer.parallelism.tensor_parallel_degree", "2",
        "--generator.parallelism.tensor_parallel_degree", "2",
        "--job.output_dir", str(tmp_path), "--dry-run", world_size=4,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


# -- a good run, --help ------------------------------------------------------------------


def test_run_writes_resolved_config_that_loads_back_equal(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = ["--config", "run_configs/cpu_tiny.toml", "--job.output-dir", str(tmp_path / "run")]
    args += ["--trainer.optimizer.betas", "0.8", "0.9", "--model.hf_checkpoint", "/w", "--dry-run"]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert "torchtitan_rl: config valid" in proc.stdout
    monkeypatch.chdir(REPO)
    assert load_toml(tmp_path / "run" / "dry-run.toml") == parse_args(args)
    assert run_to_resume(tmp_path / "run") is None  # a validated config is no run to resume


def _field_docstrings():
    """Every attribute docstring in job_config.py, as tyro reads them."""
    tree = ast.parse((REPO / "torchtitan_rl/config/job_config.py").read_text())
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for prev, node in zip(cls.body, cls.body[1:]):
            if isinstance(prev, ast.AnnAssign) and isinstance(node, ast.Expr):
                yield f"{cls.name}.{prev.target.id}", node.value.value


def _plain(text):
    return " ".join(re.sub(r"[\u2500-\u257f]", " ", text).split())


def test_help_shows_every_field_docstring():
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    help_text = _plain(proc.stdout)
    assert "--generator.sampling.top-p FLOAT Nucleus sampling mass." in help_text
    assert "--config FILE.toml" in help_text
    docs = dict(_field_docstrings())
    assert len(docs) > 50
    # eval.sets is an array of tables: tyro shows a set's fields (--eval.sets.0.name, ...) once a file holds one.
    sets = {name for name in docs if name == "EvalConfig.sets" or name.startswith("EvalSetConfig.")}
    missing = [name for name, doc in docs.items() if name not in sets and _plain(doc) not in help_text]
    assert not missing
    assert "Named evaluation sets are [[eval.sets]] tables in the file" in help_text
    with_sets = _plain(run_cli("--config", "run_configs/smollm2_135m_math.toml", "--help").stdout)
    missing = [name for name in sets - {"EvalConfig.sets"} if _plain(docs[name]) not in with_sets]
    assert not missing and "--eval.sets.0.name STR" in with_sets


def test_config_package_does_not_import_torch_or_vllm():
    code = (
        "import sys, torchtitan_rl.config; "
        "heavy = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# -- NaN and inf -----------------------------------------------------------------------


def _float_fields() -> list[str]:
    """Every float field of the tree (tuples of floats included), found by walking the dataclasses."""
    import typing

    from torchtitan_rl.config.checks import leaf_types

    def is_float(tp) -> bool:
        args = typing.get_args(tp)
        return tp is float or float in args or (typing.get_origin(tp) is tuple and args[0] is float)

    return sorted(path for path, tp in leaf_types(JobConfig).items() if is_float(tp))


def test_float_field_walk_finds_the_known_ones():
    fields = _float_fields()
    for known in ("trainer.optimizer.lr", "trainer.max_grad_norm", "grpo.kl_coef", "trainer.optimizer.betas",
                  "generator.sampling.temperature", "trainer.collective_timeout_s", "serve.max_body_mb"):
        assert known in fields
    assert len(fields) >= 20, fields


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("path", _float_fields())
def test_every_float_field_refuses_nan_and_inf_by_name(tmp_path, capsys, path, value):
    from torchtitan_rl.config.checks import get

    default = get(parse_args([]), path)
    n = len(default) if isinstance(default, tuple) else 1
    values = ["0.9"] * (n - 1) + [value]
    with pytest.raises(SystemExit) as exit:
        parse_args(["--dry-run", "--job.output_dir", str(tmp_path), f"--{path}", *values])
    assert exit.value.code == 2
    suffix = f"[{n - 1}]" if n > 1 else ""
    assert capsys.readouterr().err == f"config error: {path}{suffix}: must be a finite number, got {float(value)}\n"
    assert not (tmp_path / "config.toml").exists() and not (tmp_path / "dry-run.toml").exists()


def test_nan_in_toml_is_refused_in_dry_run(toml, tmp_path):
    proc = run_cli("--config", toml("[trainer.optimizer]\nlr = nan\n"), "--dry-run", "--job.output_dir", str(tmp_path))
    assert_one_line_error(proc, "trainer.optimizer.lr: must be a finite number, got nan")
    assert not (tmp_path / "config.toml").exists() and not (tmp_path / "dry-run.toml").exists()


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--generator.sampling.temperature", "0"], "generator.sampling.temperature: must be in (0, 2], got 0.0"),
        (["--trainer.optimizer.eps", "-1e-8"], "trainer.optimizer.eps: must be >= 0"),
        (["--trainer.collective_timeout_s", "0"], "trainer.collective_timeout_s: must be > 0"),
        (["--weight_sync.peer_timeout_s", "-1"], "weight_sync.peer_timeout_s: must be > 0"),
        (
            ["--generator.sampling.top_p", "0.8", "--grpo.importance_correction", "truncate"],
            "grpo.importance_correction: 'truncate' needs the generator's logprobs of the full distribution, but "
            "generator.sampling.top_p 0.8 / top_k -1",
        ),
        (
            ["--generator.sampling.top_k", "20", "--grpo.importance_correction", "mask"],
            "grpo.importance_correction: 'mask' needs",
        ),
    ],
)  # fmt: skip
def test_values_the_engine_or_the_trainer_would_refuse_are_config_errors(tmp_path, capsys, args, expected):
    with pytest.raises(SystemExit) as exit:
        parse_args(["--dry-run", "--job.output_dir", str(tmp_path), *args])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and expected in err and err.count("\n") == 1, err


def test_truncated_sampling_without_correction_is_accepted():
    cfg = parse_args(["--generator.sampling.top_p", "0.8", "--generator.sampling.top_k", "20"])
    assert cfg.grpo.importance_correction == "off"


def test_collective_timeout_default_outlasts_a_long_generation():
    assert parse_args([]).trainer.collective_timeout_s >= 1800


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a machine without CUDA")
def test_cuda_config_on_a_cpu_machine_is_one_line_naming_the_cpu_configs(tmp_path):
    proc = run_cli("--config", str(REPO / "run_configs" / "qwen3_0.6b.toml"), "--job.output_dir", str(tmp_path))
    assert_one_line_error(
        proc, "job.device: this config needs a CUDA GPU", "run_configs/cpu_tiny.toml",
        "run_configs/smollm2_135m_math_cpu.toml", prefix="torchtitan_rl: error: ",
    )
