"""Registration of ``--speculative-algorithm graft`` (owned by the Graft-in-SGLang work)."""


def register_graft() -> None:
    """Register the graft algorithm with SGLang's SpeculativeAlgorithm registry."""
