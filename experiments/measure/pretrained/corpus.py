"""A deterministic English corpus every machine has without a download: the docstrings of a fixed
list of Python standard-library modules, split into sentences and packed into texts of ``N`` tokens.

The recipe (``RECIPE``, stored in every record with the corpus's SHA-256):

1. For each module of :data:`MODULES`, in that order, parsed from its source (not executed):
   the module's docstring, then the docstrings of its public top-level classes and functions and of
   the classes' public methods, sorted by qualified name, each cleaned as :func:`inspect.cleandoc`
   does.
2. Each docstring is cut into paragraphs at blank lines; a paragraph with an indented line, a
   ``>>>`` prompt or reStructuredText markup (``::``, ``:param``) is code or markup and is dropped;
   the lines of the rest are joined with spaces.
3. Paragraphs are split into sentences after ``.``, ``!`` or ``?`` followed by a space and a capital
   letter. A sentence is kept if it has 6 to 40 words, at least 80% of its characters are letters or
   spaces, and it ends with ``.``; exact repeats are dropped (the first one stays).

The sentences depend on the Python version (docstrings change between releases): the hash says
which corpus a record saw, and records from two Pythons are comparable only when the hashes match.

Texts of ``N`` tokens (:func:`pack_texts`): the sentences are tokenized in order (no special
tokens, at most 48 word pieces each) and packed greedily, whole sentences first, into
``N - 2`` pieces; the sentence that does not fit is cut to fill the text exactly and the next text
starts with the next sentence. Every text is ``[CLS] pieces [SEP]``, exactly ``N`` tokens with no
padding. Its query (the retrieval task) is the whole sentence of the text whose middle is closest to
the text's middle, as ``[CLS] sentence [SEP]``. Time ``O(corpus)``.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

#: modules whose docstrings make the corpus: pure-Python, prose-rich, present on every platform and in
#: every Python from 3.10 on (none of them is deprecated for removal)
MODULES = (
    "argparse",
    "asyncio.events",
    "asyncio.streams",
    "asyncio.tasks",
    "calendar",
    "collections",
    "concurrent.futures._base",
    "configparser",
    "contextlib",
    "csv",
    "dataclasses",
    "difflib",
    "email.message",
    "email.utils",
    "enum",
    "fractions",
    "ftplib",
    "functools",
    "gettext",
    "gzip",
    "heapq",
    "http.client",
    "http.cookiejar",
    "imaplib",
    "inspect",
    "ipaddress",
    "json",
    "logging",
    "mailbox",
    "multiprocessing.pool",
    "optparse",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "sched",
    "shutil",
    "smtplib",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "tokenize",
    "traceback",
    "typing",
    "unittest.case",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "zipfile",
)
RECIPE = (
    "attnbench stdlib-docstrings v1: docstrings parsed from the source of "
    "experiments.measure.pretrained.corpus.MODULES (module, then public top-level classes, functions "
    "and methods by qualified name), prose paragraphs, "
    "sentences of 6-40 words ending in '.', >= 80% letters, deduplicated; packed greedily into "
    "[CLS] + N-2 word pieces + [SEP], the overflowing sentence cut; query = the whole sentence nearest "
    "the text's middle"
)
MIN_WORDS, MAX_WORDS = 6, 40
MAX_PIECES = 48  # word pieces per sentence (longer ones are cut): every text of N >= 64 holds one whole
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_MARKUP = re.compile(r">>>|::|:param|:return|:raises|^\s*[-*+] |\|", re.MULTILINE)


def _docstrings(module_name: str) -> list[str]:
    """The cleaned docstrings of a module and its public classes, functions and methods, in the
    recipe's order, parsed from the module's source (the module is not executed: what other imports
    patch at run time cannot change the corpus)."""
    spec = importlib.util.find_spec(module_name)  # imports the parent package, never the module itself
    source = spec.loader.get_source(module_name) if spec is not None and spec.loader is not None else None
    if source is None:  # e.g. a Python installed without its .py sources
        raise ImportError(f"the corpus needs the source of the standard-library module {module_name}")
    tree = ast.parse(source)
    found: dict[str, str] = {}
    defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if not isinstance(node, defs) or node.name.startswith("_"):
            continue
        found[node.name] = ast.get_docstring(node) or ""
        if isinstance(node, ast.ClassDef):
            for meth in node.body:
                if isinstance(meth, defs[1:]) and not meth.name.startswith("_"):
                    found[f"{node.name}.{meth.name}"] = ast.get_docstring(meth) or ""
    docs = [ast.get_docstring(tree) or "", *(found[k] for k in sorted(found))]
    return [d for d in docs if d]


def _prose_sentences(doc: str) -> list[str]:
    """The sentences of ``doc``'s prose paragraphs that pass the recipe's filter."""
    out = []
    for para in re.split(r"\n\s*\n", doc):
        lines = para.splitlines()
        if not lines or any(line[:1].isspace() for line in lines) or _MARKUP.search(para):
            continue
        for sentence in _SENTENCE_END.split(" ".join(line.strip() for line in lines)):
            words = sentence.split()
            letters = sum(c.isalpha() or c == " " for c in sentence)
            if (
                MIN_WORDS <= len(words) <= MAX_WORDS
                and sentence.endswith(".")
                and letters >= 0.8 * len(sentence)
            ):
                out.append(sentence)
    return out


@cache
def sentences() -> tuple[str, ...]:
    """Every corpus sentence, in order, without repeats (the recipe's steps 1-3). ``O(corpus)``."""
    seen: dict[str, None] = {}
    for module_name in MODULES:
        for doc in _docstrings(module_name):
            for s in _prose_sentences(doc):
                seen.setdefault(s, None)
    return tuple(seen)


def corpus_hash(sents: Sequence[str] | None = None) -> str:
    """SHA-256 (hex) of the recipe and the sentences: equal hashes, equal corpus."""
    blob = json.dumps([RECIPE, list(sentences() if sents is None else sents)])
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class Texts:
    """Texts of exactly ``n`` tokens and one query sentence per text (token ids, special tokens
    included): ``texts[i]`` has ``n`` ids, ``queries[i]`` is a whole sentence of ``texts[i]``."""

    n: int
    texts: list[list[int]]
    queries: list[list[int]]

    def digest(self) -> str:
        """SHA-256 (hex) of the token ids: what the model was fed."""
        return hashlib.sha256(json.dumps([self.n, self.texts, self.queries]).encode()).hexdigest()


def pack_texts(
    pieces: Sequence[Sequence[int]], n: int, cls_id: int, sep_id: int, count: int | None = None
) -> Texts:
    """Pack tokenized sentences ``pieces`` into texts of ``n`` tokens (the module doc's recipe).

    ``count`` keeps that many texts spread evenly over the corpus (every ``k``-th, deterministic);
    None keeps every whole text. Raises ``ValueError`` when ``n < 3`` or no whole text can be made.
    """
    if n < 3:
        raise ValueError(f"texts need N >= 3 tokens ([CLS], [SEP] and one more), got N={n}")
    room = n - 2
    texts: list[list[int]] = []
    queries: list[list[int]] = []
    body: list[int] = []
    spans: list[tuple[int, int]] = []  # whole sentences in ``body``: (start, end)
    for sent in pieces:
        sent = list(sent[:MAX_PIECES])
        if not sent:
            continue
        if len(body) + len(sent) <= room:
            spans.append((len(body), len(body) + len(sent)))
            body += sent
            if len(body) < room:
                continue
        else:
            body += sent[: room - len(body)]  # cut the sentence that overflows; the next text starts anew
        if spans:  # a text with no whole sentence (one longer than N - 2 pieces) has no query: skipped
            middle = room / 2
            start, end = min(spans, key=lambda se: (abs((se[0] + se[1]) / 2 - middle), se[0]))
            texts.append([cls_id, *body, sep_id])
            queries.append([cls_id, *body[start:end], sep_id])
        body, spans = [], []
    if not texts:
        raise ValueError(f"the corpus holds no whole text of N={n} tokens")
    if count is not None and count < len(texts):
        keep = [round(i * len(texts) / count) for i in range(count)]  # evenly spread, first text included
        texts, queries = [texts[i] for i in keep], [queries[i] for i in keep]
    return Texts(n, texts, queries)


def tokenized_sentences(encode: Callable[[str], list[int]]) -> list[list[int]]:
    """The corpus sentences as word-piece ids (no special tokens) by ``encode``."""
    return [encode(s) for s in sentences()]
