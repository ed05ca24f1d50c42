"""The project's own prompt set for self-distillation, generated from templates.

Thirteen kinds (code, code edits, explanation, how-to steps, comparison, list, fact, rewrite,
arithmetic, a short story or poem, an email, JSON, multi-turn), each a few templates filled
from small vocabularies written here, so thousands of distinct prompts come
from a few hundred lines and no external text. `prompt_set(n, seed)` is deterministic: the same
(n, seed) always gives the same prompts with the same ids, which is what makes distillation
resumable and the held-out split stable.
"""

from __future__ import annotations

import hashlib
import random

TOPICS = [
    "photosynthesis", "volcanoes", "the water cycle", "gravity", "magnets", "rainbows",
    "vaccines", "black holes", "tides", "earthquakes", "bees", "coral reefs", "the moon",
    "electric circuits", "batteries", "compilers", "databases", "encryption", "the internet",
    "recycling", "clouds", "deserts", "glaciers", "bread making", "coffee", "chess",
    "the heart", "sleep", "memory", "muscles", "bridges", "airplanes", "bicycles", "trains",
    "solar panels", "wind turbines", "money", "inflation", "maps", "calendars",
]  # fmt: skip
AUDIENCES = ["a ten-year-old", "a beginner", "a busy manager", "a high-school student"]
FUNCS = [
    ("reverse a string", "s"), ("count the vowels in a string", "s"),
    ("return the largest number in a list", "xs"), ("check whether a number is prime", "n"),
    ("compute the factorial of n", "n"), ("remove duplicates from a list", "xs"),
    ("check whether a string is a palindrome", "s"), ("sum the even numbers in a list", "xs"),
    ("convert Celsius to Fahrenheit", "c"), ("return the n-th Fibonacci number", "n"),
    ("count the words in a sentence", "s"), ("flatten a list of lists", "xss"),
    ("find the average of a list of numbers", "xs"), ("capitalize every word in a string", "s"),
]  # fmt: skip
LANGS = ["Python", "JavaScript"]
LIST_THINGS = [
    "tips for better sleep", "ways to save energy at home", "healthy breakfast ideas",
    "benefits of reading", "things to pack for a hike", "ways to learn a new language",
    "reasons to exercise", "uses of a paper clip", "good habits for programmers",
    "ways to reduce stress", "houseplants that are easy to care for", "board games for families",
]  # fmt: skip
FACTS = [
    "What is the capital of {c}?", "Which continent is {c} in?",
    "What is the boiling point of water in Celsius?", "How many legs does a spider have?",
    "What gas do plants take in from the air?", "What is the largest planet in our solar system?",
    "How many days are in a leap year?", "What is the chemical symbol for gold?",
    "Who wrote Romeo and Juliet?", "What is the freezing point of water in Fahrenheit?",
    "How many continents are there?", "What is the tallest animal?",
]  # fmt: skip
COUNTRIES = ["France", "Japan", "Brazil", "Canada", "Egypt", "Italy", "India", "Kenya", "Peru"]
SENTENCES = [
    "the meeting has been moved to thursday because the room was not available",
    "our team finished the project early and the client was very happy with it",
    "please remember to bring your laptop and charger to the workshop tomorrow",
    "the new cafe downtown serves great coffee but the lines are very long",
    "i think we should test the code before we ship it to the customers",
    "the weather was cold and rainy so the picnic was cancelled at the last minute",
]  # fmt: skip
STYLES = ["more formal", "shorter", "friendlier", "clearer", "more polite"]
UNITS = [("kilometers", "meters", 1000), ("hours", "minutes", 60), ("kilograms", "grams", 1000)]


def _code(r: random.Random) -> list[dict]:
    task, arg = r.choice(FUNCS)
    lang = r.choice(LANGS)
    form = r.choice([
        f"Write a {lang} function that takes {arg} and returns the result: {task}. "
        "Keep it short.",
        f"In {lang}, how do I {task}? Give a small function.",
        f"Show me a {lang} function to {task}, with one example call.",
        f"Write a short {lang} function to {task} and explain it in one sentence.",
    ])  # fmt: skip
    return [{"role": "user", "content": form}]


