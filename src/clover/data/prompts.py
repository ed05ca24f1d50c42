"""The project's own prompt set for self-distillation, generated from templates.

Twenty-one kinds (code, named functions, code edits, follow-up turns on code, explaining code,
SQL, shell, how-to steps, comparison, story or poem, email, JSON, explanation, list, fact,
rewrite, arithmetic, multi-turn, questions on a given text, classification, long answers), each
a few templates filled from small vocabularies written here, so thousands of distinct prompts
come from a few hundred lines and no external text. `prompt_set(n, seed)` is deterministic: the same
(n, seed) always gives the same prompts with the same ids, which is what makes distillation
resumable and the held-out split stable.
"""

from __future__ import annotations

import hashlib
import random

# Bumped whenever the templates or vocabularies change what prompt_set returns: a distilled
# directory records it, and `clover data distill` will not extend one of another version.
# 1: the first sets (until 2026-12); 2: 21 kinds, kept clear of the benchmarks' items.
PROMPT_SET_VERSION = 2

# The vocabularies are kept apart from the benchmarks' own items: no question, code task, topic
# or story of benchmarks/suites/quality.jsonl or of `clover bench speed`'s prompts appears here,
# so acceptance measured there is measured on prompts the drafters never saw
# (tests/test_distill.py checks it).
TOPICS = [
    "photosynthesis", "volcanoes", "gravity", "magnets", "rainbows", "vaccines", "black holes",
    "tides", "earthquakes", "coral reefs", "electric circuits", "batteries", "compilers",
    "databases", "encryption", "the internet", "recycling", "deserts", "glaciers",
    "bread making", "chess", "memory", "muscles", "bridges", "airplanes", "trains",
    "solar panels", "wind turbines", "money", "inflation", "maps", "calendars", "tornadoes",
    "the immune system", "rivers", "ants", "owls", "printing presses", "spreadsheets",
    "operating systems", "web browsers", "version control", "compost", "submarines",
    "hot air balloons", "fermentation", "telescopes", "satellites", "glass making",
]  # fmt: skip
AUDIENCES = ["a child", "a beginner", "a busy manager", "a high-school student",
             "a new programmer", "someone who has never heard of it"]  # fmt: skip
# (function name, arguments, what it does): code tasks none of which the quality suite asks
FUNCS = [
    ("clamp", "x, lo, hi", "returns x limited to the range lo..hi"),
    ("is_sorted", "xs", "returns True if the list xs is in increasing order"),
    ("rotate_left", "xs, k", "returns the list xs rotated left by k places"),
    ("running_total", "xs", "returns the running totals of the numbers in xs"),
    ("count_upper", "s", "returns how many uppercase letters the string s has"),
    ("merge_dicts", "a, b", "returns a new dictionary with the keys of a and b, b winning"),
    ("invert_dict", "d", "returns a dictionary with the keys and values of d swapped"),
    ("chunks", "xs, n", "splits the list xs into lists of at most n items"),
    ("is_leap_year", "year", "returns True if year is a leap year"),
    ("median", "xs", "returns the median of the non-empty list of numbers xs"),
    ("char_counts", "s", "returns a dictionary of how often each character appears in s"),
    ("is_anagram", "a, b", "returns True if the words a and b are anagrams"),
    ("initials", "name", "returns the initials of a full name, like 'A. L.'"),
    ("to_minutes", "seconds", "returns a string 'M:SS' for a number of seconds"),
    ("flatten", "xss", "returns one list with the items of the lists in xss"),
    ("title_case", "s", "returns s with every word capitalized"),
    ("first_negative", "xs", "returns the index of the first negative number in xs, or -1"),
    ("interleave", "a, b", "returns the items of the lists a and b taken in turn"),
    ("hamming", "a, b", "returns the number of positions where the strings a and b differ"),
    ("pairs_to_dict", "pairs", "turns a list of (key, value) pairs into a dictionary"),
    ("longest_word", "s", "returns the longest word in the sentence s"),
    ("compound", "principal, rate, years", "returns the balance after yearly compound interest"),
    ("only_digits", "s", "returns True if the string s is non-empty and all digits"),
    ("lcm", "a, b", "returns the least common multiple of two positive integers"),
]  # fmt: skip
LANGS = ["Python", "JavaScript"]
LIST_THINGS = [
    "ways to save energy at home", "healthy breakfast ideas", "things to pack for a hike",
    "ways to learn a new language", "uses of a paper clip", "good habits for programmers",
    "ways to reduce stress", "houseplants that are easy to care for", "board games for families",
    "ways to stay focused while working", "things to check before a long drive",
    "questions to ask at the end of an interview", "uses of baking soda",
    "signs that a plant needs water", "tips for a first camping trip",
    "ways to keep a laptop battery healthy", "ideas for an indoor afternoon",
]  # fmt: skip
COUNTRIES = ["Peru", "Kenya", "India", "Norway", "Chile", "Vietnam", "Poland", "Morocco",
             "Argentina", "Sweden", "Greece", "Thailand"]  # fmt: skip
