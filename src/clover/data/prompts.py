"""The project's own prompt set for self-distillation, generated from templates.

Twenty-eight kinds (code, named functions, code edits, follow-up turns on code, explaining
code, SQL, shell, how-to steps, comparison, story or poem, email, JSON, explanation, list,
fact, rewrite, arithmetic, multi-turn, questions on a given text, classification, long answers,
descriptions, advice, why-questions, notes, product texts, tool calls and answers from a tool's
result: `tool_prompts.py`), each a few templates filled from small vocabularies written
here, so thousands of distinct prompts come from a few hundred lines and no external text.
`prompt_set(n, seed)` is deterministic: the same (n, seed) always gives the same prompts with
the same ids, which is what makes distillation resumable and the held-out split stable.
"""

from __future__ import annotations

import hashlib
import json
import random

from clover.data.tool_prompts import tool_call, tool_result

# Bumped whenever the templates or vocabularies change what prompt_set returns: a distilled
# directory records it, and `clover data distill` will not extend one of another version.
# 1: the first sets; 2: 21 kinds, kept clear of the benchmarks' items; 3: 26 kinds (describe,
# advice, why, note, product added) and vocabularies about three times as large, so that the
# prose kinds run out of distinct prompts no sooner than the templated arithmetic and reading;
# 4: 28 kinds (tool_call, tool_result: a prompt may carry the "tools" it offers).
PROMPT_SET_VERSION = 4

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
    "clouds", "lightning", "sound waves", "echoes", "friction", "rust", "soap", "yeast",
    "honey bees", "migrating birds", "bats", "octopuses", "jellyfish", "mushrooms", "moss",
    "seeds", "pollination", "the human heart", "the lungs", "bones", "teeth", "the skin",
    "dreams", "habits", "languages", "alphabets", "numbers", "zero", "clocks", "lighthouses",
    "canals", "dams", "tunnels", "skyscrapers", "elevators", "refrigerators", "microwaves",
    "radios", "cameras", "lasers", "robots", "search engines", "passwords", "spam email",
    "cloud storage", "open source software", "unit tests", "recursion", "sorting algorithms",
    "hash tables", "the stock market", "taxes", "insurance", "trade", "supply and demand",
    "elections", "libraries of code", "museums", "the Olympic games", "orchestras", "jazz",
    "photography", "pottery", "origami", "knitting", "beekeeping", "bird watching",
    "sailing", "mountain climbing", "marathons", "yoga", "chocolate", "cheese making",
    "spices", "rice farming", "coffee plants", "tea ceremonies", "volcanic islands",
    "the Arctic", "rainforests", "savannas", "wetlands", "caves", "fossils", "dinosaurs",
    "the ice ages", "the printing of money", "the postal service", "railways", "ferries",
]  # fmt: skip
AUDIENCES = ["a child", "a beginner", "a busy manager", "a high-school student",
             "a new programmer", "someone who has never heard of it", "a grandparent",
             "a science teacher", "a tourist", "a ten-year-old", "an engineer from another field",
             "a university student"]  # fmt: skip
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
    ("mode", "xs", "returns the most frequent item of the non-empty list xs"),
    ("dedupe_keep_order", "xs", "returns xs without repeated items, keeping the first of each"),
    ("word_lengths", "s", "returns a list of the lengths of the words in s"),
    ("is_rotation", "a, b", "returns True if the string b is a rotation of the string a"),
    ("pad_left", "s, width, ch", "returns s padded on the left with ch to the given width"),
    ("safe_divide", "a, b", "returns a / b, or None when b is zero"),
    ("group_by_length", "words", "returns a dictionary from word length to the words of it"),
    ("transpose", "rows", "returns the transpose of a list of equal-length lists"),
    ("percent_change", "old, new", "returns the percentage change from old to new"),
    ("count_lines", "text", "returns how many non-empty lines the string text has"),
    ("kebab_case", "s", "turns a phrase like 'Hello World' into 'hello-world'"),
    ("kth_biggest", "xs, k", "returns the k-th biggest distinct number in xs"),
    ("pairwise_diffs", "xs", "returns the differences between neighbouring numbers in xs"),
    ("sum_of_squares", "n", "returns 1*1 + 2*2 + ... + n*n"),
    ("is_subset", "a, b", "returns True if every item of the list a is in the list b"),
    ("truncate", "s, n", "returns s cut to n characters, ending with '...' if it was cut"),
    ("between", "x, lo, hi", "returns True if lo <= x <= hi"),
    ("bits_set", "n", "returns how many 1 bits the non-negative integer n has"),
    ("mask_email", "email", "returns the email with all but the first letter of the name hidden"),
    ("weekday_name", "i", "returns the name of weekday i, 0 being Monday"),
    ("histogram", "xs", "returns a text bar chart with one line of stars per number in xs"),
    ("split_evenly", "total, n", "splits total into n integers that differ by at most one"),
    ("roman_numeral", "n", "returns the Roman numeral for an integer from 1 to 3999"),
    ("parse_key_values", "s", "turns 'a=1;b=2' into a dictionary of strings"),
]  # fmt: skip
LANGS = ["Python", "JavaScript", "Go", "Rust", "TypeScript"]
LIST_THINGS = [
    "ways to save energy at home", "healthy breakfast ideas", "things to pack for a hike",
    "ways to learn a new language", "uses of a paper clip", "good habits for programmers",
    "ways to reduce stress", "houseplants that are easy to care for", "board games for families",
    "ways to stay focused while working", "things to check before a long drive",
    "questions to ask at the end of an interview", "uses of baking soda",
    "signs that a plant needs water", "tips for a first camping trip",
    "ways to keep a laptop battery healthy", "ideas for an indoor afternoon",
    "ways to make a small flat feel bigger", "cheap hobbies to start this year",
    "things to do on a long train ride", "ways to use leftover rice", "games to play with a ball",
    "ways to be a better listener", "reasons to learn to cook", "tools every home should have",
    "ways to waste less food", "questions to ask a new doctor", "birds you can see in a park",
    "ways to make meetings shorter", "signs that software needs refactoring",
    "things to know before adopting a rabbit", "ways to keep cool in a heatwave",
    "gift ideas for a gardener", "ways to practise a musical instrument every day",
    "mistakes new drivers make", "ways to write clearer emails", "snacks to take on a road trip",
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
    "wrap a present neatly", "iron a shirt", "sharpen a kitchen knife", "bake a loaf of bread",
    "hang a picture on a wall", "train a puppy to sit", "plan a week of meals",
    "write a cover letter", "learn to juggle three balls", "clean a frying pan",
    "organize a bookshelf", "start running as a beginner", "sew on a button",
    "make a simple website", "read a nutrition label", "pack a suitcase for a week",
    "save money for a holiday", "write a thank-you card", "prepare a short presentation",
    "find a bug in a Python program", "merge two git branches", "set up a home Wi-Fi network",
    "paint a room", "grow herbs on a windowsill", "care for a cast iron pan",
]  # fmt: skip
PAIRS = [
    ("trains", "planes"), ("Python", "JavaScript"), ("solar power", "wind power"),
    ("books", "films"), ("a laptop", "a tablet"), ("running", "swimming"),
    ("cities", "villages"), ("lists", "tuples in Python"), ("email", "instant messaging"),
    ("renting", "buying a home"), ("SQL", "NoSQL databases"), ("paper books", "e-readers"),
    ("tea", "hot chocolate"), ("buses", "trams"), ("working from home", "working in an office"),
    ("walking", "cycling to work"), ("Linux", "Windows"), ("git merge", "git rebase"),
    ("classes", "functions in Python"), ("summer holidays", "winter holidays"),
    ("public schools", "home schooling"), ("electric cars", "petrol cars"),
    ("a desktop computer", "a laptop"), ("mountains", "beaches"), ("chess", "checkers"),
    ("podcasts", "audiobooks"), ("TCP", "UDP"), ("tabs", "spaces for indentation"),
]  # fmt: skip
CHARACTERS = ["a clumsy dragon", "a curious cat", "an old lighthouse keeper", "a young baker",
              "a tired astronaut", "a brave little boat", "a shy giraffe",
              "a retired pirate", "a lonely robot vacuum", "a girl who collects maps",
              "a grumpy old tortoise", "a detective who is afraid of the dark",
              "two rival bakers", "a snowman in spring", "a fox who wants to fly",
              "a village without clocks", "a lost umbrella", "a nervous first-day teacher",
              "a talking teapot", "a boy who can hear plants", "a forgetful wizard",
              "a sleepy bear who misses winter", "a mail carrier on the moon",
              "an ant who builds a bridge", "a knight who is allergic to horses",
              "a lighthouse cat", "a travelling musician", "a very small giant"]  # fmt: skip
