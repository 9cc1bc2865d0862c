"""Named evaluation sets (eval.sets): a file of (question, answer) records, asked and scored as training's are.

A set is read once (JSONL, Parquet, or a folder datasets' save_to_disk wrote),
rendered in the run's chat template with the run's system prompt and
instruction unless the set names its own (tasks/chat.py's ``chat_prompt``:
the very function training's prompts come from), and scored by math-verify
(training's correctness reward, grpo/rewards.py, with the set's own
``numeric_answer``) or by exact match. It offers
the evaluator the part of the Task interface it reads (``rollouts``,
``correct``, ``reward``, ``completion_text``), so the loop's evaluation and
the standalone evaluator (torchtitan_rl/evaluate.py) score a set alike.
"""

from torchtitan_rl.config import EvalSetConfig, JobConfig
from torchtitan_rl.config.validation import tokenizer_dir
from torchtitan_rl.grpo import rewards
from torchtitan_rl.grpo.tasks.base import Prompt
from torchtitan_rl.grpo.tasks.chat import chat_prompt, load_chat_tokenizer
from torchtitan_rl.grpo.tasks.dataset import read_records


def _exact(text: str, answer: str) -> float:
    return float(text.strip() == answer)


def verifier(config: EvalSetConfig) -> rewards.RewardFn:
    """eval.sets[i].verifier (and numeric_answer, for math_verify) -> (completion text, reference answer) -> 1.0
    solved, 0.0 not."""
    return _exact if config.verifier == "exact" else rewards.CORRECT[config.numeric_answer]


class EvalSet:
    """One named set's prompts in a chat template, and its verifier."""

    def __init__(self, config: EvalSetConfig, *, field: str, tokenizer, system_prompt: str, instruction: str,
                 max_prompt_tokens: int | None = None) -> None:
        """``field``: the config path that names it in errors (eval.sets[i]); ``system_prompt`` and
        ``instruction``: the run's, used where the set names none."""
        self.config, self.name, self.path = config, config.name, config.path
        records = read_records(config.path, field=f"{field}.path", prompt_field=config.prompt_field,
                               answer_field=config.answer_field, fields=field, split=config.split)
        if config.num_prompts:
            records = records[: config.num_prompts]
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.verify = verifier(config)
        system = config.system_prompt if config.system_prompt is not None else system_prompt
        instruction = config.instruction if config.instruction is not None else instruction
        self.prompts = [chat_prompt(tokenizer, q, a, system_prompt=system, instruction=instruction) for q, a in records]
        longest = max(self.prompts, key=lambda p: len(p.token_ids))
        if max_prompt_tokens is not None and len(longest.token_ids) > max_prompt_tokens:
            raise ValueError(
                f"{field}.path: a question in {config.path} takes {len(longest.token_ids)} tokens in the chat "
                f"template, more than the {max_prompt_tokens} that generator.max_model_len leaves beside the "
                f"set's max_tokens: {longest.text[:80]!r}..."
            )

    def rollouts(self, generator, prompts: list[Prompt], *, n: int, sampling, seed: int, max_total_tokens: int):
        """One turn per prompt, ``n`` samples each, ending at the chat template's eos (as Task.submit)."""
        del max_total_tokens  # one turn: vLLM's own limit
        return generator.submit([p.token_ids for p in prompts], n=n, stop_token_ids=[self.eos_id], seed=seed,
                                sampling=sampling).result()

    def completion_text(self, completion_ids: list[int]) -> str:
        return self.tokenizer.decode(completion_ids, skip_special_tokens=True)

    def correct(self, prompt: Prompt, completion_ids: list[int]) -> bool:
        return self.verify(self.completion_text(completion_ids), prompt.target) == 1.0

    def reward(self, prompt: Prompt, completion_ids: list[int]) -> float:
        return float(self.correct(prompt, completion_ids))


def load_eval_sets(cfg: JobConfig) -> list[EvalSet]:
    """The run's eval.sets, read and rendered (every file read now: a bad one stops the run before its
    folder exists), in the chat template of the run's tokenizer folder."""
    if not cfg.eval.sets:
        return []
    folder = tokenizer_dir(cfg)
    assert folder is not None, "validate checks eval.sets have a tokenizer"
    field = "task.tokenizer" if cfg.task.tokenizer else "model.hf_checkpoint"
    tokenizer = load_chat_tokenizer(folder, field=field)
    return [
        EvalSet(s, field=f"eval.sets[{i}]", tokenizer=tokenizer, system_prompt=cfg.task.system_prompt,
                instruction=cfg.task.instruction,
                max_prompt_tokens=cfg.generator.max_model_len - set_max_tokens(cfg, s))
        for i, s in enumerate(cfg.eval.sets)
    ]


def set_max_tokens(cfg: JobConfig, s: EvalSetConfig) -> int:
    """A set's completion limit: its own, else eval.max_tokens, else generator.sampling.max_tokens."""
    return s.max_tokens or cfg.eval.max_tokens or cfg.generator.sampling.max_tokens
