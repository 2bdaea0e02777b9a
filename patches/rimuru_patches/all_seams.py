"""Imports every module that registers seams, in installation order."""


def load() -> None:
    from rimuru_patches import cpu_platform, elastic, request_validation, routing_recorder, unified_pool  # noqa: F401
    from rimuru_patches.cpu_platform import grammar  # noqa: F401
