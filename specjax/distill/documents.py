"""Fixed text for teacher-forced distillation (EAGLE-1's recipe): documents on this machine.

The other corpus kind, the target's own answers (``teacher.build_corpus``), costs a
decode step per token; fixed text costs a prefill position per token. On a 2-core CPU,
where batched decoding is compute-bound too, that was only ~1.6x cheaper per token
(``experiments/results/corpus_ablation/``). Everything here is read offline from what
Python and the installed packages ship:

* ``code``: the source files of the standard library and of installed packages;
* ``docstring``: the docstrings of their modules, classes and functions (read with
  ``ast``, nothing is imported);
* ``docs``: the packages' own documentation (``.md``/``.rst``/``.txt`` files beside
  their code) and the long descriptions in their ``METADATA``;
* ``reference``: the Python language reference topics that ``pydoc`` ships.

Each document carries a ``source`` in the prompt set's naming (``stdlib:json``,
``pkg:numpy.linalg``); a document is held out when its module *or any enclosing
package* is held out by ``data.is_heldout``, so no text of a held-out prompt's module
reaches training. Documents are deduplicated (exact, after whitespace normalisation),
and paragraphs already seen elsewhere (licence headers, boilerplate) are dropped.

Every document becomes an assistant turn answering a short request (``request``), so the
drafter reads it in the chat layout that decoding uses.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import hashlib
import os
import random
import re
import sysconfig
from typing import Callable, Iterable, Iterator, Sequence

from specjax.distill.data import is_heldout

KINDS = ("code", "docstring", "docs", "reference")

_DOC_EXTENSIONS = (".md", ".rst", ".txt")
_SKIP_PARTS = ("test", "tests", "testing", "_vendor", "vendored", "__pycache__", "examples",
               "benchmarks", "dist-info", "egg-info")
_SKIP_NAMES = re.compile(r"(licen[cs]e|copying|authors|notice|requirements|"
                         r"entry_points|top_level|record|installer|wheel)", re.I)


@dataclasses.dataclass(frozen=True)
class Document:
  """One piece of fixed text.

  Attributes:
    kind: one of KINDS.
    source: the split key, in ``data.build_prompts``' naming.
    title: what the request names (a module, an object, a page).
    text: the document.
  """

  kind: str
  source: str
  title: str
  text: str


def _module_name(root: str, path: str) -> str:
  rel = os.path.relpath(path, root)[:-len(".py")].replace(os.sep, ".")
  return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _skipped(rel_path: str) -> bool:
  parts = re.split(r"[\\/]", rel_path)
  return any(p.lower() in _SKIP_PARTS or p.startswith(("test_", ".")) for p in parts[:-1]) or \
      parts[-1].startswith(("test_", "conftest"))


def _source_key(stdlib: bool, module: str) -> str:
  return f"{'stdlib' if stdlib else 'pkg'}:{module}"


def heldout(doc: Document, heldout_fraction: float = 0.1) -> bool:
  """Held out when its module or any enclosing package is (``stdlib:a.b.c`` checks
  ``a.b.c``, ``a.b`` and ``a``)."""
  prefix, _, module = doc.source.partition(":")
  parts = module.split(".")
  return any(is_heldout(f"{prefix}:{'.'.join(parts[:i])}", heldout_fraction)
             for i in range(1, len(parts) + 1))


def python_documents(root: str, stdlib: bool, max_file_bytes: int = 200_000
                     ) -> Iterator[Document]:
  """``code`` and ``docstring`` documents of every ``.py`` file under ``root``, tests and
  vendored copies skipped, in sorted path order."""
  skip_dirs = ("site-packages", "dist-packages", "idlelib", "lib2to3", "turtledemo",
               "ensurepip", "config-") if stdlib else ()
  for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
    rel = os.path.relpath(path, root)
    if _skipped(rel) or any(rel.startswith(s) or f"{os.sep}{s}" in rel for s in skip_dirs):
      continue
    try:
      if os.path.getsize(path) > max_file_bytes:
        continue
      with open(path, encoding="utf-8") as f:
        src = f.read()
      tree = ast.parse(src)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
      continue
    module = _module_name(root, path)
    source = _source_key(stdlib, module)
    yield Document("code", source, module, src)
    for node in [tree, *ast.walk(tree)]:
      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node)
        if doc and not (isinstance(node, ast.Module) and node is not tree):
          name = module if isinstance(node, ast.Module) else f"{module}.{node.name}"
          yield Document("docstring", source, name, doc)


def _metadata_description(path: str) -> tuple[str, str]:
  """(distribution name, long description) of a ``METADATA`` file."""
  with open(path, encoding="utf-8", errors="replace") as f:
    text = f.read()
  head, _, body = text.partition("\n\n")
  name = re.search(r"^Name:\s*(\S+)", head, re.M)
  return (name.group(1) if name else os.path.basename(os.path.dirname(path))), body


def package_docs(site: str, max_files_per_package: int = 40) -> Iterator[Document]:
  """``docs`` documents: each distribution's long description and the documentation files
  inside its packages (at most ``max_files_per_package`` each, in sorted order)."""
  for meta in sorted(glob.glob(os.path.join(site, "*.dist-info", "METADATA"))):
    name, body = _metadata_description(meta)
    module = name.lower().replace("-", "_")
    yield Document("docs", _source_key(False, module), f"the {name} package", body)
  per_package: dict[str, int] = {}
  for path in sorted(p for ext in _DOC_EXTENSIONS
                     for p in glob.glob(os.path.join(site, "**", "*" + ext), recursive=True)):
    rel = os.path.relpath(path, site)
    if _skipped(rel) or _SKIP_NAMES.search(os.path.basename(path)) or os.sep not in rel:
      continue
    package = rel.split(os.sep)[0]
    if per_package.get(package, 0) >= max_files_per_package:
      continue
    try:
      with open(path, encoding="utf-8") as f:
        text = f.read()
    except (OSError, UnicodeDecodeError):
      continue
    per_package[package] = per_package.get(package, 0) + 1
    module = ".".join(rel.split(os.sep)[:-1])
    title = os.path.splitext(os.path.basename(path))[0].replace("_", " ")
    yield Document("docs", _source_key(False, module), f"{title} ({package})", text)


def reference_topics() -> Iterator[Document]:
  """``reference`` documents: the language reference topics ``pydoc`` ships."""
  try:
    from pydoc_data.topics import topics
  except ImportError:  # (a Python built without its docs)
    return
  for name in sorted(topics):
    yield Document("reference", f"pydoc:{name}", name, topics[name])


def normalise(text: str) -> str:
  """Trailing spaces removed, runs of blank lines collapsed, tabs expanded."""
  lines = [l.rstrip() for l in text.expandtabs(4).strip().splitlines()]
  return re.sub(r"\n{3,}", "\n\n", "\n".join(lines))


def deduplicate(docs: Iterable[Document], min_chars: int = 200,
                min_paragraph_chars: int = 80) -> Iterator[Document]:
  """Normalised documents, each text once; paragraphs of ``min_paragraph_chars`` or more
  seen before are dropped, and so are documents left shorter than ``min_chars``."""
  seen_docs: set[bytes] = set()
  seen_paras: set[bytes] = set()
  digest = lambda s: hashlib.sha256(s.encode()).digest()[:16]
  for d in docs:
    text = normalise(d.text)
    key = digest(text)
    if key in seen_docs:
      continue
    seen_docs.add(key)
    kept = []
    for para in text.split("\n\n"):
      if len(para) >= min_paragraph_chars:
        pk = digest(re.sub(r"\s+", " ", para))
        if pk in seen_paras:
          continue
        seen_paras.add(pk)
      kept.append(para)
    text = "\n\n".join(kept).strip()
    if len(text) >= min_chars:
      yield dataclasses.replace(d, text=text)


def request(doc: Document) -> str:
  """The user's message that the document answers."""
  if doc.kind == "code":
    return f"Show me the Python source code of the module `{doc.title}`."
  if doc.kind == "docstring":
    return f"Write the docstring of `{doc.title}`."
  if doc.kind == "reference":
    return f"Explain the Python language reference topic '{doc.title}'."
  return f"Write the documentation page about {doc.title}."


