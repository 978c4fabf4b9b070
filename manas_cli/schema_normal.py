"""A JSON Schema put in the form llguidance compiles, without changing which values it accepts.

- An integer-valued float where a count belongs (`maxItems: 2.0`) is that integer: JSON Schema counts 2.0 as an
  integer (draft 2020-12, section 4.2.2), llguidance refuses it.
- A `oneOf` whose branches provably exclude each other is an `anyOf`: where no value can match two branches,
  "exactly one" and "at least one" accept the same values. llguidance proves some cases itself; these rules add
  the common ones: branches of different types, of different `const`/`enum` values, an object branch requiring a
  property another forbids, and object branches that require one property with values that exclude each other (a
  tagged union, as pydantic writes one). A `oneOf` none of them proves is left as it is, and the first such one is
  named (`overlap`) for the error llguidance's refusal becomes.

Only keywords that hold schemas are walked: a `const`, `enum` or `default` value is data, never rewritten."""

from __future__ import annotations

import json

COUNTS = (
    "maxItems",
    "minItems",
    "maxLength",
    "minLength",
    "maxProperties",
    "minProperties",
    "maxContains",
    "minContains",
)
SCHEMA = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames")
SCHEMA += ("unevaluatedItems", "unevaluatedProperties", "additionalItems")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
TYPES = ("null", "boolean", "object", "array", "number", "string")  # "integer" is within "number"


def normalized(schema: object, path: str = "#") -> tuple[object, str | None]:
    """The schema normalized, and the path of its first `oneOf` whose branches are not proven exclusive (None)."""
    if not isinstance(schema, dict):
        return schema, None
    out, overlap = dict(schema), None
    for key in COUNTS:
        if isinstance(out.get(key), float) and out[key].is_integer():
            out[key] = int(out[key])
    for key in SCHEMA:
        if key in out:
            out[key], found = normalized(out[key], f"{path}/{key}")
            overlap = overlap or found
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            pairs = [normalized(branch, f"{path}/{key}/{i}") for i, branch in enumerate(out[key])]
            out[key] = [branch for branch, _ in pairs]
            overlap = overlap or next((found for _, found in pairs if found), None)
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            pairs = {name: normalized(value, f"{path}/{key}/{name}") for name, value in out[key].items()}
            out[key] = {name: value for name, (value, _) in pairs.items()}
            overlap = overlap or next((found for _, found in pairs.values() if found), None)
    if isinstance(out.get("oneOf"), list):
        branches = out["oneOf"]
        pairs = ((i, j) for i in range(len(branches)) for j in range(i + 1, len(branches)))
        unproven = next(((i, j) for i, j in pairs if not excluded(branches[i], branches[j])), None)
        if unproven is None and "anyOf" not in out:
            out["anyOf"] = out.pop("oneOf")
        elif unproven is not None:
            overlap = overlap or f"{path}/oneOf's branches {unproven[0]} and {unproven[1]}"
    return out, overlap


def excluded(a: object, b: object) -> bool:
    """Whether no value can match both schemas, by the rules above (False: not proven)."""
    if a is False or b is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    types_a, types_b = types(a), types(b)
    if types_a is not None and types_b is not None and not types_a & types_b:
        return True
    values_a, values_b = values(a), values(b)
    if values_a is not None and values_b is not None and not values_a & values_b:
        return True
    return types_a == {"object"} and types_b == {"object"} and (_tagged_apart(a, b) or _forbids(a, b) or _forbids(b, a))


def types(schema: dict) -> set[str] | None:
    """The JSON types a schema's values can have (integer counted as number), or None where any."""
    if "const" in schema or isinstance(schema.get("enum"), list):
        return {_type_of(value) for value in values_list(schema)}
    declared = schema.get("type")
    declared = [declared] if isinstance(declared, str) else declared
    if not isinstance(declared, list) or not all(isinstance(name, str) for name in declared):
        return None
    return {"number" if name == "integer" else name for name in declared if name in (*TYPES, "integer")}


def values(schema: dict) -> set[str] | None:
    """A `const`'s or `enum`'s values (as canonical JSON, 1 and 1.0 alike), or None where not finite."""
    if "const" not in schema and not isinstance(schema.get("enum"), list):
        return None
    return {_canonical(value) for value in values_list(schema)}


def values_list(schema: dict) -> list:
    return [schema["const"]] if "const" in schema else schema["enum"]


def _forbids(a: dict, b: dict) -> bool:
    """a requires a property that b, an object schema, cannot have."""
    for name in _required(a):
        properties = b.get("properties") if isinstance(b.get("properties"), dict) else {}
        if properties.get(name) is False:
            return True
        if b.get("additionalProperties") is False and name not in properties and not b.get("patternProperties"):
            return True
    return False


def _tagged_apart(a: dict, b: dict) -> bool:
    """Both require a property whose values, by the two schemas, exclude each other (a tagged union)."""
    required = _required(a) & _required(b)
    properties_a, properties_b = (s.get("properties") if isinstance(s.get("properties"), dict) else {} for s in (a, b))
    return any(
        name in properties_a and name in properties_b and excluded(properties_a[name], properties_b[name])
        for name in required
    )


def _required(schema: dict) -> set[str]:
    names = schema.get("required")
    return {name for name in names if isinstance(name, str)} if isinstance(names, list) else set()


def _type_of(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", dict: "object", list: "array"}.get(type(value), "string")


def _canonical(value: object) -> str:
    """JSON text that is equal exactly where JSON Schema's equality holds (1 == 1.0; true != 1)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{_canonical(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_canonical(v) for v in value) + "]"
    return json.dumps(value)
