"""Tool-calling prompts for the prompt set: requests that need a tool, in the chat template's
own tool format (OpenAI-style `tools`, rendered by the model's template: Qwen's `<tools>`
block and `<tool_call>` replies), and second turns where a tool's result has come back and
the assistant answers from it.

Agents send these to a server all day; their replies are short, regular JSON that a drafter
learns quickly, and their second turns quote the result back. Every tool, request and result
is written here from small vocabularies (no external text). A prompt offers the tool it needs
among up to two others, in random order; some offer tools to a request that needs none.
"""

from __future__ import annotations

import json
import random

CITIES = ["Oslo", "Lisbon", "Nairobi", "Osaka", "Denver", "Porto Alegre", "Krakow", "Hobart",
          "Quebec City", "Tallinn", "Cusco", "Muscat", "Busan", "Galway", "Seville"]  # fmt: skip
NAMES = ["Priya", "Jonas", "Amara", "Felix", "Ines", "Haruto", "Zofia", "Mateo", "Leila"]
TABLES = [
    ("users", "id, name, email, created_at", "users signed up"),
    ("orders", "id, customer_id, total, placed_at", "orders were placed"),
    ("tickets", "id, title, status, opened_at", "support tickets were opened"),
    ("payments", "id, order_id, amount, paid_at", "payments came in"),
]  # fmt: skip
MONTHS = ["January", "March", "May", "July", "September", "November"]
FOLDERS = ["src", "docs", "tests", "~/projects/site", "/var/log", "scripts", "notebooks"]
EXTENSIONS = ["py", "md", "json", "log", "yaml", "ts", "csv"]
COMPANIES = [("Alder Robotics", "ALDR"), ("Brightwell Foods", "BRWF"), ("Cobalt Air", "CBLA"),
             ("Dunmore Energy", "DNME"), ("Eastgate Media", "EGMD")]  # fmt: skip
CURRENCIES = ["EUR", "USD", "JPY", "GBP", "CHF", "SEK", "INR", "BRL"]
MEETINGS = ["design review", "team lunch", "budget meeting", "one-to-one", "release planning"]
TASKS = ["call the plumber", "water the plants", "send the invoice", "book the train tickets",
         "stretch", "take the bread out of the oven", "join the stand-up"]  # fmt: skip
FILES = {
    "config/settings.yaml": "port: 8080\ndebug: false\nworkers: 4\nlog_level: info\n",
    "scripts/backup.sh": "#!/bin/sh\ntar czf /backups/site-$(date +%F).tgz /srv/site\n",
    "src/slug.py": "def slug(text):\n    return '-'.join(text.lower().split())\n",
    "package.json": '{"name": "notes-app", "version": "0.3.1", "scripts": {"dev": "vite"}}\n',
}
COMMANDS = [
    ("How much disk space is left on this machine?", "df -h",
     "Filesystem Size Used Avail Use% Mounted on\n/dev/sda1 98G 61G 33G 65% /"),
    ("Which Python version is installed here?", "python3 --version", "Python 3.11.9"),
    ("What branch am I on in this repository?", "git branch --show-current", "feature/search"),
    ("How many lines does main.py have?", "wc -l main.py", "412 main.py"),
    ("Is anything listening on port 5432?", "ss -ltn 'sport = :5432'",
     "State Recv-Q Send-Q Local Address:Port\nLISTEN 0 244 127.0.0.1:5432"),
]  # fmt: skip
NO_TOOL_REQUESTS = [
    "Explain what a function call in a chat API is, in two sentences.",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about debugging late at night.",
    "Give me three tips for naming variables well.",
    "What does HTTP status 404 mean?",
]


def _tool(name: str, description: str, params: dict[str, tuple], required: list[str]) -> dict:
    """An OpenAI-style function tool; params: name -> (JSON type, description[, enum])."""
    props = {}
    for key, (kind, text, *enum) in params.items():
        props[key] = {"type": kind, "description": text, **({"enum": enum[0]} if enum else {})}
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props, "required": required}}}  # fmt: skip


