"""Reject sampling parameters of the wrong type with an HTTP 400, not a 500.

SGLang 0.5.17 reads ``sampling_params`` as an untyped dict and does arithmetic
on it in ``TokenizerManager._validate_one_request`` before ``SamplingParams``
checks anything, so ``{"max_new_tokens": "many"}`` ends in a ``TypeError`` and
"500 Internal Server Error" with no hint of the cause. This seam checks the
types of the numeric fields first and raises ``ValueError`` naming the field,
which SGLang's HTTP layer already turns into a 400 response; the request is
refused before it reaches the scheduler, so nothing accepted is affected.
"""

from __future__ import annotations

import math
from numbers import Real

from rimuru_patches.seams import Seam, register

#: numeric sampling fields and whether they must be integers (from SamplingParams)
NUMERIC_FIELDS: dict[str, bool] = {
    "max_new_tokens": True,
    "min_new_tokens": True,
    "n": True,
    "top_k": True,
    "stream_interval": True,
    "sampling_seed": True,
    "temperature": False,
    "top_p": False,
    "min_p": False,
    "frequency_penalty": False,
    "presence_penalty": False,
    "repetition_penalty": False,
}


def check_sampling_params(params) -> None:
    """Raise ValueError naming the first field whose value has the wrong type."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise ValueError(f"sampling_params must be an object, got {type(params).__name__}")
    for field, integral in NUMERIC_FIELDS.items():
        value = params.get(field)
        if value is None:
            continue
        ok = isinstance(value, int) if integral else isinstance(value, Real)
        if isinstance(value, bool) or not ok or (not integral and not math.isfinite(value)):
            kind = "an integer" if integral else "a finite number"
            raise ValueError(f"sampling_params.{field} must be {kind}, got {value!r}")


def _validate_types_first(original, ctx):
    def _validate_one_request(self, obj, input_ids):
        check_sampling_params(getattr(obj, "sampling_params", None))
        return original(self, obj, input_ids)

    return _validate_one_request


register(
    Seam(
        name="http.sampling_param_types",
        target="sglang.srt.managers.tokenizer_manager:TokenizerManager._validate_one_request",
        why="a sampling parameter of the wrong type is a 500 with a TypeError; make it a 400 naming the field",
        build=_validate_types_first,
        applies=lambda ctx: True,
    )
)
