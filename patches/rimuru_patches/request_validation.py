"""Refuse a request the server cannot honour with an HTTP 400, before the scheduler.

Two checks run in ``TokenizerManager._validate_one_request``, in the HTTP
server's process; a ``ValueError`` there is already a 400 for SGLang's HTTP
and OpenAI layers (for a stream: an error event with code 400), so a refused
request never reaches the scheduler and nothing accepted is affected.

* Sampling parameter types. SGLang 0.5.17 reads ``sampling_params`` as an
  untyped dict and does arithmetic on it before ``SamplingParams`` checks
  anything, so ``{"max_new_tokens": "many"}`` ends in a ``TypeError`` and
  "500 Internal Server Error" with no hint of the cause.
* Grammar constraints (``json_schema``, ``regex``, ``ebnf``,
  ``structural_tag``). The scheduler compiles them; an invalid one is aborted
  there with a 400 already, but a non-string one (``"json_schema": {...}``,
  ``"regex": [...]``) is an unhashable grammar-cache key: a ``TypeError`` in
  the scheduler's ``process_req_with_grammar`` kills it (device-independent
  code: seen on CPU, so on GPU too); and with ``--grammar-backend none`` the
  request travels to the scheduler only to be turned away. Here: one
  constraint at most, a string, a grammar backend on, and for xgrammar (the
  default) the grammar parsed by xgrammar itself -- the parse the scheduler's
  compile starts with -- so the 400 carries xgrammar's reason.
  ``structural_tag`` and the other backends get the type checks only; their
  compile errors stay the scheduler's 400.
"""

from __future__ import annotations

import functools
import math
import re
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


#: SamplingParams' grammar constraints (mutually exclusive); SGLang treats "" as unset
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
#: SGLang's key for "any JSON" (its xgrammar backend compiles the built-in JSON grammar)
ANY_JSON = "$$ANY$$"


def check_grammar(params, backend: str | None, any_whitespace: bool = True) -> None:
    """Raise ValueError naming the field if the grammar constraint cannot be served.

    ``backend`` is the server's ``--grammar-backend`` ("none": constrained
    decoding is off).
    """
    if not isinstance(params, dict):
        return
    given = {f: params[f] for f in GRAMMAR_FIELDS if params.get(f) is not None and params.get(f) != ""}
    if not given:
        return
    if len(given) > 1:
        raise ValueError(f"sampling_params: set at most one of {', '.join(GRAMMAR_FIELDS)}; got {', '.join(given)}")
    (field, value), = given.items()
    if not isinstance(value, str):
        hint = " (a JSON schema serialized to a string)" if field in ("json_schema", "structural_tag") else ""
        raise ValueError(f"sampling_params.{field} must be a string{hint}, got {type(value).__name__}")
    if backend in (None, "none"):
        raise ValueError(
            f"sampling_params.{field}: constrained decoding is off on this server (--grammar-backend none)"
        )
    if backend == "xgrammar" and field != "structural_tag" and value != ANY_JSON:
        try:
            _xgrammar_parse(field, value, any_whitespace)
        except Exception as exc:  # xgrammar raises RuntimeError; any failure to parse is a refusal
            raise ValueError(f"sampling_params.{field} is not a valid {_KIND[field]}: {_clean(exc)}") from None


_KIND = {"json_schema": "JSON schema", "regex": "regex", "ebnf": "EBNF grammar"}


@functools.lru_cache(maxsize=1024)  # clients repeat their schemas; a failed parse is not cached
def _xgrammar_parse(field: str, value: str, any_whitespace: bool) -> None:
    from xgrammar import Grammar

    if field == "json_schema":
        Grammar.from_json_schema(value, any_whitespace=any_whitespace)
    elif field == "regex":
        Grammar.from_regex(value)
    else:
        Grammar.from_ebnf(value)


def _clean(exc: Exception) -> str:
    """xgrammar's message without its "[hh:mm:ss] /project/cpp/x.cc:75: " source prefix."""
    text = str(exc).strip()
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    return text.replace("Check failed: (err.empty()) is false: ", "")


def _validate_first(original, ctx):
    def _validate_one_request(self, obj, input_ids):
        params = getattr(obj, "sampling_params", None)
        check_sampling_params(params)
        args = self.server_args
        check_grammar(params, args.grammar_backend, not args.constrained_json_disable_any_whitespace)
        return original(self, obj, input_ids)

    return _validate_one_request


register(
    Seam(
        name="http.request_validation",
        target="sglang.srt.managers.tokenizer_manager:TokenizerManager._validate_one_request",
        why="a mistyped sampling parameter is a 500; a grammar the server cannot serve reaches the scheduler; "
        "make both a 400 naming the field",
        build=_validate_first,
        applies=lambda ctx: True,
    )
)
