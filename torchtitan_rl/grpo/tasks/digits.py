"""The default task: answer a string of digits with a fixed function of it.

Prompt ``<bos> d1 .. dn =``; the target completion is ``t1 .. tn <eos>`` where
``t`` is the digits copied, reversed, or the first digit repeated n times.
The reward is the fraction of the n target positions the completion gets
exactly right, position by position. That reward is dense (partial credit
per digit), so a tiny randomly initialised model gets a learning signal from
its very first rollouts and learns the task by RL alone in a few dozen steps
on a CPU. A uniformly random policy scores about 1/vocab_size.

Run ``python -m torchtitan_rl.grpo.tasks.digits --write-tokenizer`` to
regenerate the shipped ``digits_tokenizer.json`` after changing the vocab.
"""

import argparse
import importlib.resources
import random
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from torchtitan_rl.grpo.tasks.base import Prompt, Task

TOKENIZER_FILE = "digits_tokenizer.json"
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
# Specials first so their ids (0..3) stay fixed if symbols are ever added.
VOCAB = SPECIAL_TOKENS + list("0123456789") + ["=", "+"]
MODES = ("copy", "reverse", "repeat_first")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}={% elif m['role'] == "
    "'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
"""Messages as the task writes them: a user's digits are a prompt (<bos>123=), an answer a completion (111<eos>);
system messages are dropped (the task has none)."""


def build_digits_tokenizer() -> Tokenizer:
    """A 16-token WordLevel tokenizer where every character is one token."""
    tokenizer = Tokenizer(
        models.WordLevel({tok: i for i, tok in enumerate(VOCAB)}, unk_token="<unk>")
    )
    # Every character is its own token: no whitespace handling, so "123=" is 4 tokens.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    # Fuse joins tokens without spaces, so decode(encode(s)) == s.
    tokenizer.decoder = decoders.Fuse()
    # Registered as added tokens so "<bos>" in text is matched whole, before the
    # per-character split; the ids are the ones already in the vocab.
    tokenizer.add_special_tokens(
        [AddedToken(tok, special=True, normalized=False) for tok in SPECIAL_TOKENS]
    )
    return tokenizer


def load_digits_tokenizer() -> Tokenizer:
    """The tokenizer shipped inside the package (works from an installed wheel)."""
    resource = importlib.resources.files(__package__).joinpath(TOKENIZER_FILE)
    with importlib.resources.as_file(resource) as path:
        return Tokenizer.from_file(str(path))


class DigitsTask(Task):
    """Map n random digits to a deterministic n-digit answer; dense per-digit reward."""

    chat_template = CHAT_TEMPLATE

    def __init__(self, n_digits: int = 3, mode: str = "copy") -> None:
        if n_digits < 1:
            raise ValueError(f"grpo.task: digits needs n_digits >= 1, got {n_digits}")
        if mode not in MODES:
            raise ValueError(f"grpo.task: digits mode must be one of {MODES}, got {mode!r}")
        self.n_digits = n_digits
        self.mode = mode
        self.tokenizer = load_digits_tokenizer()
        vocab = self.tokenizer.get_vocab()
        self.pad_id = vocab["<pad>"]
        self.bos_id = vocab["<bos>"]
        self.eos_id = vocab["<eos>"]
        self.equals_id = vocab["="]
        self.digit_ids = [vocab[str(d)] for d in range(10)]

    def _answer(self, digits: list[int]) -> list[int]:
        if self.mode == "copy":
            return list(digits)
        if self.mode == "reverse":
            return digits[::-1]
        return [digits[0]] * len(digits)  # repeat_first

    def make_prompt(self, digits: list[int]) -> Prompt:
        """The prompt for given digits; ``target`` is the answer's token ids (no <eos>)."""
        assert len(digits) == self.n_digits and all(0 <= d <= 9 for d in digits), digits
        token_ids = [self.bos_id] + [self.digit_ids[d] for d in digits] + [self.equals_id]
        target = [self.digit_ids[d] for d in self._answer(digits)]
        text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        return Prompt(token_ids=token_ids, text=text, target=target)

    def sample_prompts(self, n: int, *, generator: random.Random) -> list[Prompt]:
        return [
            self.make_prompt([generator.randrange(10) for _ in range(self.n_digits)])
            for _ in range(n)
        ]

    def reward(self, prompt: Prompt, completion_ids: list[int]) -> float:
        """Fraction of target digits matched position by position.

        The completion ends at its first <eos>: tokens after it are not part of
        the answer (vLLM stops there anyway), and tokens past the n target
        positions earn nothing either way.
        """
        target = prompt.target
        if self.eos_id in completion_ids:
            completion_ids = completion_ids[: completion_ids.index(self.eos_id)]
        hits = sum(c == t for c, t in zip(completion_ids, target))
        return hits / len(target)

    def random_policy_reward(self) -> float:
        """Expected reward of sampling tokens uniformly from the whole vocab.

        Position i scores when the first i tokens are not <eos> (else the
        completion has ended) and token i equals the target digit:
        (1 - 1/V)^i / V. Averaged over the n positions this is a bit under 1/V.
        """
        p = 1.0 / self.vocab_size
        return sum((1.0 - p) ** i * p for i in range(self.n_digits)) / self.n_digits

    def describe(self, prompt: Prompt, completion_ids: list[int]) -> str:
        completion = self.tokenizer.decode(completion_ids, skip_special_tokens=False)
        target = self.tokenizer.decode(prompt.target, skip_special_tokens=False)
        reward = self.reward(prompt, completion_ids)
        return f"{prompt.text} -> {completion!r} (target {target}, reward {reward:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write-tokenizer",
        action="store_true",
        help=f"regenerate {TOKENIZER_FILE} next to this module",
    )
    args = parser.parse_args()
    if not args.write_tokenizer:
        parser.print_help()
        return
    path = Path(__file__).with_name(TOKENIZER_FILE)
    path.write_text(build_digits_tokenizer().to_str(pretty=True) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
