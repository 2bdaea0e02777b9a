"""Stand-in: imported by SGLang's audio helpers, never called on this path."""


def read(*args, **kwargs):
    raise NotImplementedError("soundfile stand-in")