FACTS = [
    "What is the capital of {c}?", "Which continent is {c} in?",
    "What is the chemical symbol for gold?",
    "Which planet is closest to the sun?", "What is the hardest natural substance?",
    "Who painted the Mona Lisa?", "What is the longest river in Africa?",
    "Which metal is liquid at room temperature?", "What is the largest desert in the world?",
    "What instrument has black and white keys?", "Which bird is a symbol of peace?",
]  # fmt: skip
NUMBER_FACTS = [
    "How many sides does a hexagon have?", "What is the smallest prime number?",
    "How many strings does a standard guitar have?", "How many players does a football team "
    "have on the field?", "How many minutes are in a football match?",
    "How many keys does a standard piano have?", "How many hearts does an octopus have?",
]  # fmt: skip
SENTENCES = [
    "the meeting has been moved to thursday because the room was not available",
    "our team finished the project early and the client was very happy with it",
    "please remember to bring your laptop and charger to the workshop tomorrow",
    "the new cafe downtown serves great food but the lines are very long",
    "i think we should test the code before we ship it to the customers",
    "the weather was cold and windy so the match was cancelled at the last minute",
]  # fmt: skip
STYLES = ["more formal", "shorter", "friendlier", "clearer", "more polite"]
UNITS = [("feet", "inches"), ("dozens", "eggs"), ("gigabytes", "megabytes"), ("miles", "yards"),
         ("centuries", "years"), ("tonnes", "kilograms")]  # fmt: skip


def _code(r: random.Random) -> list[dict]:
    name, args, does = r.choice(FUNCS)
    lang = r.choice(LANGS)
    task = f"{name}({args}) that {does}"
    form = r.choice([
        f"Write a {lang} function {task}. Keep it short.",
        f"In {lang}, write a small function {task}.",
        f"Show me a {lang} function {task}, with one example call.",
        f"Write a short {lang} function {task} and explain it in one sentence.",
    ])  # fmt: skip
    return [{"role": "user", "content": form}]


def _function(r: random.Random) -> list[dict]:
    """The quality suite's code format (a named function, only the code) on other tasks."""
    name, args, does = r.choice(FUNCS)
    tail = r.choice([" Reply with only the code.", " Reply with only the code.",
                     " Add a docstring.", " Include type hints."])  # fmt: skip
    return [{"role": "user", "content": f"Write a Python function `{name}({args})` that {does}."
             + tail}]  # fmt: skip


def _explain(r: random.Random) -> list[dict]:
    topic = r.choice(TOPICS)
    form = r.choice([
        f"Explain {topic} to {r.choice(AUDIENCES)}.",
        f"How does {topic} work? Answer in a short paragraph.",
        f"Why is {topic} important?",
        f"Describe {topic} in three sentences.",
        f"What is one common misconception about {topic}?",
    ])  # fmt: skip
    return [{"role": "user", "content": form}]


def _list(r: random.Random) -> list[dict]:
    n = r.choice([3, 4, 5, 6])
    thing = r.choice(LIST_THINGS)
    form = r.choice([f"List {n} {thing}.", f"Give me {n} {thing}, one line each.",
                     f"What are {n} {thing}? Use a numbered list.",
                     f"Name {n} {thing} as bullet points."])  # fmt: skip
    return [{"role": "user", "content": form}]


def _fact(r: random.Random) -> list[dict]:
    if r.random() < 0.3:
        q = r.choice(NUMBER_FACTS) + r.choice(["", " Answer with just the number."])
    else:
        q = r.choice(FACTS).format(c=r.choice(COUNTRIES))
        q += r.choice(["", " Answer in one word.", " Answer in a few words."])
    return [{"role": "user", "content": q}]


