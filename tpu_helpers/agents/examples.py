"""Example environments and tools for agent RL, offline: their datasets (rows) and SFT demonstrations.

    agent = Agent(environment_factory=TreasureHunt, reward_funcs=[hunt_reward])
    rows = hunt_rows(64, split="train")                   # {"prompt": [system, user], "seed", "start"}
    demos = hunt_demonstrations(64, seed=1)               # {"messages": [...], "tools": [...]}, TRL's SFT tool form

- `Lockers`: the answer exists only inside the environment: four lockers with random codes (row["seed"]), the user
  asks for one (row["locker"]), `open_locker(name)` reads it. Reward: `locker_reward` (the final answer's code).
- `TreasureHunt`: feedback across turns matters: the box the user names (row["start"]) holds a note naming the box
  with the code, the other two hold wrong codes; `open_box(name)` reads a box, so the second call must use the
  first one's reply. Reward: `hunt_reward`; metric: `note_following`.
- `GuessingGame`: feedback across turns, with arithmetic: `guess(number)` answers higher, lower or correct about a
  secret in [1, row["n"]]. Reward: `get_reward()`; metric: `feedback_use` (guesses consistent with the replies).
- `multiply(a, b)`: one stateless tool, for rows asking "What is 347 times 829?". Reward: `product_reward`.

Rows are TRL's: a conversational "prompt" and the fields reset needs, train and test disjoint. Each environment seeds
its randomness from the row alone (`random.Random` of a string, whatever PYTHONHASHSEED), so a resumed run sees the
same episode. Demonstrations are the rows' episodes played through `Agent` (the environment's own tool results, the
prompt an RL episode renders), so SFT and RL see the same conversations. Sized for SmolLM2-135M on a CPU. Torch-free.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from tpu_helpers.agents.environments import Agent

SYSTEM = "Use the tools, then answer with the number only."
LOCKER_NAMES = ("red", "blue", "green", "gold", "gray", "pink", "black", "white", "brown", "orange")
LOCKERS_PER_EPISODE = 4
GUESS_SIZES = (16, 32)
# Row seeds of each split: disjoint ranges, so train and test never share an episode.
SEED_RANGES = {"train": (0, 1_000_000), "test": (1_000_000, 2_000_000)}
_NUMBER = re.compile(r"-?\d[\d,]*")


def _split(split: str) -> tuple[int, int]:
    if split not in SEED_RANGES:
        raise ValueError(f"split={split!r}; give one of {sorted(SEED_RANGES)}")
    return SEED_RANGES[split]


def _prompt(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def _row_seeds(n: int, kind: str, seed: int, split: str) -> list[int]:
    """n distinct row seeds of the split's range, drawn by (kind, seed, split)."""
    lo, hi = _split(split)
    return random.Random(f"{kind}-rows:{split}:{seed}").sample(range(lo, hi), n)


def final_answer(completion: Sequence[Mapping]) -> int | None:
    """The one number of an episode's final answer: the last assistant message's content, when that message makes
    no tool call (else the episode ended mid tool use) and holds exactly one number (commas between digits allowed:
    "287,663"); None otherwise. Several numbers are no answer: listing every code a model saw is not knowing one."""
    last = next((m for m in reversed(completion) if m.get("role") == "assistant"), None)
    if last is None or last.get("tool_calls"):
        return None
    found = {int(x.replace(",", "")) for x in _NUMBER.findall(last.get("content") or "") if x.strip(",")}
    return found.pop() if len(found) == 1 else None


