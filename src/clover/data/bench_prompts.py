"""The fixed prompts the benchmarks send, in one place.

Each list belongs to one benchmark, and its results files are compared run against run, so a
list's text and order stay as they are: a new prompt set is a new list under a new name.
Self-prompt generation (`clover.data.self_prompts`) drops prompts that ask one of the speed
prompts, so no drafter trains on the questions its speed is measured on.
"""

from __future__ import annotations

# `clover bench speed`: open-ended answers long enough to fill 128 tokens
SPEED_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works to a ten-year-old.",
    "List five tips for writing clean Python code, with a sentence on each.",
    "Describe the water cycle in a few sentences.",
]

# `clover bench speed --prompt-set code`: ten kinds of coding request that do not quote
# their answer (no signature or docstring to copy), one prompt each; no drafter trains on them
# (self prompts asking one are dropped, the templates hold none of them: tests/test_distill.py)
OPEN_CODE_PROMPTS = [
    "Write a Python class for a bank account with deposit, withdraw and a transaction history.",
    "Write a Python function that checks whether a string is a valid IPv4 address.",
    "Write a JavaScript function that debounces another function, with a short usage example.",
    "Write pytest unit tests for a function slugify(text) that lowercases text and joins its "
    "words with hyphens.",
    "Write a SQL query that finds the three customers with the highest total order value, "
    "given tables customers(id, name) and orders(id, customer_id, amount).",
    "Write a bash script that backs up a directory into a dated tar.gz archive and deletes "
    "archives older than seven days.",
    "Refactor this Python code to be more readable:\n\ndef f(l):\n    r=[]\n    for i in "
    "range(len(l)):\n        if l[i]%2==0 and l[i]>10: r.append(l[i]*2)\n    return r",
    "Write a Python command-line tool with argparse that counts the words, lines and characters "
    "of a file.",
    "Write a TypeScript interface for a blog post and a function that sorts posts by date, "
    "newest first.",
    "Explain what this Python error means and how to fix it: TypeError: 'NoneType' object is "
    "not subscriptable.",
]

# `clover bench load`: the one answer whose peak memory is reported, ours and llama.cpp's
LOAD_PROMPT = "Write a Python function that checks whether a string is a palindrome."

# benchmarks/precision.py: each precision's logits and answers against float32's
PRECISION_PROMPTS = [
    "Explain why the sky is blue in three sentences.",
    "Write a Python function that checks whether a number is prime.",
    "List four countries in South America and their capitals.",
    "What are the benefits of regular exercise?",
]

# benchmarks/serve_load.py: short chat requests, taken in turn by the client threads
SERVE_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give three tips for better sleep.",
    "Explain what a hash table is in two sentences.",
    "Translate 'good morning' into Spanish and French.",
    "What is 12 times 7? Answer briefly.",
    "Name three planets of the solar system.",
    "Why is the sky blue? One sentence.",
]

# benchmarks/soak.py: the user turn of every generated request (drawn with the run's seed)
SOAK_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give three tips for better sleep.",
    "Explain what a hash table is in two sentences.",
    "What is 12 times 7? Answer briefly.",
    "Name three planets of the solar system.",
]

# benchmarks/commit_ab.py: coding prompts, the coder models' own kind of request
COMMIT_AB_PROMPTS = [
    "Write a Python function that merges two sorted lists.",
    "Write a Python class for a stack with push, pop and peek.",
    "Explain what a hash map is in two sentences.",
    "Write a bash one-liner that counts lines in all .py files.",
]

# benchmarks/chat_turns.py: the user's lines of one conversation, turn by turn
CHAT_TURNS = [
    "Hi! I want to learn to bake bread at home. Where should I start?",
    "What is the difference between bread flour and all-purpose flour?",
    "How long should I knead the dough, and how do I know it is ready?",
    "My last loaf was dense. What are the usual reasons?",
    "Can you give me a simple schedule for baking a loaf on a Saturday?",
    "How should I store the bread so it stays fresh?",
    "Thanks! One last question: can I freeze dough?",
]