def _explain(r: random.Random) -> list[dict]:
    topic = r.choice(TOPICS)
    form = r.choice([
        f"Explain {topic} to {r.choice(AUDIENCES)}.",
        f"How does {topic} work? Answer in a short paragraph.",
        f"Why is {topic} important?",
        f"Describe {topic} in three sentences.",
    ])  # fmt: skip
    return [{"role": "user", "content": form}]


def _list(r: random.Random) -> list[dict]:
    n = r.choice([3, 4, 5])
    thing = r.choice(LIST_THINGS)
    form = r.choice([f"List {n} {thing}.", f"Give me {n} {thing}, one line each.",
                     f"What are {n} {thing}? Use a numbered list."])  # fmt: skip
    return [{"role": "user", "content": form}]


def _fact(r: random.Random) -> list[dict]:
    return [{"role": "user", "content": r.choice(FACTS).format(c=r.choice(COUNTRIES))}]


def _rewrite(r: random.Random) -> list[dict]:
    text = r.choice(SENTENCES)
    return [{"role": "user", "content": f"Rewrite this to be {r.choice(STYLES)}: {text}"}]


def _arith(r: random.Random) -> list[dict]:
    a, b = r.randint(2, 99), r.randint(2, 99)
    kind = r.randrange(4)
    if kind == 0:
        q = f"What is {a} + {b}?"
    elif kind == 1:
        q = f"What is {a} times {b}? Show the steps."
    elif kind == 2:
        big, small, factor = r.choice(UNITS)
        q = f"How many {small} are in {a} {big}?"
    else:
        q = f"If I have {a} apples and give away {min(a, b)}, how many are left?"
    return [{"role": "user", "content": q}]


def _multi_turn(r: random.Random) -> list[dict]:
    topic = r.choice(TOPICS)
    return [
        {"role": "user", "content": f"What is {topic}?"},
        {
            "role": "assistant",
            "content": f"{topic.capitalize()} is a topic many people ask "
            "about. Would you like a short explanation?",
        },  # fmt: skip
        {
            "role": "user",
            "content": r.choice(["Yes, please keep it simple.", "Yes, and give one example."]),
        },  # fmt: skip
    ]


SNIPPETS = [
    ("def add(a, b):\n    return a - b", "it should add, not subtract"),
    ("def is_even(n):\n    return n % 2 == 1", "it returns the wrong answer"),
    ("def last(xs):\n    return xs[len(xs)]", "it raises an IndexError"),
    ("def greet(name):\n    print('Hello ' + name)", "it should return the text instead"),
    ("def total(prices):\n    s = 0\n    for p in prices:\n        s = p\n    return s",
     "it only returns the last price"),
    ("def first_word(text):\n    return text.split(',')[0]", "it splits on the wrong character"),
]  # fmt: skip
EDITS = [
    "add a docstring", "add type hints", "rename the variables to clearer names",
    "make it handle an empty input", "rewrite it in JavaScript", "add a short test for it",
]  # fmt: skip
TASKS = [
    "make a cup of tea", "plant a tomato seedling", "back up the files on a laptop",
    "change a bicycle tire", "prepare for a job interview", "set up a new email account",
    "clean a keyboard", "write a good commit message", "boil an egg", "start a vegetable soup",
]  # fmt: skip
PAIRS = [
    ("cats", "dogs"), ("trains", "planes"), ("tea", "coffee"), ("Python", "JavaScript"),
    ("solar power", "wind power"), ("books", "films"), ("a laptop", "a tablet"),
    ("running", "swimming"), ("cities", "villages"), ("lists", "tuples in Python"),
]  # fmt: skip
CHARACTERS = ["a lost robot", "a curious cat", "an old lighthouse keeper", "a young baker",
              "a tired astronaut", "a brave little boat"]  # fmt: skip
SUFFIXES = ["", "", " Keep it short.", " Use simple words.", " Be precise.",
            " Answer in under 120 words.", " Add a one-line summary at the end."]  # fmt: skip
