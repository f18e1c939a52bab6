#!/usr/bin/env python
"""Build the small real models graft-spec tests, quickstart and benchmarks run on.

    python scripts/make_models.py [--quick | --preset quick|default|gpu|moe-quick|moe] [--out DIR] [--device cpu]
        [--seed N] [--threads N] [--compile] [--stages tokenizer,data,...]

Writes, under ``--out`` (default ``models/quick``; ``models/default``, the shipped pair, for ``gpu``;
``models/default-cpu`` for the CPU ``default`` preset):

* ``target/``  a ``Qwen3ForCausalLM`` checkpoint (safetensors, float32, tokenizer, chat template);
  ``Qwen3MoeForCausalLM`` for ``moe-quick`` (8 experts, top-2, into ``models/moe-quick``) and ``moe``
  (the shipped pair's shape with 32 experts, top-4, into ``models/moe``; meant for ``--device cuda``)
* ``draft/``   its EAGLE-3 head (``LlamaForCausalLMEagle3`` layout, as public EAGLE-3 heads)
* ``metrics.json`` held-out loss/perplexity, draft agreement, simulated accept length, timings
* ``DONE``     written last; its presence means every file above is complete.

Stages (tokenizer, data, target, draft, eval) are resumable: a stage whose marker in ``.stages/``
matches the current settings (and its upstream stages) is skipped; a preset that shares another's
tokenizer and data (``moe-quick`` shares ``quick``'s, ``moe`` the ``gpu`` preset's in ``models/default``)
copies them from that preset's folder when they are built there with the same settings. ``--stages`` runs only the named
stages and takes the others' outputs as they are (e.g. corpus stages on a machine with the registry,
training stages on a GPU machine with the ``data/`` and ``tokenizer/`` folders copied over). On CUDA
the forward passes run under bf16 autocast (float32 weights and optimiser). See docs/models.md.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from tqdm import tqdm  # noqa: E402

from modelmaking import corpus as corpus_mod  # noqa: E402
from modelmaking.data import encode_stream, eval_windows  # noqa: E402
from modelmaking.eagle3 import aux_layer_ids, load_draft, save_draft  # noqa: E402
from modelmaking.evaluate import greedy_chain, teacher_forced_agreement  # noqa: E402
from modelmaking.sizes import PRESETS, SizeSpec, folder  # noqa: E402
from modelmaking.target import (  # noqa: E402
    build_config, heldout_loss, init_model, load_target, save_target, train_target,
)
from modelmaking.tokenizer import save_tokenizer, special_ids, train_tokenizer  # noqa: E402
from modelmaking.train_draft import choose_draft_vocab, init_draft, train_draft  # noqa: E402

STAGES = ("tokenizer", "data", "target", "draft", "eval")
#: stages that read the corpus (the interpreter's standard library and the registry's sdists)
CORPUS_STAGES = ("tokenizer", "data")


class Builder:
    """Runs the stages into ``out`` with markers in ``out/.stages/<stage>.json``."""

    def __init__(self, out: Path, spec: SizeSpec, seed: int, device: str, compile_model: bool,
                 stages: tuple[str, ...] = STAGES):
        self.out, self.spec, self.seed, self.device = out, spec, seed, device
        self.compile = compile_model
        self.stages = stages
        self.markers = out / ".stages"
        self.markers.mkdir(parents=True, exist_ok=True)
        self._corpus = None
        self._cpu0 = time.process_time()

    # -- bookkeeping ------------------------------------------------------------------------------
    def fingerprint(self, stage: str) -> str:
        """Hash of what the stage depends on: its part of the preset, seed, corpus source and the
        upstream stage markers (so a rebuilt upstream stage invalidates everything after it)."""
        idx = STAGES.index(stage)
        spec = self.spec.as_dict()
        relevant = {
            "tokenizer": ("max_train_chars", "tokenizer_chars", "vocab_size"),
            "data": ("max_train_chars", "packages"),
            "target": ("target",),
            "draft": ("draft",),
            "eval": ("eval_tokens", "eval_seq_len", "greedy_prompts", "greedy_prompt_len", "greedy_new_tokens"),
        }[stage]
        part = {k: spec[k] for k in relevant}
        if stage == "target" and part["target"].get("moe") is None:  # dense: same fingerprint as before MoE
            part["target"] = {k: v for k, v in part["target"].items() if k != "moe"}
        parts = {
            "stage": stage,
            "spec": part,
            "seed": self.seed,
            "format": 1,
        }
        if stage in CORPUS_STAGES:  # later stages see the corpus only through the upstream markers
            parts.update(python=platform.python_version(), stdlib=str(corpus_mod.stdlib_root()))
        if stage == "data":
            parts["corpus_version"] = corpus_mod.CORPUS_VERSION
        for up in STAGES[:idx]:
            marker = self.markers / f"{up}.json"
            parts[f"upstream_{up}"] = hashlib.sha1(marker.read_bytes()).hexdigest() if marker.exists() else None
        return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()

    def done(self, stage: str, outputs: list[Path]) -> dict | None:
        """The stage's marker if it is complete for the current settings, else None. A stage left out
        of ``--stages`` is taken as it is (its marker and outputs must exist).

        Raises:
            SystemExit: a stage left out of ``--stages`` has no marker or misses an output.
        """
        marker = self.markers / f"{stage}.json"
        complete = marker.exists() and all(p.exists() for p in outputs)
        if stage not in self.stages:
            if not complete:
                raise SystemExit(f"make_models: stage {stage!r} is not in --stages but {self.out} has no "
                                 f"complete output of it ({marker}, {[str(p) for p in outputs]})")
            return json.loads(marker.read_text())
        if not complete:
            return None
        data = json.loads(marker.read_text())
        return data if data.get("fingerprint") == self.fingerprint(stage) else None

    def finish(self, stage: str, metrics: dict) -> dict:
        metrics["cpu_seconds"] = time.process_time() - self._cpu0
        data = {"fingerprint": self.fingerprint(stage), "built_at": time.time(), "metrics": metrics}
        tmp = self.markers / f"{stage}.json.tmp"
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, self.markers / f"{stage}.json")
        return data

    def staging(self, name: str) -> Path:
        """An empty ``<name>.tmp`` directory to write a stage's output into."""
        tmp = self.out / f"{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def publish(self, tmp: Path, name: str) -> None:
        """Make the staged files world-readable and move them to ``out/<name>``."""
        for f in tmp.iterdir():
            f.chmod(0o644)
        final = self.out / name
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)

    def corpus(self) -> corpus_mod.Corpus:
        if self._corpus is None:
            self._corpus = corpus_mod.load_corpus(self.spec.max_train_chars, packages=self.spec.packages)
        return self._corpus

    def adopt_shared(self, stage: str, name: str) -> dict | None:
        """Copy ``stage``'s output folder ``name`` and marker from the preset this one shares
        (``spec.shares``, built in the sibling folder of that name) when its marker there carries
        this build's fingerprint; the marker's bytes are kept, so downstream fingerprints match
        too. Returns the adopted marker, or None (nothing shared, or built differently there)."""
        if not self.spec.shares or stage not in self.stages:
            return None
        src = self.out.parent / folder(self.spec.shares)
        marker = src / ".stages" / f"{stage}.json"
        if not (marker.exists() and (src / name).is_dir()):
            return None
        data = json.loads(marker.read_text())
        if data.get("fingerprint") != self.fingerprint(stage):
            return None
        tmp = self.staging(name)
        for f in (src / name).iterdir():
            shutil.copy2(f, tmp / f.name)
        self.publish(tmp, name)
        shutil.copy2(marker, self.markers / f"{stage}.json")
        tqdm.write(f"{stage}: shared with {src}")
        return data

    # -- stages -----------------------------------------------------------------------------------
    def stage_tokenizer(self) -> dict:
        tok_dir = self.out / "tokenizer"
        marker = self.done("tokenizer", [tok_dir / "tokenizer.json"]) or self.adopt_shared("tokenizer", "tokenizer")
        if marker:
            return marker
        t0 = time.perf_counter()
        self._cpu0 = time.process_time()
        texts, used = [], 0
        for doc in self.corpus().train:
            if used >= self.spec.tokenizer_chars:
                break
            texts.append(doc)
            used += len(doc)
        tok = train_tokenizer(texts, self.spec.vocab_size)
        tmp = self.staging("tokenizer")
        save_tokenizer(tok, tmp, self.spec.target.max_position_embeddings)
        self.publish(tmp, "tokenizer")
        return self.finish("tokenizer", {"seconds": time.perf_counter() - t0, "chars": used,
                                         "vocab_size": tok.get_vocab_size()})

    def stage_data(self) -> dict:
        d = self.out / "data"
        marker = self.done("data", [d / "train.npy", d / "eval.npy"]) or self.adopt_shared("data", "data")
        if marker:
            return marker
        t0 = time.perf_counter()
        self._cpu0 = time.process_time()
        tok = Tokenizer.from_file(str(self.out / "tokenizer" / "tokenizer.json"))
        sep = special_ids(tok)["endoftext"]
        c = self.corpus()
        train = encode_stream(tok, c.train, sep)
        evals = encode_stream(tok, c.eval, sep)
        tmp = self.staging("data")
        np.save(tmp / "train.npy", train)
        np.save(tmp / "eval.npy", evals)
        self.publish(tmp, "data")
        return self.finish("data", {
            "seconds": time.perf_counter() - t0, "train_tokens": int(train.size), "eval_tokens": int(evals.size),
            "train_files": c.train_files, "eval_files": c.eval_files, "stdlib": c.root,
            "train_chars": sum(map(len, c.train)), "eval_chars": sum(map(len, c.eval)),
            "packages": list(c.packages),
        })

    def stage_target(self) -> dict:
        tdir = self.out / "target"
        marker = self.done("target", [tdir / "model.safetensors", tdir / "config.json"])
        if marker:
            return marker
        t0 = time.perf_counter()
        self._cpu0 = time.process_time()
        tok = Tokenizer.from_file(str(self.out / "tokenizer" / "tokenizer.json"))
        ids = special_ids(tok)
        train = np.load(self.out / "data" / "train.npy")
        spec = self.spec.target
        model = init_model(build_config(spec, tok.get_vocab_size(), ids), self.seed).to(self.device)
        n_params = sum(p.numel() for p in model.parameters())
        kind = "" if spec.moe is None else f" MoE ({spec.moe.num_experts} experts, top-{spec.moe.num_experts_per_tok})"
        tqdm.write(f"target{kind}: {n_params / 1e6:.2f}M parameters, {spec.steps} steps of "
                   f"{spec.batch_size}x{spec.seq_len} tokens ({spec.steps * spec.batch_size * spec.seq_len / 1e6:.0f}M "
                   f"tokens, {spec.steps * spec.batch_size * spec.seq_len / max(1, train.size):.1f} epochs)")
        stats = train_target(model, spec, train, self.seed, self.compile, device=self.device)
        model = model.cpu()
        tmp = self.staging("target")
        save_target(model, tmp, self.out / "tokenizer", ids)
        self.publish(tmp, "target")
        return self.finish("target", {"seconds": time.perf_counter() - t0, "params": n_params,
                                      "train_tokens_seen": spec.steps * spec.batch_size * spec.seq_len,
                                      **stats})

    def stage_draft(self) -> dict:
        ddir = self.out / "draft"
        marker = self.done("draft", [ddir / "model.safetensors", ddir / "config.json"])
        if marker:
            return marker
        t0 = time.perf_counter()
        self._cpu0 = time.process_time()
        tok = Tokenizer.from_file(str(self.out / "tokenizer" / "tokenizer.json"))
        ids = special_ids(tok)
        train = np.load(self.out / "data" / "train.npy")
        target = load_target(self.out / "target").to(self.device)
        for p in target.parameters():
            p.requires_grad_(False)
        spec = self.spec.draft
        layer_ids = aux_layer_ids(target.config.num_hidden_layers)
        hot = choose_draft_vocab(train, target.config.vocab_size, spec.draft_vocab_size, list(ids.values()))
        coverage = float(np.isin(train, hot.numpy()).mean())
        draft = init_draft(target, spec, layer_ids, hot.to(self.device), self.seed).to(self.device)
        n_params = sum(p.numel() for p in draft.parameters())
        tqdm.write(f"draft: {n_params / 1e6:.2f}M parameters, aux layers {layer_ids}, draft vocab "
                   f"{spec.draft_vocab_size} covering {coverage:.1%} of training tokens")
        stats = train_draft(draft, target, layer_ids, spec, train, self.seed, self.compile, device=self.device)
        tmp = self.staging("draft")
        save_draft(draft.cpu(), tmp, layer_ids, ids)
        self.publish(tmp, "draft")
        return self.finish("draft", {"seconds": time.perf_counter() - t0, "params": n_params,
                                     "aux_layer_ids": layer_ids, "draft_vocab_coverage": coverage, **stats})

    def stage_eval(self) -> dict:
        marker = self.done("eval", [])
        if marker:
            return marker
        t0 = time.perf_counter()
        self._cpu0 = time.process_time()
        evals = np.load(self.out / "data" / "eval.npy")
        target = load_target(self.out / "target").to(self.device)
        draft, layer_ids = load_draft(self.out / "draft", target.get_input_embeddings().weight.detach())
        draft = draft.to(self.device)
        lm = heldout_loss(target, evals, self.spec.eval_seq_len or self.spec.target.seq_len, self.spec.eval_tokens)
        K = self.spec.draft.ttt_steps
        windows = eval_windows(evals, self.spec.draft.seq_len, self.spec.eval_tokens).to(self.device)
        agreement = teacher_forced_agreement(target, draft, layer_ids, windows, K)
        P = self.spec.greedy_prompt_len
        starts = np.linspace(0, len(evals) - P - 1, self.spec.greedy_prompts).astype(np.int64)
        prompts = torch.from_numpy(np.stack([evals[s : s + P].astype(np.int64) for s in starts])).to(self.device)
        chain = greedy_chain(target, draft, layer_ids, prompts, self.spec.greedy_new_tokens, K)
        return self.finish("eval", {"seconds": time.perf_counter() - t0, **lm,
                                    "heldout_agreement": agreement, "greedy_chain": chain})

    def run(self) -> dict:
        done_file = self.out / "DONE"
        results = {}
        for stage in tqdm(STAGES, desc=f"make_models[{self.spec.name}]", unit="stage"):
            results[stage] = getattr(self, f"stage_{stage}")()
            if done_file.exists() and results[stage].get("built_at", 0) > done_file.stat().st_mtime:
                done_file.unlink()
            if stage == self.stages[-1] and stage != STAGES[-1]:
                return {}  # the later stages run elsewhere (--stages)
        metrics = summarize(self.spec, self.seed, results)
        (self.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        done_file.write_text(json.dumps({"size": self.spec.name, "seed": self.seed,
                                         "target": "target", "draft": "draft"}) + "\n")
        return metrics


def summarize(spec: SizeSpec, seed: int, results: dict) -> dict:
    """The metrics.json document (flat, human-readable) from the stage markers."""
    m = {k: v["metrics"] for k, v in results.items()}
    return {
        "size": spec.name,
        "seed": seed,
        "python": platform.python_version(),
        "corpus": {k: m["data"].get(k) for k in ("stdlib", "train_files", "eval_files", "train_tokens",
                                                  "eval_tokens", "packages")},
        "tokenizer": {"vocab_size": m["tokenizer"]["vocab_size"]},
        "target": {
            "params": m["target"]["params"],
            "heldout_loss": m["eval"]["heldout_loss"],
            "heldout_ppl": m["eval"]["heldout_ppl"],
            "heldout_tokens": m["eval"]["heldout_tokens"],
            "train_loss_last": m["target"]["train_loss_last"],
            "train_tokens_seen": m["target"]["train_tokens_seen"],
        },
        "draft": {
            "params": m["draft"]["params"],
            "aux_layer_ids": m["draft"]["aux_layer_ids"],
            "draft_vocab_size": spec.draft.draft_vocab_size,
            "draft_vocab_coverage": m["draft"]["draft_vocab_coverage"],
            "ttt_steps": spec.draft.ttt_steps,
            "heldout_top1_agreement_by_step": m["eval"]["heldout_agreement"],
            "greedy_top1_agreement_by_step": m["eval"]["greedy_chain"]["step_agreement"],
            "greedy_chain_accept_length": m["eval"]["greedy_chain"]["accept_length"],
        },
        "seconds": {k: m[k]["seconds"] for k in STAGES} | {"total": sum(m[k]["seconds"] for k in STAGES)},
        # process CPU time (all threads): on a machine shared with other jobs, wall time overstates
        # what the build needs; cpu_seconds / threads is the wall time on otherwise idle cores.
        "cpu_seconds": {k: m[k].get("cpu_seconds") for k in STAGES},
        "threads": torch.get_num_threads(),
        "spec": spec.as_dict(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny models for tests (< 3 min on 2 cores); "
                    "same as --preset quick")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="size preset (default: default; gpu = the shipped pair and moe = its MoE twin, both "
                    "meant for --device cuda)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output dir (default models/<preset>; models/default-cpu for default, models/default for gpu)")
    ap.add_argument("--stages", default=",".join(STAGES),
                    help="comma-separated stages to run; the others must already be complete in --out")
    ap.add_argument("--device", default="cpu", help="training device, e.g. cpu or cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    ap.add_argument(
        "--compile", action="store_true",
        help="train with torch.compile (not bit-reproducible on CPU: inductor's parallel reductions "
        "vary run to run; the default eager training gives the same checkpoint for the same seed, "
        "machine and --threads)",
    )
    args = ap.parse_args(argv)
    stages = tuple(x.strip() for x in args.stages.split(",") if x.strip())
    if not stages or any(x not in STAGES for x in stages):
        ap.error(f"--stages {args.stages!r}: choose from {','.join(STAGES)}")
    stages = tuple(x for x in STAGES if x in stages)
    if args.quick and args.preset not in (None, "quick"):
        ap.error("--quick and --preset disagree")
    spec = PRESETS["quick" if args.quick else (args.preset or "default")]
    out = (args.out or REPO / "models" / folder(spec.name)).resolve()
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    t0 = time.perf_counter()
    # one build per output directory at a time (tests, quickstart and users may race)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        metrics = Builder(out, spec, args.seed, args.device, args.compile, stages).run()
    if metrics:
        print(json.dumps({k: metrics[k] for k in ("target", "draft", "seconds")}, indent=2))
    print(f"models in {out} ({time.perf_counter() - t0:.0f}s this run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
