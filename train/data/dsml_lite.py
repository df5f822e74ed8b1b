"""Parser of V4.1 assistant completions (spec chat-and-serving.md §2.7, §3.1) for checking
the trained model's tool calls; strict: the V4.1 spelling only, no recovery.

    parse_completion(text, thinking) -> {"reasoning", "content", "calls": [{"name", "arguments"}], "error"}
    check_completion(text, tools, thinking) -> (ok, detail)

`text` is what the model generated after the prompt (decoded bytes as str). In thinking
mode it must contain "</think>" before anything else counts. A tool block is
"<｜DSML｜ calls>" ... "</｜DSML｜ calls>" with invokes and parameters; string="true" values
are raw strings, string="false" values must be JSON; text after the block closer is
ignored (the server stops generating there). check_completion wants at least one
call, every call naming one of `tools` and its arguments valid against that tool's
`parameters` schema (jsonschema_lite).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jsonschema_lite  # noqa: E402

BAR = "\uff5c"
DSML = BAR + "DSML" + BAR
OPEN = "<" + DSML + " calls>"
CLOSE = "</" + DSML + " calls>"
INVOKE = "<" + DSML + ' invoke name="'
INVOKE_END = "</" + DSML + " invoke>"
PARAM = "<" + DSML + ' parameter name="'
PARAM_END = "</" + DSML + " parameter>"
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"


class DsmlError(ValueError):
    pass


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def parse_block(s: str, i: int) -> Tuple[List[Dict[str, Any]], int]:
    """Parses a block starting at s[i] == OPEN; returns (calls, index after CLOSE)."""
    if not s.startswith(OPEN, i):
        raise DsmlError("no block opener")
    i += len(OPEN)
    calls = []
    while True:
        i = _skip_ws(s, i)
        if s.startswith(CLOSE, i):
            return calls, i + len(CLOSE)
        if not s.startswith(INVOKE, i):
            raise DsmlError(f"expected invoke or block closer at {s[i:i + 40]!r}")
        i += len(INVOKE)
        j = s.find('">', i)
        if j < 0:
            raise DsmlError("unterminated invoke header")
        name = s[i:j]
        i = j + 2
        args: Dict[str, Any] = {}
        while True:
            i = _skip_ws(s, i)
            if s.startswith(INVOKE_END, i):
                i += len(INVOKE_END)
                break
            if not s.startswith(PARAM, i):
                raise DsmlError(f"expected parameter or invoke closer at {s[i:i + 40]!r}")
            i += len(PARAM)
            j = s.find('" string="', i)
            if j < 0:
                raise DsmlError("parameter without string attribute")
            key = s[i:j]
            i = j + len('" string="')
            if s.startswith('true">', i):
                is_str = True
                i += len('true">')
            elif s.startswith('false">', i):
                is_str = False
                i += len('false">')
            else:
                raise DsmlError("string attribute must be true or false")
            j = s.find(PARAM_END, i)
            if j < 0:
                raise DsmlError("unterminated parameter value")
            raw = s[i:j]
            i = j + len(PARAM_END)
            if key in args:
                raise DsmlError(f"duplicate parameter {key!r}")
            if is_str:
                args[key] = raw
            else:
                try:
                    args[key] = json.loads(raw)
                except ValueError:
                    raise DsmlError(f"parameter {key!r}: string=\"false\" value is not JSON: {raw[:40]!r}")
        calls.append({"name": name, "arguments": args})


def parse_completion(text: str, thinking: bool) -> Dict[str, Any]:
    out: Dict[str, Any] = {"reasoning": "", "content": "", "calls": [], "error": None}
    rest = text
    if thinking:
        if rest.startswith("<think>"):
            rest = rest[len("<think>"):]
        k = rest.find("</think>")
        if k < 0:
            out["error"] = "thinking never closed"
            out["reasoning"] = rest
            return out
        out["reasoning"] = rest[:k]
        rest = rest[k + len("</think>"):]
    k = rest.find(OPEN)
    if k < 0:
        out["content"] = rest.replace(EOS, "")
        return out
    out["content"] = rest[:k].rstrip()
    try:
        calls, end = parse_block(rest, k)
    except DsmlError as e:
        out["error"] = str(e)
        return out
    out["calls"] = calls
    out["tail"] = rest[end:]  # the server stops at the block closer; whatever follows is never seen
    return out


def tool_schemas(tools: List[Dict[str, Any]]) -> Dict[str, Any]:
    out = {}
    for t in tools:
        fn = t.get("function", t)
        out[fn["name"]] = fn.get("parameters", {"type": "object"})
    return out


def check_completion(text: str, tools: List[Dict[str, Any]], thinking: bool) -> Tuple[bool, str]:
    r = parse_completion(text, thinking)
    if r["error"]:
        return False, r["error"]
    if not r["calls"]:
        return False, "no tool call"
    schemas = tool_schemas(tools)
    for c in r["calls"]:
        if c["name"] not in schemas:
            return False, f"unknown tool {c['name']!r}"
        errs = jsonschema_lite.validate(c["arguments"], schemas[c["name"]])
        if errs:
            return False, f"{c['name']}: {errs[0]}"
    return True, ",".join(c["name"] for c in r["calls"])
