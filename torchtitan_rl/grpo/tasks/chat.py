"""Questions with reference answers, asked through a model's own tokenizer and chat template.

The shared half of the math and dataset tasks: a Hugging Face tokenizer
folder (tokenizer.json + the chat template in tokenizer_config.json or
chat_template.jinja), a question rendered as
``[system, user: question + instruction]`` with the generation prompt
appended, and rewards from grpo/rewards.py on the decoded completion.
Where prompts come from is the subclass's business.
"""

import hashlib
from pathlib import Path

from torchtitan_rl.config import TaskConfig
from torchtitan_rl.grpo import rewards
from torchtitan_rl.grpo.tasks.base import Prompt, Task


def load_chat_tokenizer(folder: str, *, field: str):
    """transformers' tokenizer of ``folder``; ValueError naming ``field`` if it cannot chat."""
    from transformers import AutoTokenizer

    path = Path(folder)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"{field}: no tokenizer.json in {folder}")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if not tokenizer.chat_template:
        raise ValueError(f"{field}: the tokenizer in {folder} has no chat template")
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{field}: the tokenizer in {folder} has no eos token (the end of an answer)")
    return tokenizer


def chat_prompt(tokenizer, question: str, answer: str, *, system_prompt: str, instruction: str) -> Prompt:
    """``[system, user: question + instruction]`` in ``tokenizer``'s chat template, the generation prompt
    appended (training's prompts and every named evaluation set's)."""
    user = f"{question}\n{instruction}" if instruction else question
    messages = [{"role": "user", "content": user}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template already wrote the specials (e.g. <|im_start|>); adding a BOS again would double it.
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return Prompt(token_ids=token_ids, text=text, target=answer)


class ChatTask(Task):
    """Prompts are questions in the chat template; the reward checks the completion's final answer.

    ``Prompt.target`` is the reference answer as text (e.g. "42").
    """

    def __init__(self, config: TaskConfig, *, tokenizer_dir: str, field: str,
                 reward_fns: list[tuple[float, rewards.RewardFn]] | None = None) -> None:
        self.tokenizer = load_chat_tokenizer(tokenizer_dir, field=field)
        # The chat template ends an assistant turn with the eos token (<|im_end|> for SmolLM2 and Qwen3).
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        self.system_prompt = config.system_prompt
        self.instruction = config.instruction
        self.numeric_answer = config.numeric_answer
        self.reward_fns = (reward_fns if reward_fns is not None
                           else rewards.reward_fns(config.format_reward_weight, config.numeric_answer))

    def make_prompt(self, question: str, answer: str) -> Prompt:
        """``question`` as the chat template renders it for the model to answer."""
        return chat_prompt(self.tokenizer, question, answer, system_prompt=self.system_prompt,
                           instruction=self.instruction)

    def completion_text(self, completion_ids: list[int]) -> str:
        """What the model answered, as the rewards read it (special tokens such as <|im_end|> dropped)."""
        return self.tokenizer.decode(completion_ids, skip_special_tokens=True)

    def reward(self, prompt: Prompt, completion_ids: list[int]) -> float:
        text = self.completion_text(completion_ids)
        return sum(weight * fn(text, prompt.target) for weight, fn in self.reward_fns)

    def correct(self, prompt: Prompt, completion_ids: list[int]) -> bool:
        return rewards.correct(self.completion_text(completion_ids), prompt.target, self.numeric_answer) == 1.0

    def describe(self, prompt: Prompt, completion_ids: list[int]) -> str:
        text = self.completion_text(completion_ids)
        return f"{prompt.text!r} -> {text!r} (answer {prompt.target}, reward {self.reward(prompt, completion_ids):.2f})"


def stable_hash(text: str) -> int:
    """A hash of ``text`` that is the same in every process and run (Python's ``hash`` is salted)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
