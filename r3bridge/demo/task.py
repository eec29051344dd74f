"""The evidence run's task: multi-digit addition with a verifiable answer, generated in the run.

A prompt is ``<bos> a + b =`` (decimal digits, one token each); the answer is the digits of
``a + b`` written **least significant digit first**, then ``<eos>``. Reversed digits let a tiny
transformer learn carrying left to right in a few hundred supervised steps (each answer digit
depends on the digits already written and one column of the prompt), so a warm start reaches a
middling accuracy in seconds and GRPO has groups that are neither all right nor all wrong.

The tokenizer is the table below (no files, no hub). The reward is verifiable: 1.0 for the exact
answer followed by ``<eos>``, else ``partial_credit`` x the fraction of answer digits in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

PAD, EOS, BOS, PLUS, EQUALS = 0, 1, 2, 3, 4
DIGIT0 = 5                      # '0' .. '9' are 5 .. 14
VOCAB_SIZE = 16                 # 15 tokens used; the model never sees id 15 (a spare, never a target)
_SYMBOLS = {PAD: "_", EOS: "$", BOS: "^", PLUS: "+", EQUALS: "="}


def decode(ids: Sequence[int]) -> str:
    """Readable text of token ids (for logs and error messages)."""
    return "".join(_SYMBOLS.get(int(t), str(int(t) - DIGIT0) if DIGIT0 <= int(t) < DIGIT0 + 10 else "?")
                   for t in ids)


def _digits(n: int) -> list[int]:
    return [DIGIT0 + int(c) for c in str(n)]


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt_ids(self) -> list[int]:
        return [BOS, *_digits(self.a), PLUS, *_digits(self.b), EQUALS]

    @property
    def answer_ids(self) -> list[int]:
        """The sum's digits, least significant first, then ``<eos>``."""
        return [DIGIT0 + int(c) for c in reversed(str(self.a + self.b))] + [EOS]


@dataclass(frozen=True)
class AdditionTask:
    """Operands with ``min_digits`` to ``max_digits`` digits each (uniform digit count, then
    uniform value), so short and long problems are both seen."""

    min_digits: int = 1
    max_digits: int = 3
    partial_credit: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits <= 9:
            raise ValueError(f"need 1 <= min_digits <= max_digits <= 9, got {self.min_digits}, {self.max_digits}")
        if not 0.0 <= self.partial_credit < 1.0:
            raise ValueError(f"partial_credit must be in [0, 1), got {self.partial_credit}")

    @property
    def max_prompt_len(self) -> int:
        return 2 * self.max_digits + 3

    @property
    def max_response_len(self) -> int:
        """Longest correct answer (one carry digit more than the operands) plus ``<eos>``."""
        return self.max_digits + 2

    def sample(self, n: int, rng: np.random.Generator) -> list[Problem]:
        def operand() -> int:
            d = int(rng.integers(self.min_digits, self.max_digits + 1))
            lo = 0 if d == 1 else 10 ** (d - 1)
            return int(rng.integers(lo, 10 ** d))
        return [Problem(operand(), operand()) for _ in range(n)]

    def reward(self, problem: Problem, response_ids: Sequence[int]) -> float:
        """1.0 for exactly the answer and ``<eos>``; else partial credit for digits in place."""
        target = problem.answer_ids
        got = [int(t) for t in response_ids]
        if got == target:
            return 1.0
        if self.partial_credit == 0.0:
            return 0.0
        digits = target[:-1]
        right = sum(1 for i, t in enumerate(digits) if i < len(got) and got[i] == t)
        return self.partial_credit * right / len(digits)

    def sft_batch(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``n`` right-padded prompt + answer sequences ``[n, T]`` and the mask of the positions
        whose next token is an answer token (the supervised targets)."""
        problems = self.sample(n, rng)
        seqs = [p.prompt_ids + p.answer_ids for p in problems]
        width = max(len(s) for s in seqs)
        ids = np.full((n, width), PAD, dtype=np.int64)
        target_mask = np.zeros((n, width), dtype=bool)
        for i, (p, s) in enumerate(zip(problems, seqs)):
            ids[i, :len(s)] = s
            target_mask[i, len(p.prompt_ids) - 1:len(s) - 1] = True
        return ids, target_mask
