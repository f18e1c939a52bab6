"""Prompt files for the benchmark: JSONL with either ``prompt`` (completion) or ``turns`` (chat)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt.

    Attributes:
        pid: the ``id`` field of the JSONL line (or its line number).
        text: the text sent to ``/generate`` (chat turns already rendered by the chat template).
        kind: ``"completion"`` for ``prompt`` lines, ``"chat"`` for ``turns`` lines.
    """

    pid: str
    text: str
    kind: str


def load_prompts(
    path: str | Path,
    limit: Optional[int] = None,
    render_chat: Optional[Callable[[str], str]] = None,
) -> List[BenchPrompt]:
    """Read a JSONL prompt file.

    Each line holds ``prompt`` (a completion prompt, e.g. HumanEval) or ``turns`` (a list of user
    turns, e.g. MT-Bench; the first turn is used). ``render_chat`` turns a user message into the text
    the target model sees (its chat template); without it the raw turn is sent.

    Raises:
        ValueError: a line has neither ``prompt`` nor ``turns``, or the file holds no prompts.
    """
    out: List[BenchPrompt] = []
    for lineno, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        pid = str(row.get("id", lineno))
        if "prompt" in row:
            out.append(BenchPrompt(pid, row["prompt"], "completion"))
        elif "turns" in row:
            msg = row["turns"][0]
            out.append(BenchPrompt(pid, render_chat(msg) if render_chat else msg, "chat"))
        else:
            raise ValueError(f"{path}:{lineno + 1}: line has neither 'prompt' nor 'turns'")
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out
