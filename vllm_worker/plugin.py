"""vLLM plugin entry point (placeholder until the plugin lands)."""


def register() -> None:
    """Entry point of ``vllm.general_plugins``; registers nothing yet."""