def installed_roots() -> tuple[str, list[str]]:
  """(the standard library's directory, the site-packages directories)."""
  paths = sysconfig.get_paths()
  sites = sorted({paths["purelib"], paths["platlib"]})
  return paths["stdlib"], sites


def top_package(doc: Document) -> str:
  """``stdlib:json.decoder`` -> ``stdlib:json``."""
  return doc.source.split(".")[0]


def collect(seed: int = 0, kinds: Sequence[str] = KINDS,
            roots: tuple[str, Sequence[str]] | None = None,
            max_per_package: int = 300) -> list[Document]:
  """The deduplicated documents of ``kinds`` on this machine, at most ``max_per_package``
  of each kind per top-level package (so a few large packages do not fill the corpus),
  shuffled by ``seed`` and interleaved by kind (any prefix keeps the kinds' mix)."""
  unknown = set(kinds) - set(KINDS)
  if unknown:
    raise ValueError(f"unknown document kinds {sorted(unknown)}; expected some of {KINDS}")
  stdlib, sites = roots or installed_roots()

  def everything() -> Iterator[Document]:
    yield from reference_topics()
    yield from python_documents(stdlib, stdlib=True)
    for site in sites:
      yield from package_docs(site)
      yield from python_documents(site, stdlib=False)

  by_kind: dict[str, list[Document]] = {k: [] for k in kinds}
  for d in deduplicate(everything()):
    if d.kind in by_kind:
      by_kind[d.kind].append(d)
  rng = random.Random(seed)
  for kind, docs in by_kind.items():
    rng.shuffle(docs)
    per: dict[str, int] = {}
    kept = []
    for d in docs:
      per[top_package(d)] = per.get(top_package(d), 0) + 1
      if per[top_package(d)] <= max_per_package:
        kept.append(d)
    by_kind[kind] = kept
  out = []
  for i in range(max(map(len, by_kind.values()), default=0)):
    out += [docs[i] for docs in by_kind.values() if i < len(docs)]
  return out


