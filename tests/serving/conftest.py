"""Package-scoped servers for the serving tests (tests/serving/): one graft server, one reference.

Both start once, in parallel, for every test module of this package and stop after its last test:

* ``nospec``: the quick target without speculation (greedy reference outputs);
* ``graft``: ``--speculative-algorithm graft`` with the quick preset, a small retrieval cap
  (``--graft-retrieval-suffix-max-nodes 512``) so prompts exceed it, and ``--context-length 1024``
  so "near the context length" is cheap.

``SERVING_TEST_SERVERS=<nospec url>,<graft url>`` reuses two servers started by hand with the same
arguments (development only: the package does not stop them).

Identical non-speculative settings on both (float32: SGLang would downcast the float32 checkpoints
to float16, whose rounding differs between tree-verify and one-token decode forwards).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import pytest

from sglang_patch.launcher import SGLangServer, start_all

ROOT = Path(__file__).resolve().parents[2]
CONTEXT_LENGTH = 1024
MAX_RUNNING = 32
SUFFIX_MAX_NODES = 512
#: Context slots SGLang reserves per request on the graft server for the draft tree (EAGLE-like
#: algorithms: max(topk * steps, N) = 24, ``managers/utils.py`` ``compute_num_reserved_tokens``).
RESERVED = 24
COMMON = ["--dtype", "float32", "--max-total-tokens", "65536", "--max-running-requests", str(MAX_RUNNING),
          "--context-length", str(CONTEXT_LENGTH), "--random-seed", "0",
          # the scheduler polls its sockets instead of spinning when idle (SGLang default: spin,
          # one core per idle server on CPU, measured)
          "--sleep-on-idle"]
SHAPE = ["--speculative-num-steps", "4", "--speculative-eagle-topk", "4",
         "--speculative-num-draft-tokens", "24"]

#: Retrieval memory bound per live request, in bytes per configured suffix-trie node
#: (test_server_stats.py measures <= 184 B/node with ``memory_bytes()``'s accounting and <= 175 B/node
#: of real allocations with tracemalloc), plus a fixed per-request overhead.
BYTES_PER_SUFFIX_NODE = 210
#: Fixed per-request overhead, the output index's record of a live request included (its output,
#: at most ``retrieval.outputs_max_request_tokens`` = 2048, and prompt tail, int32).
PER_REQUEST_OVERHEAD = 4096 + 4 * 2048 + 2048


def retrieval_bound(successor_bytes: int, live_requests: int, max_nodes: int = SUFFIX_MAX_NODES,
                    outputs_index_bytes: int = 0) -> int:
    """Upper bound of ``GraftPlanner.memory_bytes()``: the fixed successor table, the output index's
    ring and tables (shared, fixed; see `outputs_index_bound`)
    plus, per live request, ``BYTES_PER_SUFFIX_NODE * max_nodes + PER_REQUEST_OVERHEAD``."""
    return (successor_bytes + outputs_index_bytes
            + live_requests * (BYTES_PER_SUFFIX_NODE * max_nodes + PER_REQUEST_OVERHEAD))


def outputs_index_bound(retrieval) -> int:
    """Upper bound of the output index's ``index_bytes()`` (shared, fixed at start-up, kept after
    requests stop) from a ``RetrievalConfig``'s caps: a ring of ``outputs_max_tokens`` tokens and
    their group tags, plus one hash table per match length (at most ``len(MATCH_LENGTHS)``) of at
    most ``4 * outputs_max_tokens`` int64 slots."""
    from graft_spec.retrieval.output_ring import MATCH_LENGTHS

    c = retrieval.outputs_max_tokens
    return 8 * (2 * c + len(MATCH_LENGTHS) * 4 * c)


def graft_retrieval_config():
    """The graft server's ``RetrievalConfig`` (`graft_args`: configs/quick.yaml, the suffix cap)."""
    from graft_spec.config import load_config

    return load_config(ROOT / "configs" / "quick.yaml", {"retrieval.suffix_max_nodes": SUFFIX_MAX_NODES},
                       env=False).retrieval


def graft_args(draft: Path) -> List[str]:
    """CLI of the graft server under test."""
    return ["--speculative-algorithm", "graft", "--speculative-draft-model-path", str(draft),
            "--graft-config", str(ROOT / "configs" / "quick.yaml"), *SHAPE,
            "--graft-retrieval-suffix-max-nodes", str(SUFFIX_MAX_NODES)]


@dataclass
class Servers:
    """The two running servers, and the graft server's stats when it was fresh and idle."""

    nospec: SGLangServer
    graft: SGLangServer
    baseline: Dict


@pytest.fixture(scope="package")
def servers(quick_models) -> Servers:
    """Start ``nospec`` and ``graft`` in parallel; stop both after the package's last test."""
    from .client import server_stats

    reuse = os.environ.get("SERVING_TEST_SERVERS")
    if reuse:
        urls = reuse.split(",")
        ns, gs = (SGLangServer(model_path="", port=int(u.rsplit(":", 1)[1])) for u in urls)
        yield Servers(ns, gs, server_stats(gs.url))
        return
    stamp = int(time.time())
    nospec = SGLangServer(model_path=str(quick_models.target), args=list(COMMON),
                          log_path=f"/tmp/serving_nospec_{stamp}.log")
    graft = SGLangServer(model_path=str(quick_models.target),
                         args=[*COMMON, *graft_args(quick_models.draft)],
                         log_path=f"/tmp/serving_graft_{stamp}.log")
    start_all([nospec, graft])
    try:
        yield Servers(nospec, graft, server_stats(graft.url))
    finally:
        nospec.stop()
        graft.stop()


@pytest.fixture(scope="package")
def tokenizer(quick_models):
    """The quick target's tokenizer (``tokenizers.Tokenizer``)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(quick_models.target / "tokenizer.json"))


def load_prompts() -> List[str]:
    """The 162 prompt texts of data/humaneval_dev.jsonl and data/mtbench_dev.jsonl (first turns)."""
    out = []
    for name in ("humaneval_dev.jsonl", "mtbench_dev.jsonl"):
        for line in (ROOT / "data" / name).read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                out.append(row["prompt"] if "prompt" in row else row["turns"][0])
    return out
