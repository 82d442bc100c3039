"""Offline prompt sources for self-distillation, and the held-out split that training never sees.

Three sources, none downloaded: instruction prompts written for this project (data/instructions.txt,
plus templated ones and math word problems with drawn numbers), chat requests about Python's own
standard-library code (explain / document / test this function, summarise this docstring), and raw
code prefixes from the standard library for the target to continue. A prompt is held out when the
hash of its key falls in the held-out bucket: the text for a written or templated instruction, the
source file for anything made from code, so no file feeds both sides, and the template for a word
problem (numbers drawn into a held-out template are never trained on). A few word-problem templates
are held out by name (`HELDOUT_WORD_PROBLEMS`), so the math kind always has held-out prompts.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from specsplit.shared.errors import InvalidRequest
from specsplit.shared.tokenizer import Tokenizer

DATA_DIR = Path(__file__).parent / "data"
INSTRUCTIONS_PATH = DATA_DIR / "instructions.txt"
HELDOUT_PATH = DATA_DIR / "heldout_prompts.jsonl"
HELDOUT_PERCENT = 10  # share of keys held out
KINDS = ("chat", "code", "math")  # math: a word problem, sent through the chat template as chat is
HELDOUT_KEY_PREFIX = "held-out "  # keys held out by name, whatever their hash
SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo",
                "__pycache__", "encodings", "ensurepip", "pydoc_data"}


@dataclass(frozen=True)
class Prompt:
    kind: str  # chat, math: a user message for the chat template | code: raw text for the target to continue
    text: str
    key: str  # what the held-out split hashes

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequest(f"prompt kind must be one of {KINDS}, got {self.kind!r}")
        if not self.text:
            raise InvalidRequest("a prompt needs text")

    def encode(self, tokenizer: Tokenizer) -> list[int]:
        if self.kind != "code":
            return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": self.text}]))
        return tokenizer.encode(self.text)


def is_heldout(key: str) -> bool:
    return key.startswith(HELDOUT_KEY_PREFIX) or int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 100 \
        < HELDOUT_PERCENT


# ---- written and templated instructions ---------------------------------------------------------


def written_instructions() -> list[Prompt]:
    lines = INSTRUCTIONS_PATH.read_text().splitlines()
    texts = [line.replace("\\n", "\n") for line in lines if line.strip() and not line.startswith("#")]
    return [Prompt("chat", t, t) for t in texts]


TOPICS = ("photosynthesis", "gravity", "the French Revolution", "plate tectonics", "the immune system",
          "electric circuits", "the printing press", "climate change", "volcanoes", "the Silk Road",
          "black holes", "the human brain", "the Industrial Revolution", "magnetism", "vaccines",
          "the Cold War", "ocean currents", "the periodic table", "renewable energy", "ancient Egypt",
          "the stock market", "probability", "cryptography", "the water cycle", "sound waves",
          "the Byzantine Empire", "genetics", "compilers", "interest rates", "the Moon landing",
          "inflation", "the Roman Republic", "neural networks", "recursion", "hash tables", "the Renaissance",
          "supply and demand", "evolution", "the theory of relativity", "sleep", "the internet", "rainforests",
          "the Great Depression", "earthquakes", "databases", "the Ottoman Empire", "operating systems",
          "nutrition", "the solar system", "democracy", "bacteria", "sorting algorithms", "game theory",
          "the Scientific Revolution", "linear algebra", "photography", "jazz", "coral reefs", "tides",
          "version control", "public key encryption", "the Mongol Empire", "batteries", "glaciers")
THINGS = ("a lighthouse", "a rainy afternoon", "an old library", "a lost umbrella", "the first snow",
          "a city at night", "a cup of tea", "a mountain lake", "a busy market", "a paper boat",
          "a forgotten garden", "a thunderstorm", "a train station", "a village bakery", "a comet")
ACTIVITIES = ("learn to swim", "write a novel", "grow herbs indoors", "start a podcast", "learn chess",
              "repair a bike chain", "make sourdough bread", "plan a road trip", "paint with watercolors",
              "learn touch typing", "organize a community event", "build a birdhouse", "learn to juggle",
              "prepare for a job interview", "save money on groceries", "train for a 5k run", "learn Spanish",
              "write a cover letter", "set up a home network", "keep a plant alive", "study for an exam",
              "give a good presentation", "start running", "learn to draw", "negotiate a salary",
              "brew better coffee", "write unit tests", "read more books", "cook rice perfectly")
TASKS = ("reverses the words in a sentence", "finds the second largest number in a list",
         "counts the lines in a file", "checks whether brackets in a string are balanced",
         "converts a Roman numeral to an integer", "returns the intersection of two lists",
         "capitalizes the first letter of every word", "computes the greatest common divisor",
         "groups a list of words by their first letter", "parses a query string into a dictionary",
         "rotates a list by k positions", "returns all permutations of a string",
         "computes a running average", "finds the longest word in a sentence",
         "transposes a matrix", "checks whether a year is a leap year",
         "merges two sorted lists", "removes duplicates while keeping order", "flattens a nested list",
         "checks whether a string is a palindrome", "counts word frequencies in a text",
         "implements binary search", "converts Celsius to Fahrenheit", "validates an email address",
         "computes the nth Fibonacci number", "finds all prime numbers below n", "reads a CSV file",
         "chunks a list into pieces of size n", "computes the median of a list", "implements a stack",
         "formats a number with thousands separators", "finds the most common element in a list")
LANGUAGES = ("Python", "JavaScript", "Go", "Rust", "C", "Java")
TEMPLATES = (
    ("Explain {} to a beginner.", TOPICS), ("Give me three surprising facts about {}.", TOPICS),
    ("Write a short quiz about {} with answers.", TOPICS), ("Why does {} matter today?", TOPICS),
    ("Summarize the key ideas of {} in a paragraph.", TOPICS), ("Write a short poem about {}.", THINGS),
    ("Describe {} in three sentences.", THINGS), ("Write a short story that begins with {}.", THINGS),
    ("How do I {}?", ACTIVITIES), ("What do I need to {}? Give me a checklist.", ACTIVITIES),
    ("What are common mistakes when people try to {}?", ACTIVITIES),
    ("Write an outline for an essay about {}.", TOPICS), ("What are the pros and cons of {}?", TOPICS),
    ("Explain {} with an analogy.", TOPICS), ("What questions do experts still debate about {}?", TOPICS),
    ("Write a haiku about {}.", THINGS), ("Write a limerick about {}.", THINGS),
    ("Give me a step-by-step plan to {} in a month.", ACTIVITIES), ("Why is it hard to {}?", ACTIVITIES),
)


def templated_instructions() -> list[Prompt]:
    texts = [template.format(x) for template, subjects in TEMPLATES for x in subjects]
    texts += [f"Write a {lang} function that {task}." for lang in LANGUAGES for task in TASKS]
    texts += [f"Explain how to write a {lang} function that {task}, then show it." for lang in LANGUAGES[:2]
              for task in TASKS]
    texts += [f"Compare {a} and {b}." for a, b in zip(TOPICS, TOPICS[1:] + TOPICS[:1])]
    return [Prompt("chat", t, t) for t in texts]


WORD_PROBLEMS = (
    "{name} has {a} marbles and wins {b} more, then gives away {c}. How many marbles are left?",
    "A box holds {a} pencils. How many pencils are in {b} boxes, and how many boxes are needed for {c} pencils?",
    "A car travels {a} km in {b} hours. What is its average speed, and how far does it go in {c} hours?",
    "{name} earns ${a} per hour and works {b} hours a week. How much is that in {c} weeks?",
    "A garden is {a} m long and {b} m wide. What is its area, and how much fence is needed around it?",
    "A jacket costs ${a} and is discounted by {b}%. What is the new price?",
    "{name} reads {b} pages a day. How many days to finish a {a}-page book?",
    "A tank holds {a} liters and drains {b} liters per minute. How long until it is empty?",
    "{name} buys {b} notebooks at ${c} each and pays with ${a}. How much change is left?",
    "A recipe needs {b} eggs for {c} people. How many eggs for {a} people?",
    "A train leaves at {c}:00 and travels {a} km at {b} km per hour. When does it arrive?",
    "{name} saves ${b} a week. How many weeks until {name} has ${a}?",
    "A rectangle has a perimeter of {a} cm and a width of {b} cm. What is its length and area?",
    "There are {a} students and {b} buses. How many students ride each bus if they are shared evenly?",
    "{name} scored {a}, {b} and {c} points in three games. What is the average score?",
    "A shirt costs ${b}, and a pair of shoes costs {c} times as much. What do {a} shirts and one pair cost?",
    "What is {b}% of {a}, and what is {a} increased by {c}%?",
    "Solve for x: {b}x + {c} = {a}.",
    "A bag has {b} red and {c} blue marbles. What is the probability of drawing a red one?",
    "{name} runs {b} km each day for {c} days, then {a} m more. How far is that in total?",
)
# Held out by name: only ever in the held-out set (their keys carry HELDOUT_KEY_PREFIX).
HELDOUT_WORD_PROBLEMS = (
    "{name} plants {a} seeds in rows of {b}. How many full rows are there, and how many seeds are left over?",
    "A library has {a} books and lends out {c}% of them in a week. How many books are still on the shelves?",
    "A bottle holds {b} cups of juice. {name} pours {c} cups for each of {b} friends. Is there enough? Explain.",
    "A bike shop rents bikes for ${b} an hour plus a ${c} fee. What does {name} pay for {a} minutes?",
    "{name} walks {b} km in {c} minutes. At that pace, how long does a {a} km hike take?",
    "Two numbers add up to {a} and differ by {b}. What are the numbers?",
)
NAMES = ("Ava", "Ben", "Chen", "Dina", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jade", "Kofi", "Lena", "Mateo",
         "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tomas", "Uma", "Vera", "Wei", "Yusuf", "Zoe")


def word_problems(count: int, seed: int, *, heldout_templates: bool = False) -> list[Prompt]:
    """Word problems with drawn numbers (kind math), keyed by their template: the held-out split is by
    template. `heldout_templates` draws from HELDOUT_WORD_PROBLEMS instead."""
    rng = random.Random(seed)
    templates, prefix = ((HELDOUT_WORD_PROBLEMS, HELDOUT_KEY_PREFIX + "word problem") if heldout_templates
                         else (WORD_PROBLEMS, "word problem"))
    problems: dict[str, str] = {}
    for _ in range(count):
        index = rng.randrange(len(templates))
        text = templates[index].format(name=rng.choice(NAMES), a=rng.randint(20, 480), b=rng.randint(2, 40),
                                       c=rng.randint(2, 19))
        problems.setdefault(text + rng.choice(("", " Show your work.", " Explain each step.")), f"{prefix} {index}")
    return [Prompt("math", text, key) for text, key in problems.items()]


# ---- the standard library as a code source ------------------------------------------------------


def stdlib_files() -> list[tuple[str, str]]:
    """(relative path, source) of the standard library's own modules, tests and vendored trees left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIPPED_DIRS & set(rel.parts[:-1]):
            continue
        try:
            files.append((rel.as_posix(), path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    return files


def code_prefixes(files: Sequence[tuple[str, str]], per_file: int, seed: int, *, per_kchars: float = 0.0,
                  min_chars: int = 160, max_chars: int = 560) -> list[Prompt]:
    """Up to `per_file` prefixes per file, plus `per_kchars` per 1000 characters of it: whole lines from a
    random line on, `min_chars..max_chars` long."""
    rng = random.Random(seed)
    out = []
    for rel, source in files:
        lines = source.splitlines(keepends=True)
        for _ in range(per_file + int(len(source) * per_kchars / 1000) if len(lines) > 20 else 0):
            text = _lines_from(lines, rng.randrange(len(lines) - 10), rng.randint(min_chars, max_chars))
            if len(text) >= min_chars // 2 and text.strip():
                out.append(Prompt("code", text, rel))
    return list({p.text: p for p in out}.values())


def _lines_from(lines: Sequence[str], start: int, budget: int) -> str:
    taken: list[str] = []
    for line in lines[start:]:
        if taken and sum(map(len, taken)) + len(line) > budget:
            break
        taken.append(line)
    return "".join(taken)


CODE_REQUESTS = (
    "Explain what this Python function does:\n\n```python\n{}```",
    "Write a docstring for this function:\n\n```python\n{}```",
    "Write pytest unit tests for this function:\n\n```python\n{}```",
    "Suggest improvements to this code:\n\n```python\n{}```",
    "Rewrite this function so it is easier to read:\n\n```python\n{}```",
    "What are the inputs and outputs of this function?\n\n```python\n{}```",
)


def code_requests(files: Sequence[tuple[str, str]], per_file: int, seed: int, max_lines: int = 24) -> list[Prompt]:
    """Chat requests about short functions and module docstrings of the standard library."""
    rng = random.Random(seed)
    out = []
    for rel, source in files:
        functions, doc = _short_functions(source, max_lines)
        for fn in rng.sample(functions, min(per_file, len(functions))):
            out.append(Prompt("chat", rng.choice(CODE_REQUESTS).format(fn), rel))
        if doc and 80 <= len(doc) <= 1200:
            out.append(Prompt("chat", f"Summarize this documentation in two sentences:\n\n{doc}", rel))
    return out


def _short_functions(source: str, max_lines: int) -> tuple[list[str], str | None]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return [], None
    lines = source.splitlines(keepends=True)
    functions = [
        textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno]))
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.end_lineno and 4 <= node.end_lineno - node.lineno + 1 <= max_lines
    ]
    return functions, ast.get_docstring(tree)