def split(docs: Sequence[Document], heldout_fraction: float = 0.1
          ) -> tuple[list[Document], list[Document]]:
  """(train, held-out) by ``heldout``."""
  held = [heldout(d, heldout_fraction) for d in docs]
  return [d for d, h in zip(docs, held) if not h], [d for d, h in zip(docs, held) if h]


def chunk(ids: Sequence[int], max_tokens: int, max_chunks: int) -> list[list[int]]:
  """The first ``max_chunks`` consecutive pieces of ``max_tokens`` ids (a last piece of
  fewer than a quarter of ``max_tokens`` is dropped unless it is the only one)."""
  pieces = [list(ids[i:i + max_tokens]) for i in range(0, len(ids), max_tokens)][:max_chunks]
  if len(pieces) > 1 and len(pieces[-1]) < max_tokens // 4:
    pieces.pop()
  return pieces


def text_records(docs: Iterable[Document], encode_request: Callable[[str], list[int]],
                 encode_text: Callable[[str], list[int]], end_id: int, max_new_tokens: int,
                 max_prompt_tokens: int, max_tokens: int, max_chunks: int = 4
                 ) -> Iterator[tuple[list[int], list[int], dict]]:
  """(prompt ids, response ids, meta) of each document chunk, in order, until the responses
  hold ``max_tokens`` ids.

  The prompt is the chat-formatted ``request`` (documents whose request is longer than
  ``max_prompt_tokens`` are skipped); the response is a chunk of at most ``max_new_tokens``
  ids, a document's last chunk ending in ``end_id`` (the end of the assistant's turn) when
  it fits. Later chunks of a document answer the same request.
  """
  total = 0
  for d in docs:
    prompt = encode_request(request(d))
    if len(prompt) > max_prompt_tokens:
      continue
    ids = list(encode_text(d.text)) + [end_id]
    pieces = chunk(ids, max_new_tokens, max_chunks)
    for i, piece in enumerate(pieces):
      if total >= max_tokens:
        return
      total += len(piece)
      yield prompt, piece, dict(category=d.kind, source=d.source, title=d.title, chunk=i)


def describe(docs: Sequence[Document]) -> str:
  counts = {k: sum(d.kind == k for d in docs) for k in KINDS}
  chars = sum(len(d.text) for d in docs)
  return ", ".join(f"{k} {n}" for k, n in counts.items()) + \
      f" ({len(docs)} documents, {chars / 1e6:.1f}M chars, {len({d.source for d in docs})} sources)"


__all__ = ["Document", "KINDS", "chunk", "collect", "deduplicate", "describe", "heldout",
           "installed_roots", "normalise", "package_docs", "python_documents",
           "reference_topics", "request", "split", "text_records", "top_package"]
