"""Offline prompt sets for self-distillation: code, summarise/rewrite, QA, math, chat.

Everything is built from material on this machine: docstrings and source of
the Python standard library (via ``inspect``) and templated tasks. Every prompt
carries a ``source`` (a stdlib module, a math template, a chat topic) and the
train / held-out split is made by source, so no passage, template or topic of
the held-out set is seen in training.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
import os
import random
import subprocess
import sys
from typing import Callable, Iterator, Sequence

CATEGORIES = ("code", "summarise", "qa", "math", "chat")

STDLIB_MODULES = (
    "argparse", "base64", "bisect", "calendar", "cmd", "codecs", "colorsys", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "enum",
    "filecmp", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob",
    "gzip", "heapq", "hmac", "html", "http.client", "imaplib", "inspect", "ipaddress", "json",
    "logging", "mailbox", "mimetypes", "numbers", "operator", "optparse", "os", "pathlib",
    "pickle", "pkgutil", "platform", "plistlib", "pprint", "queue", "quopri", "random", "re",
    "secrets", "selectors", "shlex", "shutil", "smtplib", "socketserver", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize",
    "trace", "traceback", "types", "typing", "urllib.parse", "uuid", "warnings", "wave",
    "weakref", "zipfile", "zipapp", "abc", "ast", "asyncio.queues", "collections", "email.utils",
    "graphlib", "locale", "netrc", "poplib", "sched", "stat", "tabnanny",
)

CHAT_TOPICS = (
    "gardening", "learning a new language", "saving money", "running a marathon", "baking bread",
    "time management", "public speaking", "photography", "climate change", "the solar system",
    "healthy breakfast ideas", "remote work", "job interviews", "chess", "camping", "meditation",
    "writing a novel", "learning to code", "volcanoes", "the ocean", "recycling", "video games",
    "team sports", "birdwatching", "the history of the internet", "electric cars", "coffee",
    "friendship", "moving to a new city", "studying for exams", "playing the guitar", "dogs",
    "cats", "travelling on a budget", "renewable energy", "the moon", "honey bees", "rainforests",
    "sleep", "drinking enough water", "board games", "museums", "smartphones", "libraries",
    "volunteering", "first aid", "bicycles", "mountains", "deserts", "cooking pasta",
    "the Roman Empire", "dinosaurs", "artificial intelligence", "robots", "the weather",
    "starting a small business", "painting", "yoga", "trains", "the human heart",
)

CHAT_TEMPLATES = (
    "Give me three tips about {t}.", "Write a short poem about {t}.",
    "What are the pros and cons of {t}?", "Explain {t} to a ten-year-old.",
    "Tell me an interesting fact about {t}.", "Write a short story that involves {t}.",
    "I want to get started with {t}. Where should I begin?", "Why do people care about {t}?",
)

# The extended prompt set (``build_prompts(extended=True)``): docstrings of common
# scientific packages (skipped where not installed), many more chat topics and
# request styles, and questions the target writes itself (``self_instruct_requests``).
EXTRA_MODULES = (
    "numpy", "numpy.linalg", "numpy.random", "numpy.fft", "numpy.ma", "numpy.polynomial",
    "scipy.stats", "scipy.optimize", "scipy.signal", "scipy.linalg", "scipy.integrate",
    "scipy.interpolate", "scipy.sparse", "scipy.spatial", "pandas", "networkx", "sympy",
    "sklearn.linear_model", "sklearn.cluster", "sklearn.metrics", "sklearn.preprocessing",
    "sklearn.model_selection", "sklearn.decomposition", "sklearn.ensemble", "jax.numpy",
    "jax.lax", "jax.random", "jax.nn", "optax", "flax.linen", "matplotlib.pyplot", "PIL.Image",
    "requests", "yaml", "tqdm", "absl.flags", "click", "jinja2", "markdown",
)

EXTRA_CHAT_TOPICS = (
    "writing a cover letter", "negotiating a salary", "learning to swim", "planting tomatoes",
    "making sourdough", "vegetarian dinners", "budgeting for a wedding", "buying a used car",
    "training a puppy", "keeping houseplants alive", "learning calculus", "the French Revolution",
    "ancient Egypt", "the Renaissance", "World War I", "the Industrial Revolution",
    "black holes", "photosynthesis", "DNA", "vaccines", "the immune system", "earthquakes",
    "hurricanes", "plate tectonics", "the water cycle", "evolution", "quantum computing",
    "blockchain", "cloud computing", "cybersecurity", "passwords", "spreadsheets",
    "writing clean code", "debugging", "databases", "web development", "machine learning",
    "statistics", "probability", "personal finance", "investing for beginners", "taxes",
    "retirement savings", "credit scores", "renting an apartment", "home repairs",
    "decluttering", "minimalism", "journaling", "mindfulness", "stress at work",
    "procrastination", "motivation", "habits", "productivity apps", "email etiquette",
    "giving feedback", "leading a team", "conflict resolution", "networking events",
    "starting a podcast", "writing a blog", "social media", "digital privacy",
    "online shopping", "customer service", "marketing a product", "pricing a service",
    "writing a business plan", "the stock market", "inflation", "supply and demand",
    "climate policy", "solar panels", "wind turbines", "electric bikes", "public transport",
    "city planning", "architecture", "interior design", "fashion", "knitting", "woodworking",
    "pottery", "origami", "calligraphy", "jazz", "classical music", "learning the piano",
    "singing", "film making", "animation", "comic books", "poetry", "Shakespeare",
    "mythology", "philosophy", "ethics", "logic puzzles", "riddles", "trivia", "astronomy",
    "the planets", "space exploration", "Mars", "satellites", "airplanes", "submarines",
    "the Olympics", "football", "basketball", "tennis", "cycling", "hiking", "rock climbing",
    "skiing", "surfing", "fishing", "nutrition", "protein", "vitamins", "allergies",
    "the common cold", "headaches", "exercise for beginners", "stretching", "posture",
    "parenting toddlers", "teenagers", "grandparents", "weddings", "birthdays", "holidays",
    "gift ideas", "thank-you notes", "apologies", "making friends as an adult", "loneliness",
    "pets", "horses", "wolves", "elephants", "octopuses", "sharks", "butterflies", "trees",
    "mushrooms", "soil", "composting", "water conservation", "plastic pollution",
    "the Amazon river", "Japan", "Italy", "Brazil", "Kenya", "Canada", "India", "Australia",
    "learning Spanish", "learning Japanese", "grammar", "punctuation", "essay writing",
    "research papers", "citing sources", "critical thinking", "debate", "chess openings",
    "card games", "puzzles", "escape rooms", "camping gear", "packing for a trip",
    "jet lag", "airports", "road trips", "street food", "spices", "baking cookies",
    "making soup", "knife skills", "food safety", "fermentation", "tea", "chocolate",
)

EXTRA_CHAT_TEMPLATES = (
    "How do I get better at {t}?", "What is the difference between a beginner and an expert "
    "in {t}?", "Can you make a one-week plan for {t}?", "List five common mistakes people "
    "make with {t}.", "Write a friendly email to a colleague about {t}.",
    "Summarize the basics of {t} in a short paragraph.", "What questions should I ask an "
    "expert about {t}?", "Give me a step-by-step guide to {t}.", "What are some myths about "
    "{t}?", "Write a tweet about {t}.", "Compare two different approaches to {t}.",
    "What books or resources would you recommend for {t}?", "Describe {t} in three sentences.",
    "What is the history of {t}?", "Write a short dialogue between two friends about {t}.",
    "How would you explain {t} to someone from 100 years ago?",
    "What are the most important terms to know about {t}? Define each briefly.",
    "I have ten minutes. Teach me something about {t}.", "Write a haiku about {t}.",
    "Make a quiz with three questions about {t}, with answers.",
    "What are the risks of {t} and how can I avoid them?", "Give me a fun fact and a "
    "practical tip about {t}.", "Write a product description for something related to {t}.",
    "How has {t} changed in the last twenty years?",
)

SELF_INSTRUCT_STYLES = (
    "a question a beginner might ask", "a request for practical advice",
    "a request to write something short (an email, a poem, a list)",
    "a question that asks for an explanation", "a question comparing two things",
    "a request for a plan or a schedule", "a tricky question", "a question a student might ask",
)

_NAMES = ("Tom", "Anna", "Liam", "Maya", "Sara", "Omar", "Ken", "Lucy", "Ravi", "Eva")
_ITEMS = ("apples", "books", "marbles", "stickers", "pencils", "cookies", "coins", "cards")
MATH_TEMPLATES = (
    "{n} has {a} {i} and buys {b} more. How many {i} does {n} have now?",
    "{n} had {a} {i} and gave {b} of them to a friend. How many {i} are left?",
    "A box holds {a} {i}. How many {i} are in {b} boxes?",
    "{n} shares {c} {i} equally among {b} friends. How many {i} does each friend get?",
    "A train travels at {a} km per hour for {b} hours. How far does it go?",
    "A shirt costs ${a}. It is on sale for {p}% off. What is the sale price?",
    "{n} reads {a} pages a day. How many pages does {n} read in {b} days?",
    "What is {a} + {b} * {d}? Show your steps.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "{n} saves ${a} every week. How many weeks until {n} has ${c}?",
    "The temperature was {a} degrees and dropped by {b} degrees. What is it now?",
    "A class has {a} students; {p}% of them walk to school. How many walk?",
)


@dataclasses.dataclass(frozen=True)
class Prompt:
  """One user message.

  Attributes:
    category: one of CATEGORIES.
    source: the split key (``stdlib:json``, ``math:3``, ``chat:gardening``).
    text: the user message (wrapped in the chat template by the caller).
  """

  category: str
  source: str
  text: str


def _first_paragraphs(doc: str, max_chars: int) -> str:
  out = ""
  for para in doc.strip().split("\n\n"):
    if len(out) + len(para) > max_chars and out:
      break
    out = f"{out}\n\n{para}" if out else para
  return out[:max_chars].strip()


def stdlib_items(modules: Sequence[str] = STDLIB_MODULES) -> list[tuple[str, str, str, str]]:
  """(module, qualified name, docstring, source) of the public functions and classes that
  ``modules`` define (``_own_items``), read in a fresh interpreter: ``python -P`` running this
  file (-P, Python >= 3.11 as jax needs: not the script's directory on ``sys.path``), which
  imports nothing but ``modules`` and the standard library (the caller's ``sys.path``
  otherwise, so the same packages are found).

  Read in the caller's process, the list would depend on what that process imported first:
  a library may replace a module's function with its own (importing torch replaces
  ``inspect.getfile``), which then no longer counts as the module's, and every prompt drawn
  after it, and so the held-out set, would come out different.
  """
  proc = subprocess.run([sys.executable, "-P", os.path.abspath(__file__), *modules],
                        capture_output=True, text=True, check=False)
  if proc.returncode != 0:
    raise RuntimeError(f"reading the prompts' source modules failed:\n{proc.stderr[-2000:]}")
  return [tuple(item) for item in json.loads(proc.stdout)]


def _own_items(modules: Sequence[str]) -> Iterator[tuple[str, str, str, str]]:
  """``stdlib_items``' work, in the interpreter that runs it; a module that does not import
  (an optional one) is skipped."""
  for mod_name in modules:
    try:
      mod = importlib.import_module(mod_name)
    except Exception:  # pylint: disable=broad-except  # missing optional modules
      continue
    if inspect.getdoc(mod):
      yield mod_name, mod_name, inspect.getdoc(mod), ""
    for name, obj in sorted(vars(mod).items()):
      if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
        continue
      if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        continue
      doc = inspect.getdoc(obj) or ""
      try:
        src = inspect.getsource(obj)
      except (OSError, TypeError):
        src = ""
      yield mod_name, f"{mod_name}.{name}", doc, src


def _code_prompts(rng: random.Random, name: str, doc: str, src: str) -> list[str]:
  out = []
  lines = src.splitlines()
  if 4 <= len(lines) <= 24:
    snippet = "\n".join(lines)
    out.append(f"Explain what the following Python code does:\n\n```python\n{snippet}\n```")
    cut = max(2, len(lines) // 2)
    out.append("Complete the following Python code:\n\n```python\n"
               + "\n".join(lines[:cut]) + "\n```")
  if doc:
    first = doc.strip().split("\n")[0].rstrip(".")
    if 10 < len(first) < 160:
      out.append(f"Write a Python function `{name.split('.')[-1]}` that does the following: "
                 f"{first}.")
  rng.shuffle(out)
  return out[:2]


def _passage_prompts(rng: random.Random, name: str, doc: str) -> tuple[list[str], list[str]]:
  passage = _first_paragraphs(doc, 450)
  if len(passage) < 80:
    return [], []
  short = name.split(".")[-1]
  summ = [f"Summarize the following text in one or two sentences:\n\n{passage}",
          f"Rewrite the following passage in plain, simple English:\n\n{passage}",
          f"Give a title and three bullet points for this text:\n\n{passage}"]
  qa = [f"Read the passage and answer the question.\n\nPassage: {passage}\n\n"
        f"Question: What is `{short}` used for?",
        f"{passage}\n\nBased on the text above, when would a programmer use `{short}`?",
        f"Passage:\n{passage}\n\nQuestion: What is the most important detail in this passage?"]
  return [rng.choice(summ)], [rng.choice(qa)]


def _math_prompt(rng: random.Random, template_id: int) -> str:
  a, b, d = rng.randint(2, 60), rng.randint(2, 12), rng.randint(2, 9)
  return MATH_TEMPLATES[template_id].format(
      n=rng.choice(_NAMES), i=rng.choice(_ITEMS), a=a, b=b, c=a * b, d=d,
      p=rng.choice((10, 20, 25, 40, 50)))


def build_prompts(seed: int = 0, max_stdlib_items: int = 4000, math_per_template: int = 40,
                  chat_per_topic: int = 4, extended: bool = False) -> list[Prompt]:
  """All prompts of every category, deterministically shuffled by ``seed``.

  ``extended`` adds the docstrings of ``EXTRA_MODULES`` (source ``pkg:<module>``),
  ``EXTRA_CHAT_TOPICS`` and ``EXTRA_CHAT_TEMPLATES``, with 12 requests per chat topic
  and 120 math problems per template.
  """
  rng = random.Random(seed)
  prompts: list[Prompt] = []
  items = stdlib_items()[:max_stdlib_items]
  if extended:
    items += stdlib_items(EXTRA_MODULES)[:3 * max_stdlib_items]
    math_per_template, chat_per_topic = max(math_per_template, 120), max(chat_per_topic, 12)
  for mod, name, doc, src in items:
    source = f"stdlib:{mod}" if mod in STDLIB_MODULES else f"pkg:{mod}"
    prompts += [Prompt("code", source, t) for t in _code_prompts(rng, name, doc, src)]
    summ, qa = _passage_prompts(rng, name, doc)
    prompts += [Prompt("summarise", source, t) for t in summ]
    prompts += [Prompt("qa", source, t) for t in qa]
  for tid in range(len(MATH_TEMPLATES)):
    prompts += [Prompt("math", f"math:{tid}", _math_prompt(rng, tid))
                for _ in range(math_per_template)]
  topics, templates = CHAT_TOPICS, CHAT_TEMPLATES
  if extended:
    topics, templates = topics + EXTRA_CHAT_TOPICS, templates + EXTRA_CHAT_TEMPLATES
  for topic in topics:
    chosen = rng.sample(templates, min(chat_per_topic, len(templates)))
    prompts += [Prompt("chat", f"chat:{topic}", t.format(t=topic)) for t in chosen]
  rng.shuffle(prompts)
  return prompts


def self_instruct_requests(seed: int, per_topic: int) -> list[Prompt]:
  """Requests to the target to write a user's message ("Write {style} about {topic}").

  The target's answers, cleaned by ``clean_question``, become chat prompts with the
  same ``chat:<topic>`` source, so the held-out split still holds by topic.
  """
  rng = random.Random(seed + 7919)
  out = []
  for topic in CHAT_TOPICS + EXTRA_CHAT_TOPICS:
    for style in rng.sample(SELF_INSTRUCT_STYLES, min(per_topic, len(SELF_INSTRUCT_STYLES))):
      out.append(Prompt("chat", f"chat:{topic}",
                        f"Write {style} about {topic}, as a user would type it to an AI "
                        "assistant. Reply with the user's message only."))
  return out


def clean_question(text: str) -> str | None:
  """The first line of a generated user message, unquoted; None if unusable (fewer than
  four words, or too short or long)."""
  line = text.strip().split("\n")[0].strip().strip('"').strip()
  for prefix in ("User:", "Question:", "Q:", "Message:"):
    if line.lower().startswith(prefix.lower()):
      line = line[len(prefix):].strip().strip('"').strip()
  return line if 12 <= len(line) <= 400 and len(line.split()) >= 4 else None


def is_heldout(source: str, heldout_fraction: float = 0.1) -> bool:
  """Stable split by source: sha256 of the source name, not Python's salted hash."""
  h = int.from_bytes(hashlib.sha256(source.encode()).digest()[:8], "little")
  return (h % 10_000) < heldout_fraction * 10_000