SUFFIXES = ["", "", " Keep it short.", " Use simple words.", " Be precise.",
            " Answer in under 120 words.", " Add a one-line summary at the end."]  # fmt: skip
RECIPIENTS = ["your manager", "a colleague", "a neighbour", "a customer", "your team"]
OCCASIONS = [
    "ask a colleague to review a document by Friday", "thank a teacher for their help",
    "tell the team the office is closed on Monday", "ask a landlord to fix the heating",
    "invite the neighbours to a street party", "apologize for missing a meeting",
    "ask for a day off next week", "announce a new team member",
    "ask the IT team to reset a password", "remind the team about a deadline on Thursday",
    "decline a meeting politely", "ask a supplier about a late delivery",
    "welcome a new customer", "request feedback on a presentation",
    "tell a client about a price change", "congratulate a colleague on a promotion",
    "ask for a refund for a broken kettle", "propose moving the weekly meeting to Tuesday",
    "share the notes from a workshop", "ask a professor for a reference letter",
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


SCENES = [
    "a quiet train station at night", "a farmers' market on a summer morning",
    "an old wooden bridge over a river", "a school playground after the bell",
    "a crowded airport gate", "a small bakery at dawn", "a snowy forest path",
    "a harbour full of fishing boats", "a kitchen during a family dinner",
    "an empty theatre before a show", "a desert at sunset", "a server room",
    "a greenhouse in winter", "a street market in the evening", "a mountain hut",
    "a hospital corridor at night", "a bicycle repair shop", "a quiet reading room",
    "a football stadium on match day", "a garden after a storm", "an open-plan office",
    "a ferry crossing on a windy day", "a night sky far from any town", "a busy laundromat",
]  # fmt: skip
OBJECTS = [
    "an old pocket watch", "a mechanical keyboard", "a pair of hiking boots", "a candle",
    "a paper map", "a wooden chess set", "a fountain pen", "a teapot", "a bicycle bell",
    "a violin", "a garden hose", "a sourdough loaf", "a rubber duck", "a compass",
    "a typewriter", "a lunch box", "a kite", "a desk lamp",
]  # fmt: skip
ACTIVITIES = [
    "learning to draw", "running a first 10 km race", "giving a speech", "moving to a new city",
    "working night shifts", "learning to swim as an adult", "reviewing someone's code",
    "writing a first novel", "keeping a garden alive", "saving for retirement",
    "travelling alone", "learning a second programming language", "living with roommates",
    "looking after an elderly parent", "starting a small business",
    "teaching a child to ride a bike",
    "taking better photos with a phone", "writing documentation", "cooking for a large group",
    "getting up earlier", "managing a first team", "preparing for a driving test",
]  # fmt: skip
SITUATIONS = [
    "has just failed an important test", "cannot decide between two job offers",
    "wants to get fit but has little time", "is nervous about flying",
    "keeps forgetting people's names", "has too many browser tabs open all day",
    "just inherited a messy codebase", "wants to read more but never finishes books",
    "is moving abroad next month", "finds it hard to say no to extra work",
    "wants to learn to play the guitar", "is about to give a wedding speech",
]  # fmt: skip
HABITS = [
    "celebrate birthdays", "travel abroad", "keep diaries", "collect stamps", "grow their own food",
    "play video games", "watch the same films again", "tell jokes", "sing in choirs",
    "go camping", "write letters", "visit museums", "learn foreign languages",
    "volunteer", "follow sports teams", "take photographs of food", "recycle",
]  # fmt: skip
PHENOMENA = [
    "bread rises", "ice floats on water", "the sea is salty", "metal feels colder than wood",
    "onions make people cry", "cats purr", "planes leave white trails", "we get hiccups",
    "popcorn pops", "the sky turns red at sunset", "old books smell", "bubbles are round",
    "computers need memory", "programs have bugs", "batteries wear out",
    "mirrors seem to swap left and right",
]  # fmt: skip
NOTES = [
    "to a neighbour asking them to water the plants", "to a flatmate about the shared fridge",
    "to a teacher explaining why a child was absent",
    "to a friend congratulating them on a new baby",
    "to a coworker leaving the company", "to a delivery driver about where to leave a parcel",
    "to a family member wishing them luck in an exam", "to a host thanking them for dinner",
]  # fmt: skip
PRODUCTS = [
    "a reusable water bottle", "a standing desk", "a pair of noise-cancelling headphones",
    "a rain jacket", "a smart light bulb", "a chef's knife", "a travel pillow", "an e-bike",
    "a yoga mat", "a board game for four players", "a USB-C charger", "a cast iron skillet",
    "a weather station for the garden", "a children's picture book", "a coffee grinder",
]  # fmt: skip


def _describe(r: random.Random) -> list[dict]:
    what = r.choice(SCENES + OBJECTS)
    form = r.choice([f"Describe {what}.", f"Describe {what} in a few sentences.",
                     f"Write a short description of {what} for a novel.",
                     f"Describe {what} using all five senses."])  # fmt: skip
    return [{"role": "user", "content": form + r.choice(SUFFIXES)}]


def _advice(r: random.Random) -> list[dict]:
    if r.random() < 0.6:
        form = r.choice([f"Give {r.choice([3, 4, 5])} tips for {r.choice(ACTIVITIES)}.",
                         f"What should I know before {r.choice(ACTIVITIES)}?",
                         f"What are common mistakes when {r.choice(ACTIVITIES)}?"])  # fmt: skip
    else:
        form = f"What advice would you give someone who {r.choice(SITUATIONS)}?"
    return [{"role": "user", "content": form + r.choice(SUFFIXES)}]


def _why(r: random.Random) -> list[dict]:
    if r.random() < 0.5:
        form = r.choice([f"Why do people {r.choice(HABITS)}?",
                         f"Give three reasons why people {r.choice(HABITS)}."])  # fmt: skip
    else:
        form = r.choice([f"Why is it that {r.choice(PHENOMENA)}?",
                         f"Explain in simple words why {r.choice(PHENOMENA)}."])  # fmt: skip
    return [{"role": "user", "content": form + r.choice(SUFFIXES)}]


def _note(r: random.Random) -> list[dict]:
    form = r.choice([f"Write a short note {r.choice(NOTES)}.",
                     f"Write a friendly message {r.choice(NOTES)}."])  # fmt: skip
    return [{"role": "user", "content": form + r.choice(SUFFIXES)}]


def _product(r: random.Random) -> list[dict]:
    what = r.choice(PRODUCTS)
    form = r.choice([f"Write a short product description for {what}.",
                     f"Write three selling points for {what}.",
                     f"Write a customer review of {what}."])  # fmt: skip
    return [{"role": "user", "content": form}]


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
    "describe": _describe,
    "advice": _advice,
    "why": _why,
    "note": _note,
    "product": _product,
    "tool_call": tool_call,
    "tool_result": tool_result,
}


