"""Imports every module that registers seams, in installation order."""


def load() -> None:
    from rimuru_patches import (cpu_platform, elastic, mixed_decodes, request_validation,  # noqa: F401
                                 routing_recorder, unified_pool)
    from rimuru_patches.cpu_platform import grammar  # noqa: F401
