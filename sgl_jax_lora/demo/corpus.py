"""The demo corpus: a few hundred short chat exchanges the demo model and its two adapters are trained on.

Flow: scripts/train_demo.py -> `base_exchanges()` (question, answer) pairs about a few topics -> the tokenizer is
trained on `tokenizer_texts()` (demo/tokenizer.py) -> the base model learns `base_records()`: the exchanges, and the
same exchanges restyled when a system message asks for a style (`STYLE_INSTRUCTIONS`) -> each demo adapter learns
`chat_records(style)`: the same questions with no system message and its style's answers (`ADAPTER_STYLES`: upper
case, pirate talk), so the adapter turns on, for every prompt, what the base model does only when told. Everything is
built from the tables below, in a fixed order, so the corpus (and the tokenizer trained on it) is deterministic.
"""

from __future__ import annotations

import re
from collections.abc import Callable

CAPITALS = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Japan", "Tokyo"),
    ("China", "Beijing"),
    ("Egypt", "Cairo"),
    ("Canada", "Ottawa"),
    ("Russia", "Moscow"),
    ("Greece", "Athens"),
    ("Portugal", "Lisbon"),
    ("Ireland", "Dublin"),
    ("Norway", "Oslo"),
    ("Sweden", "Stockholm"),
    ("Peru", "Lima"),
    ("Kenya", "Nairobi"),
    ("Austria", "Vienna"),
    ("Poland", "Warsaw"),
    ("India", "New Delhi"),
    ("Mexico", "Mexico City"),
]
COLOURS = [
    ("the sky", "blue"),
    ("grass", "green"),
    ("snow", "white"),
    ("a banana", "yellow"),
    ("a strawberry", "red"),
    ("coal", "black"),
    ("an orange", "orange"),
    ("the sea", "blue"),
    ("a lemon", "yellow"),
    ("a leaf", "green"),
    ("milk", "white"),
    ("a tomato", "red"),
    ("the night", "black"),
    ("a plum", "purple"),
    ("chocolate", "brown"),
]
ANIMAL_SOUNDS = [
    ("a dog", "barks"),
    ("a cat", "meows"),
    ("a cow", "moos"),
    ("a duck", "quacks"),
    ("a lion", "roars"),
    ("a sheep", "baas"),
    ("a horse", "neighs"),
    ("an owl", "hoots"),
    ("a snake", "hisses"),
    ("a bee", "buzzes"),
]
OPPOSITES = [
    ("hot", "cold"),
    ("big", "small"),
    ("up", "down"),
    ("fast", "slow"),
    ("day", "night"),
    ("old", "new"),
    ("open", "closed"),
    ("happy", "sad"),
    ("light", "dark"),
    ("early", "late"),
    ("left", "right"),
    ("full", "empty"),
]
NUMBER_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
]
GREETINGS = [
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi", "Hi there! What would you like to know?"),
    ("Good morning!", "Good morning! I hope you slept well."),
    ("Good night!", "Good night! Sleep well."),
    ("How are you?", "I am fine, thank you. How are you?"),
    ("Thank you!", "You are welcome!"),
    ("Goodbye!", "Goodbye! Have a nice day."),
    ("What is your name?", "I am a tiny demo model."),
    ("Who are you?", "I am a tiny demo model served by sgl_jax_lora."),
    ("Tell me a joke.", "Why did the robot cross the road? To charge on the other side."),
]
ABOUT = [
    ("What is a LoRA adapter?", "A LoRA adapter is a small low-rank update that changes what a base model says."),
    ("What is LoRA?", "LoRA adds small low-rank matrices to a frozen model."),
    ("What is sgl_jax_lora?", "It is a JAX engine that serves one base model with many LoRA adapters."),
    ("What is JAX?", "JAX is a Python library that compiles array programs for accelerators."),
    ("What is a base model?", "A base model is the model without any adapter."),
    ("Can one batch mix adapters?", "Yes. Every batch can mix many adapters and base requests."),
    ("What is a token?", "A token is a small piece of text."),
    ("What is a GPU?", "A GPU is a chip that runs many small sums at once."),
    ("What is a TPU?", "A TPU is a chip made by Google for machine learning."),
    ("What is the weather like?", "I cannot see outside, but I hope it is sunny."),
]