TOOLS = {
    "get_weather": _tool("get_weather", "Current weather for a city.",
                         {"city": ("string", "City name"),
                          "unit": ("string", "Temperature unit", ["celsius", "fahrenheit"])},
                         ["city"]),
    "search_files": _tool("search_files", "Find files whose names match a glob pattern.",
                          {"pattern": ("string", "Glob pattern, e.g. *.txt"),
                           "directory": ("string", "Where to search")}, ["pattern"]),
    "run_sql": _tool("run_sql", "Run a read-only SQL query on the analytics database.",
                     {"query": ("string", "One SQL statement")}, ["query"]),
    "send_email": _tool("send_email", "Send an email.",
                        {"to": ("string", "Recipient address"), "subject": ("string", "Subject"),
                         "body": ("string", "Plain-text body")}, ["to", "subject", "body"]),
    "create_event": _tool("create_event", "Add an event to the user's calendar.",
                          {"title": ("string", "Event title"),
                           "date": ("string", "Date as YYYY-MM-DD"),
                           "start": ("string", "Start time as HH:MM"),
                           "minutes": ("integer", "Length in minutes")},
                          ["title", "date", "start"]),
    "convert_currency": _tool("convert_currency", "Convert an amount between currencies.",
                              {"amount": ("number", "Amount to convert"),
                               "source": ("string", "ISO code of the amount's currency"),
                               "target": ("string", "ISO code to convert to")},
                              ["amount", "source", "target"]),
    "get_stock_price": _tool("get_stock_price", "Latest share price for a ticker symbol.",
                             {"symbol": ("string", "Ticker symbol")}, ["symbol"]),
    "read_file": _tool("read_file", "Read a text file from the user's workspace.",
                       {"path": ("string", "Path relative to the workspace")}, ["path"]),
    "run_command": _tool("run_command", "Run a shell command and return its output.",
                         {"command": ("string", "The command line")}, ["command"]),
    "set_reminder": _tool("set_reminder", "Remind the user of something later.",
                          {"text": ("string", "What to remind of"),
                           "minutes": ("integer", "Minutes from now")}, ["text", "minutes"]),
}  # fmt: skip


