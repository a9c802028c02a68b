"""A small, deterministic, embedded English-like corpus for smoke-testing training without any download.

The text is a stream of short children's stories built from templates over a fixed cast of characters.
Each character has facts that never change (where they live, what they like, who their friend is, what
they fear), so a tiny byte-level GPT has real structure to pick up: spelling, grammar, dialogue punctuation
and, given enough steps, the facts themselves. Only the choice and order of stories depends on the seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["generate_corpus"]


@dataclass(frozen=True)
class _Character:
    name: str
    kind: str  # "girl", "boy", "fox", ... used in "a little {kind} named {name}"
    he: str
    him: str
    his: str
    home: str
    pet: str
    food: str
    color: str
    friend: str
    fear: str
    skill: str

    @property
    def pet_name(self) -> str:
        return self.pet.rsplit(" named ", 1)[-1]


# The facts are fixed module data (not drawn from the seed) so that every corpus, whatever its seed,
# states the same facts; a model trained on one seed can be probed with prompts about another.
_CAST: tuple[_Character, ...] = (
    _Character("Mia", "girl", "she", "her", "her", "a yellow house by the river", "a gray cat named Pip",
               "apples", "red", "Leo", "thunder", "paint"),
    _Character("Leo", "boy", "he", "him", "his", "a small farm near the hill", "a brown dog named Max",
               "bread with honey", "blue", "Mia", "the dark", "swim"),
    _Character("Sam", "boy", "he", "him", "his", "a tall blue house in the town", "a green frog named Hop",
               "soup", "green", "Lily", "big dogs", "sing"),
    _Character("Lily", "girl", "she", "her", "her", "a little cottage in the woods", "a white rabbit named Snow",
               "carrots", "purple", "Sam", "bees", "dance"),
    _Character("Finn", "fox", "he", "him", "his", "a warm den under an old oak tree", "a tiny mouse named Nib",
               "berries", "orange", "Rosa", "loud noises", "run"),
    _Character("Rosa", "rabbit", "she", "her", "her", "a burrow in the meadow", "a tiny snail named Slow",
               "lettuce", "pink", "Finn", "the owl", "jump"),
    _Character("Ben", "bear", "he", "him", "his", "a big cave in the mountains", "a little bird named Tweet",
               "fish", "brown", "Tom", "the cold water", "climb"),
    _Character("Tom", "boy", "he", "him", "his", "a boat house at the lake", "a yellow duck named Quack",
               "cheese", "yellow", "Ben", "high places", "read"),
)
_BY_NAME = {c.name: c for c in _CAST}

_PLACES = ("the park", "the beach", "the market", "the forest", "the garden", "the school", "the library",
           "the top of the hill", "the old bridge", "the bakery")
_OBJECTS = ("ball", "hat", "kite", "book", "key", "cup", "shoe", "map", "drum", "box")
_HIDING = ("under the bed", "behind the door", "in the tall grass", "under a big leaf", "next to the tree",
           "inside a basket", "on the high shelf", "under the table")
_WEATHER = ("The sun was warm.", "It was a windy day.", "The sky was gray and it began to rain.",
            "It was a cold morning.", "The sky was clear and blue.", "Snow fell softly on the ground.")
_TIMES = ("One morning", "One day", "One afternoon", "Early one morning", "One evening", "Last summer")
_FEELINGS = ("happy", "glad", "proud", "calm", "excited")
_SIGHTS = ("a bird singing in a tree", "a boat on the water", "a big red flower", "two squirrels playing",
           "a rainbow over the hill", "a line of little ants", "an old man feeding ducks")


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _a(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def _intro(r: random.Random, c: _Character) -> list[str]:
    first = r.choice((
        f"Once upon a time, there was a little {c.kind} named {c.name}.",
        f"There was once a {c.kind} called {c.name}.",
        f"{c.name} was a little {c.kind}.",
    ))
    facts = [f"{_cap(c.he)} lived in {c.home}.", f"{_cap(c.he)} had {c.pet}.",
             f"{_cap(c.his)} favorite food was {c.food}.", f"{_cap(c.his)} favorite color was {c.color}.",
             f"{_cap(c.his)} best friend was {c.friend}."]
    r.shuffle(facts)
    return [first, *facts[: r.randint(2, 4)]]


def _lost_object(r: random.Random, c: _Character, f: _Character) -> list[str]:
    obj, place, hide = r.choice(_OBJECTS), r.choice(_PLACES), r.choice(_HIDING)
    wrong = r.choice([p for p in _PLACES if p != place])
    return [
        f"{r.choice(_TIMES)}, {c.name} could not find {c.his} {c.color} {obj}.",
        f"{_cap(c.he)} looked everywhere, but it was gone.",
        f"{c.name} felt sad. {_cap(c.he)} went to see {f.name}.",
        f'"{f.name}, can you help me find my {obj}?" asked {c.name}.',
        f'"Yes, I will help you," said {f.name}. "Where did you see it last?"',
        f'"I think I left it at {place}," said {c.name}.',
        f"First they went to {wrong}, but the {obj} was not there.",
        f"Then they went to {place}. They looked and looked.",
        f"At last, {f.name} found the {c.color} {obj} {hide}.",
        f'"Thank you, {f.name}!" said {c.name}. {_cap(c.he)} gave {f.him} some {c.food}.',
        f"{c.name} and {f.name} were very {r.choice(_FEELINGS)}.",
    ]


def _trip(r: random.Random, c: _Character, f: _Character) -> list[str]:
    place = r.choice(_PLACES)
    sights = r.sample(_SIGHTS, 2)
    return [
        f"{r.choice(_TIMES)}, {c.name} and {f.name} went to {place}.",
        r.choice(_WEATHER),
        f"At {place}, they saw {sights[0]}.",
        f'"Look!" said {f.name}. "I can see {sights[1]}!"',
        f"{c.name} laughed. {_cap(c.he)} took out some {c.food} and {f.name} took out some {f.food}.",
        "They sat down and ate together.",
        f'"I like {f.food} best," said {f.name}. "And I like {c.food}," said {c.name}.',
        f"When the sun went down, {c.name} went home to {c.home}.",
        f"{_cap(c.he)} told {c.pet_name} all about the day.",
    ]


def _fear(r: random.Random, c: _Character, f: _Character) -> list[str]:
    return [
        f"{c.name} was afraid of {c.fear}.",
        f"{r.choice(_TIMES)}, {c.name} had to walk past {r.choice(_PLACES)}, and {c.fear} was there.",
        f"{_cap(c.he)} stopped and did not want to go on.",
        f'"What is wrong?" asked {f.name}.',
        f'"I am scared of {c.fear}," said {c.name} in a small voice.',
        f'"I will walk with you," said {f.name}. "We can be brave together."',
        f"{f.name} held {c.his} hand, and they walked on, step by step.",
        f"Soon they were on the other side. {c.name} was not so scared anymore.",
        f'"Thank you," said {c.name}. "You are a good friend."',
    ]


def _gift(r: random.Random, c: _Character, f: _Character) -> list[str]:
    obj = r.choice(_OBJECTS)
    return [
        f"{r.choice(_TIMES)}, {c.name} remembered that it was {f.name}'s birthday.",
        f"{c.name} wanted to make a gift. {_cap(c.he)} knew that {f.name} liked the color {f.color}.",
        f"So {c.name} made {_a(f.color)} {f.color} {obj} and put it in a box.",
        f"{_cap(c.he)} also brought some {f.food}, because {f.name} loved {f.food}.",
        f'"Happy birthday, {f.name}!" said {c.name}.',
        f"{f.name} opened the box and smiled. \"{_cap(_a(f.color))} {f.color} {obj}! It is my favorite color!\"",
        f"They ate the {f.food} and played until dark.",
    ]


def _practice(r: random.Random, c: _Character, f: _Character) -> list[str]:
    tries = r.randint(2, 4)
    return [
        f"{c.name} wanted to learn to {c.skill}.",
        f"The first time {c.he} tried, it did not go well. {_cap(c.he)} fell down.",
        f'"I will never learn to {c.skill}," said {c.name}.',
        f'"Try again," said {f.name}. "Everybody falls at first."',
        f"So {c.name} tried again, and again. {_cap(c.he)} tried {tries + 1} times.",
        f"After {tries + 1} tries, {c.name} could {c.skill}!",
        f"{_cap(c.he)} felt very {r.choice(_FEELINGS)}. Now {c.name} loves to {c.skill} every day.",
    ]


_Plot = Callable[[random.Random, _Character, _Character], list[str]]
# Each plot ends with a moral that fits it, so the closing sentence is predictable from the story.
_PLOTS: tuple[tuple[_Plot, tuple[str, ...]], ...] = (
    (_lost_object, ("Friends help each other.", "It is okay to ask for help.")),
    (_trip, ("It is good to share.", "A day with a friend is a good day.")),
    (_fear, ("Being brave does not mean you are not scared.", "Friends help each other.")),
    (_gift, ("Kind gifts make people smile.", "It is good to share.")),
    (_practice, ("Practice makes things easier.", "Never give up.")),
)


def _story(r: random.Random) -> str:
    c = r.choice(_CAST)
    # The companion is usually the fixed best friend (a consistent fact), sometimes someone else.
    f = _BY_NAME[c.friend] if r.random() < 0.7 else r.choice([x for x in _CAST if x is not c])
    plot, morals = r.choice(_PLOTS)
    lines = _intro(r, c) + plot(r, c, f)
    ending = r.choice(("The end.", r.choice(morals), f"{c.name} slept well that night."))
    return " ".join(lines) + " " + ending + "\n\n"


def generate_corpus(num_chars: int = 2_000_000, seed: int = 0) -> str:
    """Return exactly ``num_chars`` characters of template stories (ASCII, so also ``num_chars`` bytes).

    The same ``(num_chars, seed)`` always gives the same text, on any machine: only a private
    ``random.Random(seed)`` is used. A shorter request is a prefix of a longer one with the same seed.
    Stories are separated by a blank line; the last one is cut at ``num_chars``.
    """
    if isinstance(num_chars, bool) or not isinstance(num_chars, int) or num_chars <= 0:
        raise ValueError(f"num_chars must be a positive int, got {num_chars!r}")
    r = random.Random(seed)
    parts: list[str] = []
    total = 0
    while total < num_chars:
        s = _story(r)
        parts.append(s)
        total += len(s)
    return "".join(parts)[:num_chars]