def _rewrite(r: random.Random) -> list[dict]:
    text = r.choice(SENTENCES)
    return [{"role": "user", "content": f"Rewrite this to be {r.choice(STYLES)}: {text}"}]


def _arith(r: random.Random) -> list[dict]:
    """Numbers of another range than the quality suite's (which stays at 100 and below)."""
    kind = r.randrange(5)
    if kind == 0:
        q = f"What is {r.randint(101, 999)} + {r.randint(101, 999)}?"
    elif kind == 1:
        a = r.randint(101, 999)
        q = f"What is {a} - {r.randint(101, a)}?"
    elif kind == 2:
        q = f"What is {r.randint(13, 99)} times {r.randint(13, 99)}?"
    elif kind == 3:
        big, small = r.choice(UNITS)
        q = f"How many {small} are in {r.randint(11, 90)} {big}?"
    else:
        a = r.randint(20, 99)
        q = f"If I have {a} apples and give away {r.randint(11, a - 1)}, how many are left?"
    return [{"role": "user", "content": q + r.choice(["", " Answer with just the number.",
                                                      " Show the steps."])}]  # fmt: skip


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
            "content": r.choice(
                [
                    "Yes, please keep it simple.",
                    "Yes, and give one example.",
                    "Yes, in three bullet points.",
                ]
            ),  # fmt: skip
        },  # fmt: skip
    ]


SNIPPETS = [  # none of them, fixed, is one of the quality suite's code tasks
    ("def add_fee(price, fee):\n    return price - fee", "it should add the fee, not subtract it"),
    ("def is_odd(n):\n    return n % 2 == 0", "it returns the wrong answer"),
    ("def last_two(xs):\n    return xs[len(xs) - 2:len(xs) + 1][1]", "it returns one item"),
    ("def greet(name):\n    print('Hello ' + name)", "it should return the text instead"),
    ("def longest(words):\n    best = ''\n    for w in words:\n        if len(w) < len(best):\n"
     "            best = w\n    return best", "it always returns an empty string"),
    ("def first_word(text):\n    return text.split(',')[0]", "it splits on the wrong character"),
    ("def percent(part, whole):\n    return part / whole", "it should return a percentage"),
    ("def count_long(words):\n    n = 0\n    for w in words:\n        if len(w) > 5:\n"
     "            n = 1\n    return n", "it never counts past one"),
]  # fmt: skip
# correct code, for "explain this" and for follow-up edits of an assistant's earlier answer
GOOD_CODE = [
    "def window_sums(xs, k):\n    return [sum(xs[i:i + k]) for i in range(len(xs) - k + 1)]",
    "def dedent(lines):\n    cut = min(len(l) - len(l.lstrip()) for l in lines if l.strip())\n"
    "    return [l[cut:] for l in lines]",
    "def grade(score):\n    if score >= 90:\n        return 'A'\n    if score >= 75:\n"
    "        return 'B'\n    return 'C'",
    "def word_freq(text):\n    counts = {}\n    for w in text.lower().split():\n"
    "        counts[w] = counts.get(w, 0) + 1\n    return counts",
    "def binary_search(xs, x):\n    lo, hi = 0, len(xs) - 1\n    while lo <= hi:\n"
    "        mid = (lo + hi) // 2\n        if xs[mid] == x:\n            return mid\n"
    "        if xs[mid] < x:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n"
    "    return -1",
    "function slugify(title) {\n  return title.toLowerCase().trim().replace(/\\s+/g, '-');\n}",
    "def read_numbers(path):\n    with open(path) as f:\n"
    "        return [float(x) for x in f if x.strip()]",
]  # fmt: skip
EDITS = [
    "add a docstring", "add type hints", "rename the variables to clearer names",
    "make it handle an empty input", "rewrite it in JavaScript", "add a short test for it",
    "add comments", "make it raise a ValueError on bad input",
]  # fmt: skip
TASKS = [
    "plant a tomato seedling", "back up the files on a laptop", "change a bicycle tire",
    "prepare for a job interview", "set up a new email account", "clean a keyboard",
    "write a good commit message", "boil an egg", "start a vegetable soup",
    "fix a squeaky door hinge", "make a paper airplane", "write a simple monthly budget",
    "repot a houseplant", "set up a Python virtual environment", "undo the last git commit",
    "wrap a present neatly",
]  # fmt: skip
PAIRS = [
    ("trains", "planes"), ("Python", "JavaScript"), ("solar power", "wind power"),
    ("books", "films"), ("a laptop", "a tablet"), ("running", "swimming"),
    ("cities", "villages"), ("lists", "tuples in Python"), ("email", "instant messaging"),
    ("renting", "buying a home"), ("SQL", "NoSQL databases"), ("paper books", "e-readers"),
]  # fmt: skip
CHARACTERS = ["a clumsy dragon", "a curious cat", "an old lighthouse keeper", "a young baker",
              "a tired astronaut", "a brave little boat", "a shy giraffe",
              "a retired pirate"]  # fmt: skip
