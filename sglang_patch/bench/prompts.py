"""Prompt files for the benchmark: JSONL with either ``prompt`` (completion) or ``turns`` (chat)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional


def completion_text(prompt: str) -> str:
    """A completion prompt as the target should see it: trailing whitespace removed ("token healing").

    Byte-level BPE with GPT-2 pre-tokenisation merges a newline with the indentation after it
    (``"\n    return"`` -> ``"\n   "``, ``" return"``), so a prompt ending in a bare ``"\n"`` token
    (every HumanEval prompt) sits where training text only ever ended a file: the small targets
    answer with ``<|endoftext|>`` or a new top-level block. Without the trailing whitespace the
    model writes the newline and indentation itself (measured on the shipped pair's 20 dev code
    prompts, greedy, 96 tokens: non-whitespace share 0.29 -> 0.77, distinct-4-gram ratio 0.18 ->
    0.71; `scripts/ship_models.py`). Every method and reference server gets the same text, so
    comparisons and lossless checks are unaffected.
    """
    return prompt.rstrip()


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

    Each line holds ``prompt`` (a completion prompt, e.g. HumanEval; sent as `completion_text`) or
    ``turns`` (a list of user
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
            out.append(BenchPrompt(pid, completion_text(row["prompt"]), "completion"))
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


def split_warmup(prompts: List[BenchPrompt], measured: int, warmup: int) -> tuple:
    """The measured prompts (the first ``measured``) and the warm-up prompts (the last ``warmup``,
    disjoint from them) of one prompt set.

    Every server is warmed up on the held-out prompts before it is measured, so the measured runs
    see a server in steady state (compiled paths, calibration bins past their priors, retrieval
    indexes holding earlier traffic) without its indexes holding answers to the measured prompts.

    Raises:
        ValueError: the set holds fewer than ``measured + warmup`` prompts.
    """
    if measured + warmup > len(prompts):
        raise ValueError(f"{measured} measured + {warmup} warm-up prompts, but the set holds {len(prompts)}")
    return prompts[:measured], prompts[len(prompts) - warmup:] if warmup else []