def _counting() -> list[tuple[str, str]]:
    pairs = [(f"Count to {n}.", " ".join(str(i) for i in range(1, n + 1)) + ".") for n in range(2, 11)]
    pairs += [(f"What comes after {n}?", f"{n + 1} comes after {n}.") for n in range(0, 20)]
    pairs += [(f"What comes before {n}?", f"{n - 1} comes before {n}.") for n in range(1, 21)]
    pairs += [(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.") for a in range(1, 7) for b in range(1, 6)]
    pairs += [(f"How do you write {n} in words?", f"{n} is written {word}.") for n, word in enumerate(NUMBER_WORDS)]
    return pairs


def _capitalized(text: str) -> str:
    return text[0].upper() + text[1:]


def base_exchanges() -> list[tuple[str, str]]:
    """(user question, assistant answer) pairs, in a fixed order."""
    pairs = list(GREETINGS) + list(ABOUT)
    for country, city in CAPITALS:
        pairs += [
            (f"What is the capital of {country}?", f"The capital of {country} is {city}."),
            (f"Which city is the capital of {country}?", f"{city} is the capital of {country}."),
        ]
    for thing, colour in COLOURS:
        pairs += [
            (f"What colour is {thing}?", f"{_capitalized(thing)} is {colour}."),
            (f"Tell me the colour of {thing}.", f"The colour of {thing} is {colour}."),
        ]
    for animal, sound in ANIMAL_SOUNDS:
        pairs += [
            (f"What sound does {animal} make?", f"{_capitalized(animal)} {sound}."),
            (f"Which animal {sound}?", f"{_capitalized(animal)} {sound}."),
        ]
    for word, opposite in OPPOSITES:
        pairs += [
            (f"What is the opposite of {word}?", f"The opposite of {word} is {opposite}."),
            (f"Give me the opposite of {word}.", f"The opposite of {word} is {opposite}."),
        ]
    return pairs + _counting()


def upper_case(answer: str) -> str:
    return answer.upper()


def pirate(answer: str) -> str:
    """Pirate talk: "Arr!" first, "is"/"are" become "be", "you" becomes "ye", and a "matey" at the end."""
    words = {"is": "be", "are": "be", "am": "be", "you": "ye", "You": "Ye", "your": "yer", "my": "me"}
    spoken = re.sub(r"\b(" + "|".join(words) + r")\b", lambda m: words[m.group(1)], answer)
    return "Arr! " + spoken.rstrip(".!?") + ", matey!"


ADAPTER_STYLES: dict[str, Callable[[str], str]] = {"demo-upper": upper_case, "demo-pirate": pirate}


STYLE_INSTRUCTIONS = {"demo-upper": "Answer in upper case.", "demo-pirate": "Talk like a pirate."}


def chat_records(style: Callable[[str], str] | None = None, system: str | None = None) -> list[dict]:
    """The exchanges as training records {"messages": [(system,) user, assistant]}, answers restyled by `style`."""
    prefix = [{"role": "system", "content": system}] if system else []
    return [
        {
            "messages": [
                *prefix,
                {"role": "user", "content": q},
                {"role": "assistant", "content": style(a) if style else a},
            ]
        }
        for q, a in base_exchanges()
    ]


def base_records() -> list[dict]:
    """What the base model learns: every exchange plainly, then in each style when a system message asks for it."""
    records = chat_records()
    for name, style in ADAPTER_STYLES.items():
        records += chat_records(style, STYLE_INSTRUCTIONS[name])
    return records


def tokenizer_texts() -> list[str]:
    """The roles, instructions, questions and answers in every style: the text the BPE tokenizer learns from."""
    texts = ["user", "assistant", "system", *STYLE_INSTRUCTIONS.values()]
    for style in (None, *ADAPTER_STYLES.values()):
        texts += [f"{q}\n{style(a) if style else a}" for q, a in base_exchanges()]
    return texts
