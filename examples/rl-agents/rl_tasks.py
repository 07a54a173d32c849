"""The three tasks, their verifiers, the imperfect demonstrations, and the tokenizer.

Every task has a verifiable answer and needs a different skill:

- `add` (arithmetic): `A:47+85=` -> `132`. Two-digit addition, most significant digit first,
  so a carry must be worked out before the digit it changes is written.
- `kv` (memory): `K:18,42,50,67,66,75,42,86|3` -> `50`. Recall the value stored in a given
  slot of a long context (a stand-in for memory retrieval).
- `tool` (tool use): `T:fly 57 to oslo` -> `fly(oslo,57)`. A request in words becomes a
  well-formed call of one of seven tools, with the tool's own name and argument order.

The verifier's score is 1.0 for the exact canonical answer and 0.0 otherwise.

Demonstrations are imperfect, like real pre-training data: with probability `MISTAKE_RATE`
an SFT example shows a typical mistake instead of the answer (the sum without its carries;
the value with its digits swapped; the call written in the request's own words and order).
The base thus learns both behaviours and is only partly right; RL, which sees nothing but
the verifier's score, can find out which one is rewarded.

Each prompt is left-filled with `.` to its task's fixed width, so a batch of one task needs
no padding or attention mask; an answer ends with EOS.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

PAD, BOS, EOS = 0, 1, 2
CHARS = "0123456789abcdefghijklmnopqrstuvwxyzAKT+=,:|(). "
"""Token ids 3.. are these characters, in this order; 0, 1, 2 are PAD, BOS, EOS."""
VOCAB_SIZE = 3 + len(CHARS)
FILL = "."
MISTAKE_RATE = 0.5


class CharTokenizer:
    """One token per character. `encode` adds nothing; the caller adds BOS and EOS."""

    def __init__(self) -> None:
        self.to_id = {c: i + 3 for i, c in enumerate(CHARS)}

    def encode(self, text: str) -> list[int]:
        return [self.to_id[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        """Characters up to the first EOS; PAD and BOS are dropped."""
        out = []
        for i in ids:
            if i == EOS:
                break
            if i >= 3:
                out.append(CHARS[i - 3])
        return "".join(out)

    def to_json(self) -> dict:
        return {
            "type": "char",
            "pad_token_id": PAD,
            "bos_token_id": BOS,
            "eos_token_id": EOS,
            "chars": CHARS,
            "note": "token id = 3 + index of the character in chars; a prompt is BOS + "
            "characters, left-filled with '.' to the task's width; an answer ends with EOS",
        }


Example = tuple[str, str, str]
"""(prompt, answer, the typical mistake)."""


@dataclass(frozen=True)
class Task:
    name: str
    skill: str
    prompt_width: int
    """Characters of every prompt after left-filling with FILL (BOS not counted)."""
    max_answer: int
    """Longest answer or mistake in characters (EOS not counted)."""
    generate: Callable[[random.Random], Example]

    def example(self, rng: random.Random) -> Example:
        prompt, answer, mistake = self.generate(rng)
        assert len(prompt) <= self.prompt_width, prompt
        assert max(len(answer), len(mistake)) <= self.max_answer, (answer, mistake)
        return prompt.rjust(self.prompt_width, FILL), answer, mistake

    def score(self, completion: str, answer: str) -> float:
        """The verifier: 1.0 for the exact answer, else 0.0."""
        return 1.0 if completion == answer else 0.0


def _add(rng: random.Random) -> Example:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    no_carry = int(f"{(a // 10 + b // 10) % 10}{(a + b) % 10}")
    return f"A:{a}+{b}=", str(a + b), str(no_carry)


KV_SLOTS = 8


def _kv(rng: random.Random) -> Example:
    values = [f"{rng.randint(0, 99):02d}" for _ in range(KV_SLOTS)]
    q = rng.randrange(KV_SLOTS)
    return f"K:{','.join(values)}|{q + 1}", values[q], values[q][::-1]


CITIES = (
    "paris", "rome", "oslo", "lima", "cairo", "tokyo", "delhi", "quito",
    "perth", "hanoi", "dakar", "sofia", "kyiv", "riga", "baku", "doha",
)  # fmt: skip
NAMES = (
    "ann", "bob", "eve", "dan", "kim", "liu", "raj", "sam",
    "tom", "zoe", "ada", "ben", "ivy", "joe", "max", "uma",
)  # fmt: skip


def _tool(rng: random.Random) -> Example:
    city, name = rng.choice(CITIES), rng.choice(NAMES)
    kind = rng.randrange(7)
    if kind == 0:
        d = rng.randint(1, 31)
        return f"T:weather in {city} day {d}", f"wx({city},{d})", f"weather({city},{d})"
    if kind == 1:
        n = rng.randint(1, 99)
        return f"T:fly {n} to {city}", f"fly({city},{n})", f"fly({n},{city})"
    if kind == 2:
        amt = rng.randint(1, 999)
        return f"T:pay {name} {amt}", f"pay({name},{amt})", f"pay({amt},{name})"
    if kind == 3:
        h = rng.randint(0, 23)
        return f"T:call {name} at {h}", f"dial({name},{h})", f"call({name},{h})"
    if kind == 4:
        h, m = rng.randint(0, 23), rng.randint(0, 59)
        return f"T:alarm at {h}:{m:02d}", f"alarm({h},{m})", f"alarm({h}:{m:02d})"
    if kind == 5:
        return f"T:email {name} about {city}", f"mail({name},{city})", f"email({name},{city})"
    h = rng.randint(0, 23)
    return f"T:time in {city} at {h}", f"tz({h},{city})", f"tz({city},{h})"


TASKS = {
    "add": Task("add", "two-digit addition with carries", 8, 3, _add),
    "kv": Task("kv", "recall the value in a given slot of a long context (memory)", 27, 2, _kv),
    "tool": Task("tool", "a well-formed tool call from a request in words", 25, 17, _tool),
}
TASK_NAMES = tuple(TASKS)


def held_out(task: Task, n: int, seed: int) -> list[tuple[str, str]]:
    """`n` distinct (prompt, answer) evaluation pairs for `task`, a function of the seed."""
    rng = random.Random(f"eval-{task.name}-{seed}")
    seen: dict[str, str] = {}
    while len(seen) < n:
        prompt, answer, _ = task.example(rng)
        seen.setdefault(prompt, answer)
    return list(seen.items())


class TrainStream:
    """Training examples for one task from its own seeded RNG, never a held-out prompt."""

    def __init__(self, task: Task, seed: int, exclude: set[str]) -> None:
        self.task, self.exclude = task, exclude
        self.rng = random.Random(f"train-{task.name}-{seed}")

    def batch(self, n: int) -> list[Example]:
        out: list[Example] = []
        while len(out) < n:
            example = self.task.example(self.rng)
            if example[0] not in self.exclude:
                out.append(example)
        return out

    def demonstrations(self, n: int) -> list[tuple[str, str]]:
        """(prompt, shown answer): the typical mistake with probability MISTAKE_RATE."""
        return [(p, m if self.rng.random() < MISTAKE_RATE else a) for p, a, m in self.batch(n)]
