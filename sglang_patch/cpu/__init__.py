"""CPU execution layer for SGLang speculative decoding (owned by the CPU-layer work)."""


def install_cpu_layer() -> None:
    """Register the CPU replacements through SGLang's HookRegistry when no CUDA device is present."""
