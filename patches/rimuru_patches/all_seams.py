"""Imports every module that registers seams, in installation order."""


def load() -> None:
    from rimuru_patches import (card_cap, cpu_platform, elastic, mixed_decodes,  # noqa: F401
                                 request_validation, routing_recorder, unified_pool)
    from rimuru_patches.cpu_platform import grammar  # noqa: F401
