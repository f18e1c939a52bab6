#!/usr/bin/env python
"""Turn a ``make_models.py`` output directory into the pair shipped in the repository.

    python scripts/ship_models.py --models models/default \
        --command "python scripts/make_models.py --threads 2"

In place: the target and draft ``*.safetensors`` become bfloat16 (floating tensors only; their
``config.json`` says ``torch_dtype: bfloat16``), the target's greedy text quality on the 20 dev
code prompts (96 new tokens, Hugging Face ``generate`` in float32) is measured, and ``MANIFEST.json``
is written: sha256 and size of every shipped file, the exact build command, seed, preset, corpus
(standard library + the pinned PyPI source distributions with their licences and sha256, from
``metrics.json``) and the measured metrics. ``tests/test_models.py`` checks the manifest against
the files. Training data (``data/``) and stage fingerprints stay out of git (``.gitignore``).

Raises ``SystemExit`` if the shipped files exceed ``--max-mib`` (default 60).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: Subdirectories of a model directory that are shipped (everything else stays local).
SHIPPED_DIRS = ("target", "draft")
SHIPPED_FILES = ("metrics.json", "DONE")
MANIFEST = "MANIFEST.json"


def sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def shipped_files(models: Path) -> list[Path]:
    """Every file that goes into git, sorted, relative to ``models``."""
    files = [p.relative_to(models) for d in SHIPPED_DIRS for p in (models / d).rglob("*") if p.is_file()]
    files += [Path(f) for f in SHIPPED_FILES if (models / f).is_file()]
    return sorted(files)


def to_bf16(model_dir: Path) -> None:
    """Rewrite the floating tensors of every safetensors file in ``model_dir`` as bfloat16."""
    for st in model_dir.glob("*.safetensors"):
        tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
                   for k, v in load_file(st).items()}
        save_file(tensors, st, metadata={"format": "pt"})
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["torch_dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def greedy_text_quality(target: Path, prompts: Path, n: int = 20, max_new_tokens: int = 96) -> dict:
    """Non-whitespace share and distinct-4-gram ratio of the target's greedy completions (float32) of
    the first ``n`` prompts, sent as the benchmark sends them (`sglang_patch.bench.prompts`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_patch.bench.prompts import load_prompts
    from sglang_patch.bench.report import text_quality

    tok = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    rows = load_prompts(prompts, n)
    outs = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([tok.encode(row.text, add_special_tokens=False)[-192:]])
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id or 0)
            outs.append(gen[0, ids.shape[1]:].tolist())
    q = text_quality(outs, tok)
    return {"prompts": str(prompts.relative_to(REPO)), "n": len(rows), "max_new_tokens": max_new_tokens,
            **{k: round(v, 4) for k, v in q.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=Path, default=REPO / "models" / "default")
    ap.add_argument("--command", required=True, help="the exact make_models.py command that built it")
    ap.add_argument("--max-mib", type=float, default=60.0)
    args = ap.parse_args(argv)
    models = args.models.resolve()
    if not (models / "DONE").exists():
        raise SystemExit(f"{models}: no DONE marker (build it with make_models.py first)")
    for d in SHIPPED_DIRS:
        to_bf16(models / d)
    metrics = json.loads((models / "metrics.json").read_text())
    quality = greedy_text_quality(models / "target", REPO / "data" / "humaneval_dev.jsonl")
    files = shipped_files(models)
    total = sum((models / f).stat().st_size for f in files)
    if total > args.max_mib * 2**20:
        raise SystemExit(f"shipped files are {total / 2**20:.1f} MiB > {args.max_mib} MiB")
    manifest = {
        "command": args.command,
        "ship_command": f"python scripts/ship_models.py --models {args.models} --command '{args.command}'",
        "seed": metrics["seed"],
        "python": metrics["python"],
        "preset": metrics["spec"],
        "corpus": metrics["corpus"],
        "dtype": "bfloat16",
        "metrics": {"target": metrics["target"], "draft": metrics["draft"],
                    "greedy_text_quality_fp32": quality, "build_seconds": metrics["seconds"],
                    "threads": metrics["threads"]},
        "files": {str(f): {"sha256": sha256(models / f), "bytes": (models / f).stat().st_size} for f in files},
        "total_mib": round(total / 2**20, 2),
    }
    (models / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps({"total_mib": manifest["total_mib"], "quality": quality,
                      "heldout_ppl": metrics["target"]["heldout_ppl"]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
