"""Multi-turn episodes: the policy calls a tool, the tool's answer comes back, the policy goes on.

A ``ToolTask`` is a task plus a tool. ``submit`` plays its episodes
through any generator (in process, own rank, or the rollout server; it only
calls ``generator.rollouts``):

    turn 1   prompt                                   -> the policy writes until it closes a tool call
    tool     the call's output, as tokens (masked)    -> appended to the episode
    turn 2   prompt + everything so far               -> the policy continues ... until it stops
             without a call, or the turn / token budget ends

Everything stays in token ids: a turn's tokens are kept exactly as sampled
(never decoded and re-tokenized), and the tool's output is tokenized once
and appended, so the sequence the trainer scores is the one the generator
saw. The generator's tokens carry their sampling logprobs and loss-mask 1;
tool tokens get mask 0 (``Rollouts.loss_mask``): the policy is not trained
to predict what the tool said. The reward reads the whole episode at the end.

Where a turn ends: the generator samples up to eos or ``max_tokens``; the
turn is cut right after the token that completes the first tool call, and
what was sampled after it is dropped. Sampling is left to right, so the kept
prefix is exactly a sample of the policy stopped at the call (the tokens
after it only cost time; a server with stop strings would not sample them).

To write your own agent task: mix ``ToolTask`` into a task class (e.g.
``class MyTask(ToolTask, MathTask)``: prompts in the checkpoint's chat
template and math-verify rewards), implement ``call_tool(text)`` (find the
first complete call in the turn's text and return what the tool answers),
and ``sample_prompts`` / the reward as for any task.
tasks/calculator.py is the worked example.
"""

import dataclasses
from abc import abstractmethod

from torchtitan_rl.config import SamplingConfig
from torchtitan_rl.engine.rollouts import Done, Rollouts
from torchtitan_rl.grpo.tasks.base import Prompt, Task

TURN_SEED = 7919
"""Turn t > 0, budget group g, of a request seeded s is seeded (s * TURN_SEED + t) * TURN_SEED + g (the
generator mixes in the episode's index and folds it into int64)."""


@dataclasses.dataclass
class _Episode:
    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    calls: int = 0
    done: bool = False


class ToolTask(Task):
    """A task whose policy may call a tool between turns (see the module docstring); mix it into a task
    class (``class MyTask(ToolTask, MathTask)``) for its prompts and reward."""

    max_turns: int = 4
    """Turns per episode (tool calls + 1); the last turn's tool call, if any, is not answered."""

    @abstractmethod
    def call_tool(self, text: str) -> str | None:
        """The tool's output (text to append) for the first complete tool call in a turn's ``text``;
        None if the turn makes no call. The turn is cut after the first token at which a call is complete,
        and the output appended is this function's on the text kept (whose last token may hold a few
        characters past the call)."""

    def submit(self, generator, prompts: list[Prompt], *, n: int, seed: int | None,
               sampling: SamplingConfig, max_total_tokens: int):
        """``n`` episodes per prompt, group-contiguous, as one Rollouts with a loss mask; at most
        ``max_total_tokens`` (prompt + completion) per episode. Played now, turn after turn (each turn needs
        the last one's tokens), so with grpo.max_staleness > 0 they are as old as a single turn would be but
        do not overlap training."""
        episodes = [_Episode(list(p.token_ids)) for p in prompts for _ in range(n)]
        version, generate_s, idle_s = None, 0.0, None
        for turn in range(self.max_turns):
            live = [e for e in episodes if not e.done]
            if not live:
                break
            # One request per turn budget: an episode's turn may run to its own room, not its longest sibling's.
            budgets: dict[int, list[_Episode]] = {}
            for e in live:
                budgets.setdefault(min(sampling.max_tokens, max_total_tokens - len(e.prompt) - len(e.tokens)),
                                   []).append(e)
            for g, (max_tokens, group) in enumerate(sorted(budgets.items())):
                s = dataclasses.replace(sampling, max_tokens=max(1, max_tokens))
                if turn == 0 and len(group) == len(episodes):  # the prompts' n samples, seeded as a single turn
                    r = generator.rollouts([p.token_ids for p in prompts], n=n, stop_token_ids=[self.eos_id],
                                           seed=seed, sampling=s)
                else:
                    turn_seed = None if seed is None else (seed * TURN_SEED + turn) * TURN_SEED + g
                    r = generator.rollouts([e.prompt + e.tokens for e in group], n=1, stop_token_ids=[self.eos_id],
                                           seed=turn_seed, sampling=s)
                assert version is None or r.weight_version == version, "an episode spans two weight versions"
                version = r.weight_version
                generate_s += r.generate_s
                idle_s = r.idle_s if idle_s is None else idle_s
                for e, ids, lps in zip(group, r.completion_ids, r.logprobs):
                    self._extend(e, ids, lps, last_turn=turn == self.max_turns - 1,
                                 room=max_total_tokens - len(e.prompt))
        return Done(Rollouts(
            prompt_ids=[e.prompt for e in episodes], completion_ids=[e.tokens for e in episodes],
            logprobs=[e.logprobs for e in episodes], weight_version=version, generate_s=generate_s,
            idle_s=idle_s or 0.0, loss_mask=[e.mask for e in episodes],
        ))

    def _extend(self, e: _Episode, ids: list[int], lps: list[float], *, last_turn: bool, room: int) -> None:
        """Append one turn (cut after its first tool call) and the tool's answer."""
        output = None if last_turn else self.call_tool(self._decode(ids))
        if output is not None:
            keep = self._tokens_through(ids)
            ids, lps = ids[:keep], lps[:keep]
            output = self.call_tool(self._decode(ids))  # for the text kept: it may end inside the answer's opening
        e.tokens += ids
        e.logprobs += lps
        e.mask += [1] * len(ids)
        if output is None:
            e.done = True
            return
        answer = self._encode(output)
        if len(e.tokens) + len(answer) >= room:  # no room for the answer and another turn
            e.done = True
            return
        e.calls += 1
        e.tokens += answer
        e.logprobs += [0.0] * len(answer)
        e.mask += [0] * len(answer)

    def _tokens_through(self, ids: list[int]) -> int:
        """The fewest leading tokens of ``ids`` whose text already holds a complete call (binary search:
        a prefix that holds one stays holding it as tokens are added)."""
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.call_tool(self._decode(ids[:mid])) is not None:
                hi = mid
            else:
                lo = mid + 1
        return lo

    # Both tokenizer kinds a task may hold (Task.tokenizer): transformers' and tokenizers'.
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def _encode(self, text: str) -> list[int]:
        if hasattr(self.tokenizer, "encode_batch"):  # a tokenizers.Tokenizer
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]