RECIPIENTS = ["your manager", "a colleague", "a neighbour", "a customer", "your team"]
OCCASIONS = [
    "ask a colleague to review a document by Friday", "thank a teacher for their help",
    "tell the team the office is closed on Monday", "ask a landlord to fix the heating",
    "invite a friend to a birthday dinner", "apologize for missing a meeting",
]  # fmt: skip


def _code_edit(r: random.Random) -> list[dict]:
    code, bug = r.choice(SNIPPETS)
    if r.random() < 0.5:
        ask = f"This Python function has a bug: {bug}. Fix it.\n\n{code}"
    else:
        ask = f"Here is a Python function:\n\n{code}\n\nPlease {r.choice(EDITS)}."
    return [{"role": "user", "content": ask + r.choice(SUFFIXES)}]


def _howto(r: random.Random) -> list[dict]:
    task = r.choice(TASKS)
    form = r.choice([f"How do I {task}? Give step-by-step instructions.",
                     f"Explain, step by step, how to {task}.",
                     f"What are the steps to {task}? Number them."])  # fmt: skip
    return [{"role": "user", "content": form + r.choice(SUFFIXES)}]


def _compare(r: random.Random) -> list[dict]:
    a, b = r.choice(PAIRS)
    form = r.choice([f"Compare {a} and {b}.", f"What are the differences between {a} and {b}?",
                     f"Give two pros and two cons of {a} versus {b}."])  # fmt: skip
    return [{"role": "user", "content": form + r.choice(SUFFIXES)}]


def _story(r: random.Random) -> list[dict]:
    who, topic = r.choice(CHARACTERS), r.choice(TOPICS)
    form = r.choice([f"Write a short story about {who}.",
                     f"Write a short poem about {topic}.",
                     f"Tell a bedtime story about {who} who learns about {topic}."])  # fmt: skip
    return [{"role": "user", "content": form + r.choice(SUFFIXES)}]


def _email(r: random.Random) -> list[dict]:
    who, why = r.choice(RECIPIENTS), r.choice(OCCASIONS)
    form = r.choice([f"Write a short email to {why}.", f"Write an email to {who} to {why}."])
    return [{"role": "user", "content": form + r.choice(SUFFIXES)}]


def _json(r: random.Random) -> list[dict]:
    topic = r.choice(TOPICS + [c for c in COUNTRIES])
    form = r.choice([
        f"Give three facts about {topic} as a JSON list of strings.",
        f'Describe {topic} as a JSON object with the keys "name", "summary" and "examples".',
    ])  # fmt: skip
    return [{"role": "user", "content": form}]


KINDS = {
    "code": _code,
    "code_edit": _code_edit,
    "howto": _howto,
    "compare": _compare,
    "story": _story,
    "email": _email,
    "json": _json,
    "explain": _explain,
    "list": _list,
    "fact": _fact,
    "rewrite": _rewrite,
    "arithmetic": _arith,
    "multi_turn": _multi_turn,
}


def prompt_id(messages: list[dict]) -> str:
    text = "\x1e".join(f"{m['role']}\x1f{m['content']}" for m in messages)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def prompt_set(n: int, seed: int = 0, heldout: float = 0.05) -> list[dict]:
    """n distinct prompts: [{"id", "kind", "split": "train"|"heldout", "messages"}].

    The split is a function of the id alone, so it never changes when n grows."""
    r = random.Random(seed)
    kinds = list(KINDS)
    out, seen = [], set()
    attempts = 0
    while len(out) < n and attempts < 50 * n:
        attempts += 1
        kind = kinds[attempts % len(kinds)]  # a kind whose templates run out is skipped
        messages = KINDS[kind](r)
        pid = prompt_id(messages)
        if pid in seen:
            continue
        seen.add(pid)
        split = "heldout" if int(pid, 16) % 10_000 < heldout * 10_000 else "train"
        out.append({"id": pid, "kind": kind, "split": split, "messages": messages})
    return out