# ---- the split ----------------------------------------------------------------------------------


def all_prompts(seed: int = 0, *, code_per_file: int = 12, code_per_kchars: float = 3.0,
                requests_per_file: int = 40, word_problem_count: int = 12000) -> list[Prompt]:
    """Every offline prompt; `seed` draws the code prefixes, requests and word problems, so a later
    session's seed gives different ones."""
    files = stdlib_files()
    return (written_instructions() + templated_instructions() + word_problems(word_problem_count, seed)
            + code_requests(files, requests_per_file, seed)
            + code_prefixes(files, code_per_file, seed, per_kchars=code_per_kchars))


def training_prompts(seed: int = 0, **sizes: int) -> list[Prompt]:
    """Every prompt whose key is outside the held-out bucket, and none of the held-out file's."""
    banned = {p.text for p in read_prompts(HELDOUT_PATH)} if HELDOUT_PATH.is_file() else set()
    return [p for p in all_prompts(seed, **sizes) if not is_heldout(p.key) and p.text not in banned]


def heldout_prompts(*, written: int = 24, templated: int = 8, requests: int = 8, code: int = 24, math: int = 16,
                    seed: int = 0, trained: bool = False) -> list[Prompt]:
    """A deterministic held-out set: by default 40 chat prompts of three sources, 24 code prefixes and 16
    word problems (kind math) from held-out templates. (Before math was a kind, the templated chat
    source drew word problems too, as chat prompts held out by their text; they stay so.)

    `trained`: the same draw from the training side instead (keys outside the held-out bucket, none of the
    held-out file's texts, math from the trained templates): the drafter's tau on prompts like those it
    trained on, beside the held-out tau, says whether a kind is short of data or of the drafter."""
    files = [f for f in stdlib_files() if is_heldout(f[0]) != trained]
    chat_problems = [Prompt("chat", p.text, p.text) for p in word_problems(600, seed)]
    sources = (
        (written_instructions(), written),
        (templated_instructions() + chat_problems, templated),
        (code_requests(files, 1, seed), requests),
        (code_prefixes(files, 1, seed, min_chars=200, max_chars=480), code),
        # Only templates no checkpoint trained on (until math was a kind, word problems were split by text).
        (word_problems(200, seed, heldout_templates=not trained), math),
    )
    banned = {p.text for p in read_prompts(HELDOUT_PATH)} if trained and HELDOUT_PATH.is_file() else set()
    rng = random.Random(seed)
    out: list[Prompt] = []
    for prompts, count in sources:
        held = [p for p in prompts if is_heldout(p.key) != trained and p.text not in banned]
        out += rng.sample(held, min(count, len(held)))
    return out