def split_by_source(prompts: Sequence[Prompt], heldout_fraction: float = 0.1
                    ) -> tuple[list[Prompt], list[Prompt]]:
  """(train, held-out); every source lands wholly on one side."""
  train = [p for p in prompts if not is_heldout(p.source, heldout_fraction)]
  held = [p for p in prompts if is_heldout(p.source, heldout_fraction)]
  return train, held


def interleave_categories(prompts: Sequence[Prompt]) -> list[Prompt]:
  """Round-robin over categories, so any prefix of the list is balanced."""
  by_cat = {c: [p for p in prompts if p.category == c] for c in CATEGORIES}
  out = []
  for i in range(max(map(len, by_cat.values()), default=0)):
    out += [by_cat[c][i] for c in CATEGORIES if i < len(by_cat[c])]
  return out


def chat_encoder(tok) -> Callable[[str], list[int]]:
  """text -> the chat-formatted user message's ids, memoised: passes over the same
  prompts tokenize each once."""
  from specjax.loaders import chat_prompt
  return functools.lru_cache(maxsize=None)(lambda text: chat_prompt(tok, text))


def prompt_batches(encode: Callable[[str], list[int]], prompts: Sequence[Prompt], batch: int,
                   max_tokens: int,
                   drop_last: bool = True) -> list[tuple[list[list[int]], list[dict]]]:
  """Prompts encoded by ``encode`` (``chat_encoder``) in batches of similar length (less
  padding in prefill); the last short batch of each sorting group is dropped unless
  ``drop_last`` is False.

  Returns [(token ids of each prompt, [{category, source}] of each)] per batch.
  """
  items = []
  for p in prompts:
    ids = encode(p.text)
    if len(ids) <= max_tokens:
      items.append((ids, dict(category=p.category, source=p.source)))
  out = []
  group = 8 * batch  # sort within groups: lengths even out, category mix is kept
  for g in range(0, len(items), group):
    chunk = sorted(items[g:g + group], key=lambda x: len(x[0]))
    for b in range(0, len(chunk) - (batch - 1 if drop_last else 0), batch):
      sel = chunk[b:b + batch]
      out.append(([s[0] for s in sel], [s[1] for s in sel]))
  return out


def describe(prompts: Sequence[Prompt]) -> str:
  counts = {c: sum(p.category == c for p in prompts) for c in CATEGORIES}
  return ", ".join(f"{c} {n}" for c, n in counts.items()) + f" ({len(prompts)} total, " \
      f"{len({p.source for p in prompts})} sources)"


__all__ = ["CATEGORIES", "Prompt", "build_prompts", "chat_encoder", "clean_question", "describe",
           "interleave_categories", "is_heldout", "prompt_batches", "self_instruct_requests",
           "split_by_source", "stdlib_items"]


if __name__ == "__main__":  # stdlib_items' fresh interpreter: the modules' items as JSON
  _out, sys.stdout = sys.stdout, sys.stderr  # what a module prints on import stays off the JSON
  json.dump(list(_own_items(sys.argv[1:])), _out)
