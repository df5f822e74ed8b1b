"""A small JSON Schema validator for the subset the synthetic tool schemas use.

Keywords: type (string or list; "integer" excludes booleans and accepts integral floats
only when they are ints in Python, as json.loads gives them), properties, required,
additionalProperties (bool or schema), enum, const, items, minItems, maxItems, minimum,
maximum, minLength, maxLength, anyOf. Unknown keywords (description, default, ...) are
ignored, as JSON Schema says.

validate(instance, schema) returns a list of error strings (empty: valid).
"""
from __future__ import annotations

from typing import Any, List


def _type_ok(v: Any, t: str) -> bool:
    if t == "object":
        return isinstance(v, dict)
    if t == "array":
        return isinstance(v, list)
    if t == "string":
        return isinstance(v, str)
    if t == "boolean":
        return isinstance(v, bool)
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool)
    if t == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if t == "null":
        return v is None
    raise ValueError(f"unknown JSON Schema type {t!r}")


def _eq(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def validate(inst: Any, schema: Any, path: str = "$") -> List[str]:
    if schema is True or schema == {}:
        return []
    if schema is False:
        return [f"{path}: no value allowed"]
    errs: List[str] = []
    t = schema.get("type")
    if t is not None:
        ts = t if isinstance(t, list) else [t]
        if not any(_type_ok(inst, x) for x in ts):
            return [f"{path}: expected {'/'.join(ts)}, got {type(inst).__name__}"]
    if "enum" in schema and not any(_eq(inst, e) for e in schema["enum"]):
        errs.append(f"{path}: {inst!r} not in enum {schema['enum']!r}")
    if "const" in schema and not _eq(inst, schema["const"]):
        errs.append(f"{path}: {inst!r} != const {schema['const']!r}")
    if "anyOf" in schema and not any(not validate(inst, s, path) for s in schema["anyOf"]):
        errs.append(f"{path}: matches no anyOf alternative")
    if isinstance(inst, dict):
        props = schema.get("properties", {})
        for k in schema.get("required", []):
            if k not in inst:
                errs.append(f"{path}: missing required property {k!r}")
        addl = schema.get("additionalProperties", True)
        for k, v in inst.items():
            if k in props:
                errs += validate(v, props[k], f"{path}.{k}")
            elif addl is False:
                errs.append(f"{path}: unexpected property {k!r}")
            elif isinstance(addl, dict):
                errs += validate(v, addl, f"{path}.{k}")
    if isinstance(inst, list):
        if "items" in schema:
            for i, v in enumerate(inst):
                errs += validate(v, schema["items"], f"{path}[{i}]")
        if "minItems" in schema and len(inst) < schema["minItems"]:
            errs.append(f"{path}: fewer than {schema['minItems']} items")
        if "maxItems" in schema and len(inst) > schema["maxItems"]:
            errs.append(f"{path}: more than {schema['maxItems']} items")
    if isinstance(inst, str):
        if "minLength" in schema and len(inst) < schema["minLength"]:
            errs.append(f"{path}: shorter than {schema['minLength']}")
        if "maxLength" in schema and len(inst) > schema["maxLength"]:
            errs.append(f"{path}: longer than {schema['maxLength']}")
    if isinstance(inst, (int, float)) and not isinstance(inst, bool):
        if "minimum" in schema and inst < schema["minimum"]:
            errs.append(f"{path}: {inst} < minimum {schema['minimum']}")
        if "maximum" in schema and inst > schema["maximum"]:
            errs.append(f"{path}: {inst} > maximum {schema['maximum']}")
    return errs
