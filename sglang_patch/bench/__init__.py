"""Side-by-side benchmark of speculative methods on real SGLang servers (``python -m sglang_patch.bench``).

Drives HTTP servers only (no engine imports): each method/budget gets its own server process,
the same prompts are sent at each concurrency, and every greedy output is checked against the
no-speculation server in the same run.
"""
