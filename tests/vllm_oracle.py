"""An oracle-tree run of the vLLM engine (tests/test_vllm_engine.py): graft's proposer replaced by trees
that hide the target's greedy continuation among decoys.

``python tests/vllm_oracle.py REFERENCE.json BENCH_ARGS...`` (in the engine venv) reads the no-spec greedy
outputs of a `vllm_worker.bench` JSON and runs ``vllm_worker.bench --one-method graft`` in this process
with `ChainStep.finish` patched: every request's tree holds its next `DEPTH` greedy tokens as a path
whose nodes are not consecutive in index order, beside decoys (a wrong token under each true node, the
true token again under a decoy, a deep decoy chain), N nodes in all. Right positions, tree mask and KV
compaction accept the whole path each step; wrong ones do not, or change the output. The planner still
runs underneath (its tree is not verified). Writes ``ORACLE.json`` beside ``--json``: the accepted path
length each step offered.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DEPTH = 7


def oracle_tree(cont: list[int], n: int) -> tuple[list[int], list[int]]:
    """``(tokens, parents)`` of ``n`` nodes (node 0 the root, token -1 there) hiding ``cont[:DEPTH]``."""
    toks, pars = [-1], [-1]
    true_parent, decoy = 0, None
    for c in cont[:DEPTH]:
        if len(toks) + 3 > n:
            break
        toks.append(c ^ 1)                  # a wrong token under the true parent, before the true one
        pars.append(true_parent)
        if decoy is not None:               # the true token again, under a decoy
            toks.append(c)
            pars.append(decoy)
        decoy = len(toks) - (2 if decoy is not None else 1)
        toks.append(c)
        pars.append(true_parent)
        true_parent = len(toks) - 1
    first = cont[0] if cont else 0
    while len(toks) < n:                    # a deep decoy chain under the last decoy (or the root)
        toks.append((first ^ 2) if len(toks) % 2 else (first ^ 3))
        pars.append(decoy if decoy is not None else 0)
        decoy = len(toks) - 1
    return toks, pars


def main() -> int:
    ref_path, argv = sys.argv[1], sys.argv[2:]
    ref = {}
    for r in json.loads(Path(ref_path).read_text())["rows"]:
        if r["method"] == "none" and r["mode"] == "greedy":
            for p, t in zip(r["prompt_token_ids"], r["tokens"]):
                ref[tuple(p)] = t
    from vllm_worker import bench
    from vllm_worker.step import ChainStep

    offered: list[int] = []
    original = ChainStep.finish

    def finish(self, root_tokens, req_ids, token_ids, num_prompt_tokens, num_tokens, max_len, alive=None,
               sampled=None, chain_rows=None):
        drafts = original(self, root_tokens, req_ids, token_ids, num_prompt_tokens, num_tokens, max_len,
                          alive=alive, sampled=sampled, chain_rows=chain_rows)
        if not self.trees or not drafts:
            return drafts
        out = []
        for i, rid in enumerate(req_ids):
            npt, nt = int(num_prompt_tokens[i]), int(num_tokens[i])
            prompt = tuple(int(x) for x in token_ids[i, :npt])
            cont = ref[prompt][nt - npt:] if prompt in ref else []
            toks, pars = oracle_tree(cont, self.config.num_draft_tokens)
            self._proposed[rid] = (toks[1:], pars)
            offered.append(min(len(cont), DEPTH))
            out.append(toks[1:])
        return out

    ChainStep.finish = finish
    rc = bench.main([*argv, "--one-method", "graft"])
    json_path = Path(argv[argv.index("--json") + 1])
    (json_path.parent / "ORACLE.json").write_text(json.dumps(offered))
    return rc


if __name__ == "__main__":
    sys.exit(main())