SUFFIXES = ["", "", " Keep it short.", " Use simple words.", " Be precise.",
            " Answer in under 120 words.", " Add a one-line summary at the end."]  # fmt: skip
RECIPIENTS = ["your manager", "a colleague", "a neighbour", "a customer", "your team"]
OCCASIONS = [
    "ask a colleague to review a document by Friday", "thank a teacher for their help",
    "tell the team the office is closed on Monday", "ask a landlord to fix the heating",
    "invite the neighbours to a street party", "apologize for missing a meeting",
    "ask for a day off next week", "announce a new team member",
]  # fmt: skip


def _code_edit(r: random.Random) -> list[dict]:
    code, bug = r.choice(SNIPPETS)
    if r.random() < 0.5:
        ask = f"This Python function has a bug: {bug}. Fix it.\n\n{code}"
    else:
        ask = f"Here is a Python function:\n\n{code}\n\nPlease {r.choice(EDITS)}."
    return [{"role": "user", "content": ask + r.choice(SUFFIXES)}]


def _code_follow_up(r: random.Random) -> list[dict]:
    """A second turn on code the assistant wrote in the first."""
    code = r.choice(GOOD_CODE)
    lang = "JavaScript" if code.startswith("function") else "Python"
    return [
        {"role": "user", "content": f"Write a small {lang} helper for my project."},
        {"role": "assistant", "content": f"Here is one:\n\n```\n{code}\n```"},
        {
            "role": "user",
            "content": r.choice(
                [
                    f"Thanks. Can you {r.choice(EDITS)}?",
                    "What does it do with an empty input?",
                    "Can you explain how it works?",
                ]
            ),
        },  # fmt: skip
    ]


def _explain_code(r: random.Random) -> list[dict]:
    code = r.choice(GOOD_CODE)
    form = r.choice([f"What does this code do?\n\n{code}",
                     f"Explain this code line by line:\n\n{code}",
                     f"Is there anything to improve in this code?\n\n{code}"])  # fmt: skip
    return [{"role": "user", "content": form + r.choice(SUFFIXES)}]


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
    topic = r.choice(TOPICS + COUNTRIES)
    form = r.choice([
        f"Give three facts about {topic} as a JSON list of strings.",
        f'Describe {topic} as a JSON object with the keys "name", "summary" and "examples".',
    ])  # fmt: skip
    return [{"role": "user", "content": form}]


NAMES = ["Maya", "Tomas", "Aiko", "Ravi", "Lena", "Omar", "Greta", "Kofi"]
JOBS = ["nurse", "carpenter", "librarian", "bus driver", "chef", "gardener", "pilot"]
PLACES = ["a small harbour town", "a busy capital", "a mountain village", "a university town"]
EVENTS = [
    "the power went out for the whole afternoon", "a storm closed the main road",
    "a local newspaper wrote about the work", "two new colleagues joined",
    "the budget was cut by a third", "an old friend came to visit",
]  # fmt: skip


def _passage(r: random.Random) -> tuple[str, str, str]:
    name, job, place = r.choice(NAMES), r.choice(JOBS), r.choice(PLACES)
    event, day = r.choice(EVENTS), r.choice(["Monday", "Wednesday", "Saturday"])
    text = (f"{name} works as a {job} in {place}. Most days start early, with a long walk to "
            f"work and a quick look at the plan for the day. On {day}, {event}. {name} decided "
            f"to {r.choice(['stay late', 'ask for help', 'change the plan', 'write a report'])} "
            "and the week ended better than it began.")  # fmt: skip
    return text, name, day


