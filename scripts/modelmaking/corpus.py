"""The training corpus: Python standard-library sources of the running interpreter (plus, for the
default models, the pinned PyPI source distributions of `modelmaking.packages`).

The corpus exists on every machine that runs Python, so models can be rebuilt anywhere without a
model hub or a dataset download. Files are read in sorted relative-path order; a fixed ~5% of them
(chosen by a hash of the relative path, so the split does not depend on which other files exist) is
held out for evaluation. Besides raw source files, training documents include chat-formatted
examples (docstring summary -> function source) so that the chat template's tokens are learnt.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
MAX_FILE_BYTES = 400_000
#: Bumped whenever the selection of training documents changes (part of the data stage fingerprint).
#: 2: package sdists skip vendored folders (packages.VENDORED_DIRS).
CORPUS_VERSION = 2
EVAL_MODULUS = 20  # 1 file in 20 (by hash) is held out

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"


@dataclass(frozen=True)
class Corpus:
    """Documents of the corpus, split into train and held-out eval lists of strings."""

    root: str
    train: list[str]
    eval: list[str]
    train_files: int
    eval_files: int
    packages: tuple = ()  #: provenance rows of the package documents (packages.load_packages)


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library (``sysconfig`` 'stdlib')."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_eval_file(rel_path: str) -> bool:
    """True if the file (relative POSIX path) belongs to the held-out split (hash-based, stable)."""
    digest = hashlib.sha1(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % EVAL_MODULUS == 0


def list_source_files(root: Path) -> list[str]:
    """Sorted relative POSIX paths of ``*.py`` files under root, skipping tests and site-packages."""
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            continue
        out.append(rel.as_posix())
    return sorted(out)


def read_source(path: Path) -> str | None:
    """UTF-8 text of a file with normalised newlines, or None if it does not decode."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if ENDOFTEXT in text or IM_START in text or IM_END in text:
        return None  # never let a source file contain our special tokens
    return text


def chat_text(user: str, assistant: str) -> str:
    """One conversation rendered exactly as the tokenizer's chat template renders it."""
    return (
        f"{IM_START}user\n{user}{IM_END}\n"
        f"{IM_START}assistant\n{assistant}{IM_END}\n"
    )


def chat_examples(source: str, max_chars: int = 1500) -> list[str]:
    """Chat documents 'docstring summary -> function source' for the top-level functions of a file.

    Returns an empty list when the file does not parse. The user turn is the first paragraph of
    the function's docstring; the assistant turn is the function's source code.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    docs = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        code = ast.get_source_segment(source, node)
        if not doc or not code or len(code) > max_chars:
            continue
        summary = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
        if len(summary) < 20:
            continue
        docs.append(chat_text(f"Write a Python function `{node.name}`: {summary}", code))
    return docs


def load_corpus(max_train_chars: int | None = None, root: Path | None = None,
                packages: str = "") -> Corpus:
    """Read the corpus; ``max_train_chars`` caps the raw standard-library training text (files in
    hash order).

    Chat examples are derived from the same files, so they inherit the file's split. The eval
    split is never capped, so held-out metrics are comparable between model sizes. With
    ``packages`` "default" / "wide", the documents of `modelmaking.packages.PACKAGES` /
    ``WIDE_PACKAGES`` (and their chat examples) are
    appended to the training split, after the standard library (so a tokenizer learnt from the
    first characters of the training split is the standard library's).
    """
    root = root or stdlib_root()
    train, evals = [], []
    n_train = n_eval = 0
    train_chars = 0
    files = list_source_files(root)
    if max_train_chars is not None:
        # A capped corpus takes files in hash order, so it samples the whole library rather
        # than its alphabetically first packages; still deterministic.
        files.sort(key=lambda rel: hashlib.sha1(rel.encode("utf-8")).digest())
    for rel in files:
        held_out = is_eval_file(rel)
        if not held_out and max_train_chars is not None and train_chars >= max_train_chars:
            continue
        text = read_source(root / rel)
        if text is None or not text.strip():
            continue
        docs = [text, *chat_examples(text)]
        if held_out:
            evals.extend(docs)
            n_eval += 1
        else:
            train.extend(docs)
            train_chars += len(text)
            n_train += 1
    provenance: list[dict] = []
    if packages:
        from modelmaking.packages import PACKAGES, WIDE_PACKAGES, load_packages

        chosen = {"default": PACKAGES, "wide": WIDE_PACKAGES}[packages]
        pdocs, provenance = load_packages(packages=chosen)
        for text in pdocs:
            train.extend([text, *chat_examples(text)])
        n_train += len(pdocs)
    return Corpus(str(root), train, evals, n_train, n_eval, tuple(provenance))