def _call(r: random.Random) -> tuple[str, str, dict, object]:
    """A request that needs one tool: (request, tool name, its arguments, its result)."""
    name = r.choice(list(TOOLS))
    if name == "get_weather":
        city = r.choice(CITIES)
        ask = r.choice([f"What's the weather like in {city} right now?",
                        f"Do I need an umbrella in {city} today?",
                        f"How cold is it in {city} at the moment, in fahrenheit?"])  # fmt: skip
        unit = "fahrenheit" if "fahrenheit" in ask else "celsius"
        temp = r.randint(-5, 33)
        sky = r.choice(["clear", "light rain", "overcast", "snow showers", "windy"])
        return (
            ask,
            name,
            {"city": city, "unit": unit},
            {
                "city": city,
                "temperature": (round(temp * 9 / 5 + 32) if unit == "fahrenheit" else temp),
                "sky": sky,
            },
        )
    if name == "search_files":
        ext, folder = r.choice(EXTENSIONS), r.choice(FOLDERS)
        ask = r.choice([f"Find all .{ext} files under {folder}.",
                        f"Which .{ext} files are there in {folder}?"])  # fmt: skip
        found = [f"{folder}/{w}.{ext}" for w in r.sample(["notes", "main", "report", "config",
                                                          "draft", "old", "index"], 3)]  # fmt: skip
        return ask, name, {"pattern": f"*.{ext}", "directory": folder}, {"matches": found}
    if name == "run_sql":
        table, cols, what = r.choice(TABLES)
        month = r.choice(MONTHS)
        ask = f"How many {what} in {month} 2024? The table is {table}({cols})."
        stamp = cols.split(", ")[-1]
        m = MONTHS.index(month) * 2 + 1
        query = (f"SELECT COUNT(*) FROM {table} WHERE {stamp} >= '2024-{m:02d}-01' "
                 f"AND {stamp} < '2024-{m + 1:02d}-01'")  # fmt: skip
        return ask, name, {"query": query}, {"rows": [[r.randint(12, 4800)]]}
    if name == "send_email":
        who, meeting = r.choice(NAMES), r.choice(MEETINGS)
        day = r.choice(["Tuesday", "Thursday", "Friday"])
        address = f"{who.lower()}@example.com"
        ask = f"Email {who} at {address} that the {meeting} moves to {day}."
        args = {"to": address, "subject": f"{meeting.capitalize()} moved to {day}",
                "body": f"Hi {who}, the {meeting} moves to {day}. See you then."}  # fmt: skip
        return ask, name, args, {"status": "sent"}
    if name == "create_event":
        who, meeting = r.choice(NAMES), r.choice(MEETINGS)
        minutes, hour = r.choice([15, 30, 45, 60, 90]), r.randint(8, 17)
        date = f"2025-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"
        ask = (f"Put a {minutes}-minute {meeting} with {who} on my calendar for {date} at "
               f"{hour}:00.")  # fmt: skip
        args = {"title": f"{meeting.capitalize()} with {who}", "date": date,
                "start": f"{hour:02d}:00", "minutes": minutes}  # fmt: skip
        return ask, name, args, {"status": "created", "event_id": f"ev{r.randint(1000, 9999)}"}
    if name == "convert_currency":
        amount, (src, dst) = r.choice([25, 80, 150, 1200, 9.5]), r.sample(CURRENCIES, 2)
        ask = r.choice([f"How much is {amount} {src} in {dst}?",
                        f"Convert {amount} {src} to {dst} for me."])  # fmt: skip
        rate = round(r.uniform(0.2, 4.0), 4)
        return (
            ask,
            name,
            {"amount": amount, "source": src, "target": dst},
            {"amount": round(amount * rate, 2), "currency": dst, "rate": rate},
        )
    if name == "get_stock_price":
        company, symbol = r.choice(COMPANIES)
        ask = r.choice([f"What is {company} trading at?",
                        f"Give me the latest share price of {company} ({symbol})."])  # fmt: skip
        price = round(r.uniform(8, 420), 2)
        return ask, name, {"symbol": symbol}, {"symbol": symbol, "price": price,
                                               "currency": "USD"}  # fmt: skip
    if name == "read_file":
        path = r.choice(list(FILES))
        ask = r.choice([f"What's in {path}? Tell me what it does.",
                        f"Open {path} and summarise it."])  # fmt: skip
        return ask, name, {"path": path}, {"content": FILES[path]}
    if name == "run_command":
        ask, command, output = r.choice(COMMANDS)
        return ask, name, {"command": command}, {"exit_code": 0, "output": output}
    task, minutes = r.choice(TASKS), r.choice([5, 10, 20, 30, 45, 90])
    ask = f"Remind me to {task} in {minutes} minutes."
    return ask, name, {"text": task.capitalize(), "minutes": minutes}, {"status": "scheduled"}


def _offered(r: random.Random, needed: str | None) -> list[dict]:
    """The tools a prompt offers: the needed one (if any) and up to two others, shuffled."""
    others = [n for n in TOOLS if n != needed]
    names = ([needed] if needed else []) + r.sample(others, r.randint(0 if needed else 1, 2))
    r.shuffle(names)
    return [TOOLS[n] for n in names]


def tool_call(r: random.Random) -> tuple[list[dict], list[dict]]:
    """(messages, tools): a request the assistant answers with a tool call (now and then one
    that needs no tool: the assistant answers it directly)."""
    if r.random() < 0.1:
        return [{"role": "user", "content": r.choice(NO_TOOL_REQUESTS)}], _offered(r, None)
    ask, name, _, _ = _call(r)
    return [{"role": "user", "content": ask}], _offered(r, name)


def tool_result(r: random.Random) -> tuple[list[dict], list[dict]]:
    """(messages, tools): the assistant called a tool and its result came back; the
    assistant's next turn answers the user from it."""
    ask, name, args, result = _call(r)
    call = {"type": "function", "function": {"name": name, "arguments": args}}
    return [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "name": name, "content": json.dumps(result)},
    ], _offered(r, name)
