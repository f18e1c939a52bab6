"""vLLM 0.33 plugin for Graft: ``speculative_config={"method": "graft", ...}`` (see docs/vllm.md).

Modules: plugin (entry point), config_patch (SpeculativeConfig), proposer (GraftProposer),
step (per-step Graft state, no vLLM import), requests (per-request state),
bench (benchmark / lossless check on a running engine: ``python -m vllm_worker.bench``).
Importing this package imports nothing from vLLM.
"""