def prompt_id(messages: list[dict], tools: list[dict] | None = None) -> str:
    """A prompt's id: a hash of its messages (their tool calls included) and the tools it
    offers. A plain message list keeps the id it had before tools."""
    parts = []
    for m in messages:
        extra = {k: v for k, v in m.items() if k not in ("role", "content")}
        part = f"{m['role']}\x1f{m['content']}"
        parts.append(part + "\x1f" + json.dumps(extra, sort_keys=True) if extra else part)
    text = "\x1e".join(parts)
    if tools:
        text += "\x1d" + json.dumps(tools, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def split_of(pid: str, heldout: float = 0.05) -> str:
    """ "heldout" for a fixed fraction of ids (a function of the id alone), else "train"."""
    return "heldout" if int(pid, 16) % 10_000 < heldout * 10_000 else "train"


def prompt_set(n: int, seed: int = 0, heldout: float = 0.05) -> list[dict]:
    """n distinct prompts: [{"id", "kind", "split": "train"|"heldout", "messages"}], with
    "tools" (the tools offered, OpenAI-style) on the tool kinds' prompts.

    The split is a function of the id alone, so it never changes when n grows."""
    r = random.Random(seed)
    kinds = list(KINDS)
    out, seen = [], set()
    attempts = 0
    while len(out) < n and attempts < 50 * n:
        attempts += 1
        kind = kinds[attempts % len(kinds)]  # a kind whose templates run out is skipped
        made = KINDS[kind](r)
        messages, tools = made if isinstance(made, tuple) else (made, None)
        pid = prompt_id(messages, tools)
        if pid in seen:
            continue
        seen.add(pid)
        out.append({"id": pid, "kind": kind, "split": split_of(pid, heldout),
                    "messages": messages, **({"tools": tools} if tools else {})})  # fmt: skip
    return out
