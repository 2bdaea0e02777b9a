"""Structured output end to end: every constrained-decoding kind against a running server.

    python bench/grammar_check.py --url http://127.0.0.1:30000              # each kind served and valid
    python bench/grammar_check.py --url ... --refusals                      # + each bad request is a 400
    python bench/grammar_check.py --url ... --backend-off                   # a --grammar-backend none server

One line per case, exit status 1 if any case fails. ``tests/server/
test_grammar.py`` imports ``CASES``/``REFUSALS`` so CI (CPU) and the GPU run
send the same bodies and apply the same validators.

Random-weight models produce noise, so every constraint is one whose grammar
forces an end (fixed keys, enums, bounded patterns) and the output is checked
independently of the server (``re.fullmatch``, ``jsonschema``). JSON allows
whitespace between tokens, which a random model picks greedily forever, so
the JSON-schema cases add a frequency penalty: greedy (deterministic; a
sampling seed is honoured only with --enable-deterministic-inference), and
every repeat of a whitespace token makes the next key or value likelier.
JSON mode (any object) stays plain greedy: a penalty there pushes the model
into an endless key string, while greedy closes "{}" at once (on the tiny
model; another model may not, which the prefix check reports). A run cut off by
max_new_tokens fails as "unfinished", saying whether its text is still a
valid prefix of the grammar (xgrammar's matcher).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from typing import Callable

import requests

TIMEOUT_S = 300
REGEX = r"(cat|dog)-[0-9]{3}"
EBNF = 'root ::= "(" num ("," num)? ")"\nnum ::= [0-9] [0-9]?'
EBNF_AS_REGEX = r"\([0-9][0-9]?(,[0-9][0-9]?)?\)"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
CHOICES = ["red", "green", "blue"]
GREEDY = {"temperature": 0.0}
NO_RUNS = {"temperature": 0.0, "frequency_penalty": 1.0}  # JSON: see the module docstring


@dataclasses.dataclass
class Reply:
    status: int  # HTTP status (DSL: 200, or 400 when the program failed on an error reply)
    text: str = ""  # the constrained output, or the error message
    finished: bool = True  # False: cut off by the token limit


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    grammar: tuple[str, str]  # ("regex"|"json"|"ebnf"|"choice", source): for the prefix check
    send: Callable[[str], Reply]  # server url -> reply
    check: Callable[[str], None]  # raises AssertionError (or a parse error) naming the problem


# --- senders -----------------------------------------------------------------------------


def _error(resp: requests.Response) -> str:
    try:
        err = resp.json()
    except ValueError:
        return resp.text
    err = err.get("error", err) if isinstance(err, dict) else err
    return err.get("message", str(err)) if isinstance(err, dict) else str(err)


def generate(params: dict, max_new_tokens: int = 256, stream: bool = False, text: str = "Answer:"):
    body = {"text": text, "stream": stream, "sampling_params": {"max_new_tokens": max_new_tokens, **params}}

    def send(url: str) -> Reply:
        resp = requests.post(url + "/generate", json=body, timeout=TIMEOUT_S, stream=stream)
        if resp.status_code != 200:
            return Reply(resp.status_code, _error(resp))
        if not stream:
            out = resp.json()
            return Reply(200, out["text"], out["meta_info"]["finish_reason"]["type"] != "length")
        last = None
        for line in resp.iter_lines():  # SGLang reports a refused stream as an error event
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                last = json.loads(line[6:])
                if "error" in last:
                    return Reply(int(last["error"].get("code", 400)), last["error"]["message"])
        return Reply(200, last["text"], last["meta_info"]["finish_reason"]["type"] != "length")

    return send


def openai(path: str, body: dict):
    def send(url: str) -> Reply:
        resp = requests.post(url + path, json={"model": "default", "max_tokens": 256, **body}, timeout=TIMEOUT_S)
        if resp.status_code != 200:
            return Reply(resp.status_code, _error(resp))
        choice = resp.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return Reply(200, text, choice["finish_reason"] != "length")

    return send


def chat(**body):
    return openai("/v1/chat/completions", {"messages": [{"role": "user", "content": "Reply in JSON."}], **body})


def dsl(program_kind: str):
    """The frontend DSL through sgl.RuntimeEndpoint: gen(regex=...) or select / gen(choices=...)."""

    def send(url: str) -> Reply:
        import sglang as sgl

        @sgl.function
        def program(s):
            s += "Pick: "
            if program_kind == "regex":
                s += sgl.gen("out", regex=REGEX, max_tokens=32, temperature=0)
            elif program_kind == "select":
                s += sgl.select("out", choices=CHOICES)
            else:
                s += sgl.gen("out", choices=CHOICES)

        state = program.run(backend=sgl.RuntimeEndpoint(url))
        state.sync()
        if state.error() is not None:  # RuntimeEndpoint raised with the error body of a non-200 reply
            return Reply(400, str(state.error()))
        return Reply(200, state["out"])

    return send


# --- validators ----------------------------------------------------------------------------


def fullmatch(pattern: str):
    def check(text: str) -> None:
        assert re.fullmatch(pattern, text), f"{text!r} does not match {pattern!r}"

    return check


def matches_schema(schema: dict):
    def check(text: str) -> None:
        value = json.loads(text)
        try:
            import jsonschema
        except ImportError:  # by hand: keys and types of PERSON-like flat schemas
            assert isinstance(value, dict) and set(value) == set(schema["required"]), value
            return
        jsonschema.validate(value, schema)

    return check


def json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict), f"{text!r} is not a JSON object"


def one_of(choices: list[str]):
    def check(text: str) -> None:
        assert text in choices, f"{text!r} not in {choices}"

    return check


# --- the cases ------------------------------------------------------------------------------

PERSON_STR = json.dumps(PERSON)
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

#: every kind of constrained decoding the server must honour
CASES = [
    Case("generate.regex", ("regex", REGEX), generate({"regex": REGEX, **GREEDY}), fullmatch(REGEX)),
    Case("generate.regex.stream", ("regex", REGEX), generate({"regex": REGEX, **GREEDY}, stream=True),
         fullmatch(REGEX)),
    Case("generate.ebnf", ("ebnf", EBNF), generate({"ebnf": EBNF, **GREEDY}), fullmatch(EBNF_AS_REGEX)),
    Case("generate.json_schema", ("json", PERSON_STR), generate({"json_schema": PERSON_STR, **NO_RUNS}),
         matches_schema(PERSON)),
    Case("chat.json_object", ("json", '{"type": "object"}'),
         chat(response_format={"type": "json_object"}, **GREEDY), json_object),
    Case("chat.json_schema", ("json", PERSON_STR),
         chat(response_format=PERSON_FORMAT, **NO_RUNS), matches_schema(PERSON)),
    Case("completions.regex", ("regex", REGEX),
         openai("/v1/completions", {"prompt": "Pick:", "regex": REGEX, "temperature": 0}), fullmatch(REGEX)),
    Case("dsl.gen_regex", ("regex", REGEX), dsl("regex"), fullmatch(REGEX)),
    Case("dsl.select", ("choice", ""), dsl("select"), one_of(CHOICES)),
    Case("dsl.gen_choices", ("choice", ""), dsl("choices"), one_of(CHOICES)),
]


@dataclasses.dataclass(frozen=True)
class Refusal:
    name: str
    send: Callable[[str], Reply]
    reason: str  # a fragment the error message must contain


def _bad(**params) -> Callable[[str], Reply]:
    return generate({**params, **GREEDY}, max_new_tokens=8)


#: requests the server must turn away with a 400 naming the reason, and keep serving; the
#: reasons are the project's wording (xgrammar's own detail follows it and differs by version)
REFUSALS = [
    Refusal("regex.unclosed", _bad(regex="["), "regex is not a valid regex"),
    Refusal("regex.lookahead", _bad(regex="(?=a)b"), "regex is not a valid regex"),
    Refusal("regex.list", _bad(regex=["a"]), "regex must be a string"),
    Refusal("json_schema.syntax", _bad(json_schema="{not json"), "json_schema is not a valid JSON schema"),
    Refusal("json_schema.type", _bad(json_schema='{"type": "nosuch"}'), "json_schema is not a valid JSON schema"),
    Refusal("json_schema.dict", _bad(json_schema=PERSON), "json_schema must be a string"),
    Refusal("ebnf.no_root", _bad(ebnf='rule ::= "a"'), "ebnf is not a valid EBNF grammar"),
    Refusal("two_constraints", _bad(regex=REGEX, ebnf=EBNF), "at most one of"),
    Refusal("chat.json_schema.invalid",
            chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuch"}}}),
            "json_schema is not a valid JSON schema"),
    Refusal("regex.unclosed.stream", generate({"regex": "["}, max_new_tokens=8, stream=True),
            "regex is not a valid regex"),
    # parsed only by the scheduler: its own compile error, aborted there with a 400
    Refusal("structural_tag.invalid", _bad(structural_tag='{"bad": 1}'), "structural_tag"),
]

#: a --grammar-backend none server refuses every kind but the DSL's select (which needs no grammar)
BACKEND_OFF_REASON = "--grammar-backend none"


def needs_grammar(case: Case) -> bool:
    return case.grammar[0] != "choice"  # select / gen(choices=...) score the choices by logprob


# --- running ------------------------------------------------------------------------------


def prefix_ok(grammar: tuple[str, str], text: str) -> bool | None:
    """Whether ``text`` is a prefix of a string the grammar accepts (None: cannot tell)."""
    kind, source = grammar
    if kind == "choice":
        return None
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]))
    compiled = {"regex": compiler.compile_regex, "ebnf": compiler.compile_grammar,
                "json": compiler.compile_json_schema}[kind](source)
    return xgr.GrammarMatcher(compiled, terminate_without_stop_token=True).accept_string(text)


def run_case(case: Case, url: str) -> tuple[bool, str]:
    """(passed, detail) for one constrained request."""
    reply = case.send(url)
    if reply.status != 200:
        return False, f"HTTP {reply.status}: {reply.text[:200]}"
    if not reply.finished:
        return False, f"unfinished at the token limit, valid prefix: {prefix_ok(case.grammar, reply.text)}"
    try:
        case.check(reply.text)
    except Exception as exc:  # noqa: BLE001 - any validator failure is the verdict
        return False, f"invalid: {type(exc).__name__}: {str(exc)[:200]}"
    return True, repr(reply.text)[:80]


def run_refusal(send: Callable[[str], Reply], reason: str | tuple[str, ...], url: str) -> tuple[bool, str]:
    """A 400 whose message contains ``reason`` (or one of them)."""
    reply = send(url)
    reasons = (reason,) if isinstance(reason, str) else reason
    ok = reply.status == 400 and any(r in reply.text for r in reasons)
    return ok, f"HTTP {reply.status}: {reply.text[:160]}"


def healthy(url: str) -> bool:
    try:
        return requests.get(url + "/health", timeout=30).status_code == 200
    except requests.RequestException:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--refusals", action="store_true", help="also send each bad request (expects 400s)")
    ap.add_argument("--backend-off", action="store_true", help="the server runs --grammar-backend none")
    args = ap.parse_args(argv)

    rows: list[tuple[str, bool, float, str]] = []

    def record(name: str, fn: Callable[[], tuple[bool, str]]) -> None:
        start = time.perf_counter()
        try:
            ok, detail = fn()
        except Exception as exc:  # noqa: BLE001 - a dead server is a failed row, not a traceback
            ok, detail = False, f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append((name, ok, time.perf_counter() - start, detail))
        print(f"{'ok  ' if ok else 'FAIL'} {name:28s} {rows[-1][2]:6.2f}s  {detail}", flush=True)

    for case in CASES:
        if args.backend_off and needs_grammar(case):
            record(case.name, lambda c=case: run_refusal(c.send, BACKEND_OFF_REASON, args.url))
        else:
            record(case.name, lambda c=case: run_case(c, args.url))
    if args.refusals:
        for ref in REFUSALS:
            reasons = (ref.reason, BACKEND_OFF_REASON) if args.backend_off else ref.reason
            record("refuse " + ref.name, lambda r=ref, why=reasons: run_refusal(r.send, why, args.url))
    record("health", lambda: (healthy(args.url), "/health"))
    failed = [name for name, ok, _, _ in rows if not ok]
    print(f"{len(rows) - len(failed)}/{len(rows)} passed" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