def _as_int(value: Any) -> int | None:
    """A model's number argument: an int, or a string or float holding one ("8", 8.0); None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        number = float(str(value).strip())
    except ValueError:
        return None
    return int(number) if number.is_integer() else None


# ---- Lockers -----------------------------------------------------------------------------------------------------
def locker_codes(seed: int) -> dict[str, int]:
    """The episode of a row seed: LOCKERS_PER_EPISODE locker names and their random 4-digit codes."""
    rng = random.Random(f"lockers:{seed}")
    names = rng.sample(LOCKER_NAMES, LOCKERS_PER_EPISODE)
    return {name: rng.randrange(1000, 10000) for name in names}


class Lockers:
    """Named lockers with secret 4-digit codes; the user asks for one locker's code, which only `open_locker`
    reveals (a guess is right once in 9000). reset(**row) takes row["seed"] (the episode) and row["locker"] (the one
    asked for) and returns " Lockers: red, blue, ...": the names, appended to the user's question.

    No get_reward: the reward needs the model's final answer, which the environment never sees (a tool call reaches
    it, the answer does not). Score episodes with `locker_reward`, which reads the code from each rollout's
    environment (TRL's `environments=` keyword)."""

    def __init__(self) -> None:
        self.codes: dict[str, int] = {}
        self.locker: str | None = None
        self.opened: list[str] = []

    def reset(self, seed: int, locker: str, **row: Any) -> str:
        self.codes = locker_codes(seed)
        if locker not in self.codes:
            raise ValueError(f"row asks for locker {locker!r}; seed {seed} has {sorted(self.codes)}")
        self.locker = locker
        self.opened = []
        return " Lockers: " + ", ".join(self.codes) + "."

    @property
    def code(self) -> int:
        """The code asked for."""
        return self.codes[self.locker]

    def open_locker(self, name: str) -> str:
        """Open a locker and read its code.

        Args:
            name: The locker's name.
        """
        key = str(name).strip().lower()
        self.opened.append(key)
        return str(self.codes[key]) if key in self.codes else "no such locker"


def locker_reward(completions: list[list[dict]], environments: list, **kwargs: Any) -> list[float]:
    """1.0 when an episode's final answer (`final_answer`: the last assistant message, no tool call left, one
    number) is the code of the locker asked for, else 0.0. TRL's reward keywords; needs `environments=`."""
    return [float(final_answer(c) == env.code) for c, env in zip(completions, environments, strict=True)]


def locker_rows(n: int, *, seed: int = 0, split: str = "train") -> list[dict]:
    """n rows for `Lockers`: {"prompt": [system, user], "seed": the episode, "locker": the one asked for}."""
    rows = []
    for s in _row_seeds(n, "lockers", seed, split):
        locker = random.Random(f"lockers-ask:{s}").choice(list(locker_codes(s)))
        rows.append({"prompt": _prompt(f"What is the code of the {locker} locker?"), "seed": s, "locker": locker})
    return rows


# ---- TreasureHunt ------------------------------------------------------------------------------------------------
def hunt_boxes(seed: int) -> tuple[dict[str, int], str]:
    """The episode of a row seed: LOCKERS_PER_EPISODE box names with random 4-digit codes, and the box whose code is
    the treasure. The start box (`hunt_rows`) is another one: it holds the note instead of its code."""
    rng = random.Random(f"hunt:{seed}")
    names = rng.sample(LOCKER_NAMES, LOCKERS_PER_EPISODE)
    codes = {name: rng.randrange(1000, 10000) for name in names}
    return codes, rng.choice(names)


class TreasureHunt:
    """Four named boxes. The user says which box to start at; it holds a note naming the box with the code (the
    answer); the other two boxes hold wrong codes. `open_box` reads a box, so an episode that solves it opens the
    start box, then the box the note names (a random second box is right once in three), then answers that code.
    reset(**row) takes row["seed"] (the boxes) and row["start"] and returns " Boxes: red, blue, ...": the names,
    appended to the user's question.

    No get_reward, as `Lockers`: score episodes with `hunt_reward`, which reads the code from each rollout's
    environment (TRL's `environments=` keyword). `note_following` measures whether the call after the note went
    where it said."""

    def __init__(self) -> None:
        self.codes: dict[str, int] = {}
        self.start = ""
        self.target = ""
        self.opened: list[str] = []

    def reset(self, seed: int, start: str, **row: Any) -> str:
        codes, target = hunt_boxes(seed)
        key = str(start).strip().lower()
        if key not in codes or key == target:
            raise ValueError(f"row starts at box {start!r}; seed {seed} has {sorted(codes)}, the code in "
                             f"{target!r}, so start at one of the others")
        self.codes, self.target, self.start = codes, target, key
        self.opened = []
        return " Boxes: " + ", ".join(self.codes) + "."

    @property
    def code(self) -> int:
        """The code the note leads to."""
        return self.codes[self.target]

    def open_box(self, name: str) -> str:
        """Open a box and read what is inside.

        Args:
            name: The box's name.
        """
        key = str(name).strip().lower()
        self.opened.append(key)
        if key == self.start:
            return f"go to the {self.target} box"
        return str(self.codes[key]) if key in self.codes else "no such box"


def hunt_reward(completions: list[list[dict]], environments: list, **kwargs: Any) -> list[float]:
    """1.0 when an episode's final answer (`final_answer`) is the code the start box's note leads to, else 0.0.
    TRL's reward keywords; needs `environments=`."""
    return [float(final_answer(c) == env.code) for c, env in zip(completions, environments, strict=True)]


_NOTE = re.compile(r"go to the (\w+) box")


def _call_arguments(message: Mapping, tool: str) -> list[dict]:
    """The arguments of an assistant message's calls of `tool`, in order: a dict each (a JSON string decoded, as
    datasets may hold them; anything else {}); calls that are not a mapping are left out."""
    out = []
    for c in message.get("tool_calls") or ():
        function = c.get("function", c) if isinstance(c, Mapping) else None
        if not isinstance(function, Mapping) or function.get("name") != tool:
            continue
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        out.append(dict(arguments) if isinstance(arguments, Mapping) else {})
    return out


def note_following(completions: list[list[dict]], **kwargs: Any) -> list[float | None]:
    """1.0 when the assistant's next message after an episode read its note opens the box the note names (its first
    `open_box` call decides, run or cut by MAX_TURNS), 0.0 when it opens another box, makes no call or never comes
    (the episode was cut); None (NaN: not applicable) for an episode that never read the note. A metric, called as a
    TRL reward function is."""
    out: list[float | None] = []
    for completion in completions:
        named: str | None = None
        value: float | None = None
        for m in completion:
            if named is None:
                found = _NOTE.fullmatch(str(m.get("content", ""))) if m.get("role") == "tool" else None
                if found:
                    named, value = found.group(1), 0.0
            elif m.get("role") == "assistant":
                boxes = [str(arguments.get("name", "")).strip().lower() for arguments in _call_arguments(m, "open_box")]
                value = float(boxes[:1] == [named])
                break
        out.append(value)
    return out


def hunt_rows(n: int, *, seed: int = 0, split: str = "train") -> list[dict]:
    """n rows for `TreasureHunt`: {"prompt": [system, user], "seed": the boxes, "start": the box to open first}."""
    rows = []
    for s in _row_seeds(n, "hunt", seed, split):
        codes, target = hunt_boxes(s)
        start = random.Random(f"hunt-start:{s}").choice([name for name in codes if name != target])
        rows.append({"prompt": _prompt(f"Find the code. Start at the {start} box."), "seed": s, "start": start})
    return rows


# ---- GuessingGame ------------------------------------------------------------------------------------------------
def guess_budget(n: int) -> int:
    """The guesses binary search needs at most on [1, n]: ceil(log2(n + 1)) (5 for 16, 6 for 32)."""
    return math.ceil(math.log2(n + 1))


class GuessingGame:
    """Guess a secret integer in [1, row["n"]] (drawn from row["seed"]); `guess` answers "higher" (the secret is
    higher than the guess), "lower" or "correct", and "out of range" or "not a number" for a guess it cannot take.
    reset returns None: the row's question states the range.

    get_reward(): 0.0 unsolved; solved within `guess_budget(n)` guesses (binary search's worst case, so a policy that
    halves the range always scores 1), 1.0; each guess past the budget costs 0.1, down to 0.1 (solved at all beats
    unsolved). Guesses are counted up to the first "correct", invalid ones included."""

    def __init__(self) -> None:
        self.n = 0
        self.secret = 0
        self.guesses: list[Any] = []
        self.solved_at: int | None = None

    def reset(self, seed: int, n: int, **row: Any) -> None:
        self.n = int(n)
        self.secret = random.Random(f"guessing:{seed}:{self.n}").randint(1, self.n)
        self.guesses = []
        self.solved_at = None

    def guess(self, number: int) -> str:
        """Guess the secret number; the reply is higher, lower or correct.

        Args:
            number: Your guess.
        """
        self.guesses.append(number)
        value = _as_int(number)
        if value is None:
            return "not a number"
        if not 1 <= value <= self.n:
            return f"out of range 1-{self.n}"
        if value == self.secret:
            if self.solved_at is None:
                self.solved_at = len(self.guesses)
            return "correct"
        return "higher" if self.secret > value else "lower"

    def get_reward(self) -> float:
        if self.solved_at is None:
            return 0.0
        return max(0.1, 1.0 - 0.1 * max(0, self.solved_at - guess_budget(self.n)))


def _guess_turns(completion: Sequence[Mapping]) -> list[list[list]]:
    """Each assistant turn's guess calls paired with their replies, in order: [[[number, reply], ...], ...]."""
    turns: list[list[list]] = []
    for m in completion:
        if m.get("role") == "assistant":
            turns.append([[arguments.get("number"), None] for arguments in _call_arguments(m, "guess")])
        elif m.get("role") == "tool" and m.get("name") == "guess" and turns:
            pending = [p for p in turns[-1] if p[1] is None]
            if pending:
                pending[0][1] = m.get("content")
    return [turn for turn in turns if turn]


def feedback_use(completions: list[list[dict]], n: list | None = None, **kwargs: Any) -> list[float | None]:
    """The share of guesses after the first consistent with all the feedback the model had seen when it wrote them:
    inside the range the earlier replies leave ("higher" after 8: above 8; "correct": that number only), and in
    [1, n] where the rows' `n` is given. Guesses of one turn are checked against the replies before that turn (the
    model sees its calls' replies together). Binary search scores 1; a random guesser less. None (NaN: not
    applicable) for an episode of fewer than two guesses. A metric, called as a TRL reward function is."""
    out: list[float | None] = []
    for i, completion in enumerate(completions):
        size = _as_int(n[i]) if n is not None else None
        lo, hi = (0, size + 1) if size else (-math.inf, math.inf)  # the secret is strictly between
        checked = consistent = 0
        first = True
        for turn in _guess_turns(completion):
            before = (lo, hi)
            for number, reply in turn:
                value = _as_int(number)
                if not first:
                    checked += 1
                    consistent += value is not None and before[0] < value < before[1]
                first = False
                if value is None:
                    continue
                if reply == "higher":
                    lo = max(lo, value)
                elif reply == "lower":
                    hi = min(hi, value)
                elif reply == "correct":
                    lo, hi = value - 1, value + 1
        out.append(consistent / checked if checked else None)
    return out


def guessing_rows(n: int, *, seed: int = 0, split: str = "train", sizes: Iterable[int] = GUESS_SIZES) -> list[dict]:
    """n rows for `GuessingGame`: {"prompt": [system, user], "seed": the secret's seed, "n": the range's top,
    drawn from `sizes`}."""
    sizes = list(sizes)
    rows = []
    for s in _row_seeds(n, "guessing", seed, split):
        top = sizes[s % len(sizes)]
        rows.append({"prompt": _prompt(f"Guess my number from 1 to {top}."), "seed": s, "n": top})
    return rows


# ---- multiply ----------------------------------------------------------------------------------------------------
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def product_reward(completions: list[list[dict]], answer: list, **kwargs: Any) -> list[float]:
    """1.0 when an episode's final answer (`final_answer`) is the row's "answer", else 0.0. TRL's reward keywords."""
    return [float(final_answer(c) == int(a)) for c, a in zip(completions, answer, strict=True)]


def multiply_split(a: int, b: int) -> str:
    """The split an operand pair belongs to: a fixed partition, one pair in five for test (order matters not)."""
    return "test" if (a + b) % 5 == 0 else "train"


def multiply_rows(n: int, *, seed: int = 0, split: str = "train", digits: int = 3) -> list[dict]:
    """n rows for `multiply`: {"prompt": [system, "What is A times B?"], "a", "b", "answer": str(A * B)}, A and B of
    `digits` digits, distinct pairs of the split's partition (`multiply_split`)."""
    _split(split)
    rng = random.Random(f"multiply-rows:{split}:{seed}:{digits}")
    lo, hi = 10 ** (digits - 1), 10 ** digits
    if n > (hi - lo) ** 2 // 10:
        raise ValueError(f"{n} rows of {digits}-digit products: there are not that many pairs in a split")
    seen: set[tuple[int, int]] = set()
    rows = []
    while len(rows) < n:
        a, b = rng.randrange(lo, hi), rng.randrange(lo, hi)
        if (a, b) in seen or multiply_split(a, b) != split:
            continue
        seen.add((a, b))
        rows.append({"prompt": _prompt(f"What is {a} times {b}?"), "a": a, "b": b, "answer": str(a * b)})
    return rows


# ---- SFT demonstrations ------------------------------------------------------------------------------------------
def call(tool: str, /, **arguments: Any) -> dict:
    """An assistant message making one tool call, in TRL's form."""
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": tool, "arguments": arguments}}]}


def play(agent: Agent, row: Mapping, policy: Callable[[list[dict]], dict]) -> dict:
    """One demonstration: an episode of the row, the policy's assistant messages answered by the environment's own
    tools, until the policy gives a message without tool calls. {"messages": prompt + completion, "tools": schemas}."""
    episode = agent.start(row)
    for _ in range(64):
        message = policy(episode.completion)
        episode.answer(message)
        if not message.get("tool_calls"):
            return {"messages": episode.messages, "tools": episode.schemas}
    raise RuntimeError(f"the demonstration policy made 64 tool calls on {dict(row)!r} without answering")


def _last_reply(completion: list[dict]) -> str:
    return completion[-1]["content"]


def locker_demonstrations(n: int, *, seed: int = 0, split: str = "train") -> list[dict]:
    """Demonstrations of `locker_rows(n, seed=seed, split=split)`: open the locker asked for, answer its code."""
    agent = Agent(environment_factory=Lockers, reward_funcs=[locker_reward])

    def demo(row: dict) -> dict:
        return play(agent, row, lambda done: call("open_locker", name=row["locker"]) if not done
                    else {"role": "assistant", "content": _last_reply(done)})

    return [demo(row) for row in locker_rows(n, seed=seed, split=split)]


def hunt_demonstrations(n: int, *, seed: int = 0, split: str = "train", skip_note: float = 0.0) -> list[dict]:
    """Demonstrations of `hunt_rows(n, seed=seed, split=split)`: open the start box, then the box its note names,
    answer that code. `skip_note`: the share of demonstrations that skip the note instead, opening a box other than
    the start at once and answering its code (right once in three): a teacher that uses the feedback only sometimes,
    drawn per row."""
    if not 0.0 <= skip_note <= 1.0:
        raise ValueError(f"skip_note={skip_note!r}; give a share in [0, 1]")
    agent = Agent(environment_factory=TreasureHunt, reward_funcs=[hunt_reward])

    def demo(row: dict) -> dict:
        rng = random.Random(f"hunt-skip:{row['seed']}")
        skips = rng.random() < skip_note

        def policy(done: list[dict]) -> dict:
            if not done:
                others = [name for name in hunt_boxes(row["seed"])[0] if name != row["start"]]
                return call("open_box", name=rng.choice(others) if skips else row["start"])
            found = _NOTE.fullmatch(done[-1]["content"])
            return call("open_box", name=found.group(1)) if found else {"role": "assistant",
                                                                        "content": _last_reply(done)}

        return play(agent, row, policy)

    return [demo(row) for row in hunt_rows(n, seed=seed, split=split)]


def guessing_demonstrations(n: int, *, seed: int = 0, split: str = "train",
                            sizes: Iterable[int] = GUESS_SIZES) -> list[dict]:
    """Demonstrations of `guessing_rows(...)`: binary search (guess the middle of what the replies leave), then
    the number."""
    agent = Agent(environment_factory=GuessingGame)

    def demo(row: dict) -> dict:
        def policy(done: list[dict]) -> dict:
            lo, hi = 1, row["n"]
            for message, reply in zip(done[::2], done[1::2], strict=True):
                number = message["tool_calls"][0]["function"]["arguments"]["number"]
                if reply["content"] == "correct":
                    return {"role": "assistant", "content": str(number)}
                lo, hi = (number + 1, hi) if reply["content"] == "higher" else (lo, number - 1)
            return call("guess", number=(lo + hi) // 2)

        return play(agent, row, policy)

    return [demo(row) for row in guessing_rows(n, seed=seed, split=split, sizes=sizes)]


def multiply_demonstrations(n: int, *, seed: int = 0, split: str = "train", digits: int = 3) -> list[dict]:
    """Demonstrations of `multiply_rows(...)`: call multiply, answer the product."""
    agent = Agent(tools=[multiply], reward_funcs=[product_reward])

    def demo(row: dict) -> dict:
        return play(agent, row, lambda done: call("multiply", a=row["a"], b=row["b"]) if not done
                    else {"role": "assistant", "content": _last_reply(done)})

    return [demo(row) for row in multiply_rows(n, seed=seed, split=split, digits=digits)]


# ---- mul3: the sandboxed python tool -----------------------------------------------------------------------------
def mul3_rows(n: int, *, seed: int = 0, split: str = "train") -> list[dict]:
    """n rows asking for the product of two 3-digit numbers, for the `python` tool (agents/sandbox.py): the rows of
    `multiply_rows(n, seed=seed, split=split, digits=3)` (train and test disjoint pairs), which SmolLM2 cannot
    multiply in its head and can with one line of code."""
    return multiply_rows(n, seed=seed, split=split, digits=3)


def mul3_reward(completions: list[list[dict]], answer: list, **kwargs: Any) -> list[float]:
    """1.0 when an episode's final answer is the row's product (as `product_reward`), else 0.0."""
    return product_reward(completions, answer)


def mul3_demonstrations(n: int, *, seed: int = 0, split: str = "train") -> list[dict]:
    """Demonstrations of `mul3_rows(...)`: call python with `print(A * B)`, answer what it printed. The tool
    results are the sandbox's own (each demonstration runs its snippet there)."""
    from tpu_helpers.agents.sandbox import python

    agent = Agent(tools=[python], reward_funcs=[mul3_reward])

    def demo(row: dict) -> dict:
        return play(agent, row, lambda done: call("python", code=f"print({row['a']} * {row['b']})") if not done
                    else {"role": "assistant", "content": _last_reply(done)})

    return [demo(row) for row in mul3_rows(n, seed=seed, split=split)]


class Example:
    """What an example DATASET name means (`EXAMPLES`): its rows and demonstrations, and the ENVIRONMENT, TOOLS and
    REWARDS it is played with, which a run takes where it gives none of its own."""

    def __init__(self, rows: Callable[..., list[dict]], demonstrations: Callable[..., list[dict]], *,
                 environment: str | None = None, tools: str | None = None, rewards: str = "") -> None:
        self.rows, self.demonstrations = rows, demonstrations
        self.environment, self.tools, self.rewards = environment, tools, rewards


_HERE = __name__
# The example datasets by DATASET name: the one place that knows which environment, tools and rewards each has.
EXAMPLES: dict[str, Example] = {
    "lockers": Example(locker_rows, locker_demonstrations, environment=f"{_HERE}:Lockers",
                       rewards=f"{_HERE}:locker_reward"),
    "hunt": Example(hunt_rows, hunt_demonstrations, environment=f"{_HERE}:TreasureHunt", rewards=f"{_HERE}:hunt_reward"),
    "guessing": Example(guessing_rows, guessing_demonstrations, environment=f"{_HERE}:GuessingGame"),
    "multiply": Example(multiply_rows, multiply_demonstrations, tools=f"{_HERE}:multiply", rewards="answer"),
    "mul3": Example(mul3_rows, mul3_demonstrations, tools="tpu_helpers.agents.sandbox:python",
                    rewards=f"{_HERE}:mul3_reward"),
}
