"""Build small real checkpoints for graft-spec tests and benchmarks.

Everything here is driven by ``scripts/make_models.py``: a byte-level BPE tokenizer trained on the
running interpreter's standard-library sources, a ``Qwen3ForCausalLM`` target trained on the same
corpus, and an EAGLE-3 draft head (the layout SGLang 0.5.23 ``srt/models/llama_eagle3.py`` loads)
trained on the target's hidden states. See ``docs/models.md``.
"""
