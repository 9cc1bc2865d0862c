"""grpo.task = "calculator": the math task's word problems, with a calculator the policy may call.

The system prompt offers the tool: the model writes ``<calc>12 * 7 - 5</calc>``
and the episode continues after ``<result>79</result>``, which the
calculator wrote (tokens masked out of the loss). Episodes run up to
``task.max_turns`` turns (tasks/episodes.py); the reward is the math task's
(math-verify on the final ``\\boxed{}`` answer, else the last number) read
from the model's own text only: the tool's ``<result>`` spans are removed
first, so echoing a tool output, or stopping at it, is not a way to score.

SmolLM2-135M writes most calls as ``10 * 9 = 90</calc>`` (its own guess after
an "="), so the calculator evaluates what is left of the first "=" and its
result corrects the guess; and it closes a call with the token "><" (as the
prompt's example tokenizes), so the answer continues the "<" it already wrote
(docs/benchmarks.md, "Multi-turn tool task": the samples).
"""

import ast
import dataclasses
import operator
import re

from torchtitan_rl.config import TaskConfig
from torchtitan_rl.grpo.tasks.arithmetic import MathTask
from torchtitan_rl.grpo.tasks.episodes import ToolTask

SYSTEM_PROMPT = (
    "You are a helpful assistant with a calculator. To compute, write <calc>EXPRESSION</calc> using numbers "
    "and + - * / ( ) only; the result comes back as <result>VALUE</result> and you continue. Put the final "
    "answer in \\boxed{}.\n"
    "Example. Question: A box holds 12 pens. How many pens are in 7 boxes, minus 5 broken ones?\n"
    "Answer: 7 boxes of 12 pens, minus 5: <calc>7 * 12 - 5</calc><result>79</result> So there are \\boxed{79} pens."
)
CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
RESULT = re.compile(r"<result>.*?</result>", re.DOTALL)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * /, parentheses) as text; 'error' otherwise. An
    expression written with a claimed value (``10 * 9 = 90``) is evaluated left of its first "=".

    Parsed with ``ast`` and evaluated node by node: no ``eval``, no names, no
    powers (a 9**9**9 would hang the loop)."""

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        raise ValueError(node)

    try:
        if len(expression) > 200:
            raise ValueError(expression)
        x = value(ast.parse(expression.partition("=")[0].strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return "error"
    if abs(x) > 1e15:
        return "error"
    return str(int(x)) if float(x).is_integer() else f"{x:.6g}"


def find_call(text: str) -> str | None:
    """The expression of the first call in a turn's text; None if none. A call's "<calc>" may be missing:
    the prompt opens the reply with it."""
    end = text.find(CALL_CLOSE)
    if end < 0:
        return None
    start = text.rfind(CALL_OPEN, 0, end)
    return text[start + len(CALL_OPEN) if start >= 0 else 0 : end]


class CalculatorTask(ToolTask, MathTask):
    """Arithmetic word problems; the policy may call ``<calc>...</calc>`` between turns."""

    def __init__(self, config: TaskConfig, *, tokenizer_dir: str, field: str = "task.tokenizer") -> None:
        self.max_turns = config.max_turns
        if config.system_prompt == TaskConfig().system_prompt:  # the default one says nothing of the tool
            config = dataclasses.replace(config, system_prompt=SYSTEM_PROMPT)
        super().__init__(config, tokenizer_dir=tokenizer_dir, field=field)

    def make_prompt(self, question: str, answer: str):
        """The chat prompt with the assistant's reply opened by "<calc>": every episode starts with a tool call,
        so even a small model that would never call the tool on its own gets a learning signal from it."""
        prompt = super().make_prompt(question, answer)
        opening = self.tokenizer(CALL_OPEN, add_special_tokens=False)["input_ids"]
        return dataclasses.replace(prompt, token_ids=prompt.token_ids + opening, text=prompt.text + CALL_OPEN)

    def call_tool(self, text: str) -> str | None:
        expression = find_call(text)
        if expression is None:
            return None
        answer = f"<result>{calculate(expression)}</result>"
        # The token that closed the call may have begun the answer ("></calc><": SmolLM2's "><"): go on from there.
        after = text[text.find(CALL_CLOSE) + len(CALL_CLOSE):]
        return answer[len(after):] if after and answer.startswith(after) else answer

    def completion_text(self, completion_ids: list[int]) -> str:
        return RESULT.sub("", super().completion_text(completion_ids))