def _reading(r: random.Random) -> list[dict]:
    """Questions about a text given in the prompt: answers copy from the context."""
    text, name, day = _passage(r)
    ask = r.choice([f"What happened on {day}?", f"What is {name}'s job?",
                    "Summarize this text in one sentence.", "Give this text a short title.",
                    f"Where does {name} work?", "List the facts this text states."])  # fmt: skip
    return [{"role": "user", "content": f"Read this:\n\n{text}\n\n{ask}"}]


TABLES = [
    ("employees", "id, name, department, salary", "salary", "department", "employee"),
    ("orders", "id, customer, total, created_at", "total", "customer", "order"),
    ("books", "id, title, author, year", "year", "author", "book"),
    ("students", "id, name, grade, age", "age", "grade", "student"),
]  # fmt: skip


def _sql(r: random.Random) -> list[dict]:
    table, cols, num, cat, row = r.choice(TABLES)
    task = r.choice([f"lists every {row} whose {num} is above {r.randint(20, 900)}",
                     f"counts the {row}s per {cat}",
                     f"returns the 5 {row}s with the highest {num}",
                     f"finds the average {num} per {cat}",
                     f"deletes the {row} with id 7"])  # fmt: skip
    return [{"role": "user", "content": f"A table {table}({cols}). Write a SQL query that {task}."
             + r.choice(["", " Reply with only the query.", " Explain it briefly."])}]  # fmt: skip


SHELL = [
    ("lists the files in a directory, largest first", "ls -lS"),
    ("counts the lines in a file", "wc -l notes.txt"),
    ("finds every .py file under the current directory", "find . -name '*.py'"),
    ("shows the last 20 lines of a log file", "tail -n 20 app.log"),
    ("searches for the word error in every .log file", "grep -n error *.log"),
    ("shows how much disk space each folder uses", "du -sh *"),
    ("makes a compressed archive of a folder", "tar czf backup.tgz docs"),
]  # fmt: skip


def _shell(r: random.Random) -> list[dict]:
    task, cmd = r.choice(SHELL)
    form = r.choice([f"Which shell command {task}?", f"Explain this shell command: `{cmd}`",
                     f"On Linux, what command {task}? Show an example."])  # fmt: skip
    return [{"role": "user", "content": form}]


def _long(r: random.Random) -> list[dict]:
    """Asks for long answers: the distilled answers run to the token limit."""
    form = r.choice([
        f"Write a detailed guide on how to {r.choice(TASKS)}, with an introduction, numbered "
        "steps and common mistakes.",
        f"Write a 300-word essay about {r.choice(TOPICS)}.",
        f"Write a detailed explanation of {r.choice(TOPICS)} with three sections and headings.",
        f"Write a long story about {r.choice(CHARACTERS)}, in several paragraphs.",
    ])  # fmt: skip
    return [{"role": "user", "content": form}]


REVIEWS = [
    "The battery lasts two days and the screen is sharp.", "It broke after one week.",
    "Delivery was late but the support team fixed it quickly.",
    "Too loud, too heavy and too expensive.", "Exactly what I needed for my small kitchen.",
]  # fmt: skip
GROUPS = [
    ("fruits and vegetables", "carrot, pear, leek, plum, spinach, grape"),
    ("mammals and birds", "owl, whale, sparrow, horse, eagle, bat"),
    ("even and odd numbers", "14, 27, 38, 51, 66, 73"),
    ("metals and non-metals", "iron, oxygen, copper, carbon, zinc, sulfur"),
]  # fmt: skip


def _classify(r: random.Random) -> list[dict]:
    if r.random() < 0.5:
        q = f'Is this review positive, negative or mixed? "{r.choice(REVIEWS)}"'
    else:
        what, items = r.choice(GROUPS)
        q = f"Sort these into {what}: {items}."
    return [{"role": "user", "content": q + r.choice(["", " Explain briefly.", " One line."])}]


KINDS = {
    "code": _code,
    "function": _function,
    "code_edit": _code_edit,
    "code_follow_up": _code_follow_up,
    "explain_code": _explain_code,
    "sql": _sql,
    "shell": _shell,
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
    "reading": _reading,
    "classify": _classify,
    "long": _long,
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