def write_prompts(path: Path, prompts: Iterable[Prompt]) -> None:
    lines = [json.dumps({"kind": p.kind, "key": p.key, "text": p.text}, ensure_ascii=False) for p in prompts]
    Path(path).write_text("\n".join(lines) + "\n")


def read_prompts(path: Path | str, limit: int | None = None) -> list[Prompt]:
    """A JSONL file of {"kind", "text"[, "key"]} records."""
    path = Path(path)
    if not path.is_file():
        raise InvalidRequest(f"prompts file {path} does not exist")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            prompts.append(Prompt(record["kind"], record["text"], record.get("key", record["text"])))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise InvalidRequest(f"{path}:{number}: not a prompt record ({exc})") from None
    return prompts[:limit] if limit is not None else prompts


def add_kind(path: Path, prompts: Iterable[Prompt]) -> None:
    """Append a new kind's prompts to the held-out file, keeping the prompts already there: the file is
    the held-out set of record (its chat and code prompts were drawn by an earlier version of these
    sources, and every τ reported so far was measured on them)."""
    kept = read_prompts(path)
    new = [p for p in prompts if p.kind not in {k.kind for k in kept}]
    write_prompts(path, kept + new)


if __name__ == "__main__":  # add missing kinds to the held-out file: python -m specsplit.train_data
    add_kind(HELDOUT_PATH, heldout_prompts())
    print(HELDOUT_PATH)
