"""A corpus of output constraints of real-world shapes: JSON schemas (hand-written ones, and ones composed
from the field archetypes of common APIs: ids, names, emails, dates, prices, statuses, tags, addresses,
nested line items, nullable fields, `$ref`s, `anyOf`), regexes and choice lists. Deterministic."""

from __future__ import annotations

import random

# Field archetypes: (name, schema) as APIs write them.
FIELDS = [
    ("id", {"type": "string", "format": "uuid"}),
    ("user_id", {"type": "integer", "minimum": 1, "maximum": 10_000_000}),
    ("name", {"type": "string", "minLength": 1, "maxLength": 40}),
    ("email", {"type": "string", "format": "email", "maxLength": 40}),
    ("created_at", {"type": "string", "format": "date-time", "maxLength": 32}),  # else endless fractional seconds
    ("birthday", {"type": "string", "format": "date"}),
    # Amounts as integers (cents, percent), as payment APIs write them: a fraction's digits are unbounded in JSON,
    # and a small greedy model can write trailing zeros until max_tokens.
    ("price_cents", {"type": "integer", "minimum": 0, "maximum": 10_000_000}),
    ("discount_pct", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}),
    ("quantity", {"type": "integer", "minimum": 1, "maximum": 99}),
    ("status", {"enum": ["pending", "active", "suspended", "closed"]}),
    ("priority", {"type": "string", "enum": ["low", "medium", "high"]}),
    ("is_active", {"type": "boolean"}),
    ("tags", {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}),
    ("scores", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 10}, "minItems": 1,
                "maxItems": 5}),
    ("zip", {"type": "string", "pattern": "^[0-9]{5}$"}),
    ("phone", {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"}),
    ("sku", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}),
    ("currency", {"const": "USD"}),
    ("country", {"type": "string", "enum": ["US", "FR", "DE", "JP", "BR"]}),
    ("note", {"anyOf": [{"type": "string", "maxLength": 30}, {"type": "null"}]}),
    ("rating", {"type": ["integer", "null"], "minimum": 1, "maximum": 5}),
    ("url", {"type": "string", "format": "uri", "maxLength": 60}),
    ("ratio_pct", {"type": "integer", "minimum": -100, "maximum": 100}),
    ("color", {"type": "string", "pattern": "^#[0-9a-f]{6}$"}),
    ("version", {"type": "string", "pattern": "^[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}$"}),
]
ADDRESS = {"type": "object", "properties": {"street": {"type": "string", "maxLength": 30},
                                            "city": {"type": "string", "maxLength": 20},
                                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
           "required": ["street", "city"], "additionalProperties": False}

HAND_WRITTEN = [
    {"type": "object"},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "boolean"},
    {"type": "null"},
    {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}}, "required": ["answer"]},
    {"type": "object", "properties": {"city": {"type": "string"}, "temp_c": {"type": "number"},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
     "required": ["city", "temp_c", "unit"], "additionalProperties": False},
    # a tree two levels deep through $refs (an unbounded recursive one lets a small greedy model nest forever)
    {"$defs": {"leaf": {"type": "object", "properties": {"value": {"type": "integer"}}, "required": ["value"],
                        "additionalProperties": False},
               "node": {"type": "object", "properties": {"value": {"type": "integer"},
                                                          "children": {"type": "array", "maxItems": 2,
                                                                       "items": {"$ref": "#/$defs/leaf"}}},
                        "required": ["value"], "additionalProperties": False}},
     "$ref": "#/$defs/node"},
    {"type": "object", "properties": {"error": {"type": "object", "properties": {
        "code": {"type": "integer", "minimum": 400, "maximum": 599}, "message": {"type": "string", "maxLength": 40}},
        "required": ["code", "message"], "additionalProperties": False}}, "required": ["error"],
     "additionalProperties": False},
    {"anyOf": [{"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0}},
                "required": ["kind", "r"], "additionalProperties": False},
               {"type": "object", "properties": {"kind": {"const": "rect"}, "w": {"type": "number"},
                                                 "h": {"type": "number"}},
                "required": ["kind", "w", "h"], "additionalProperties": False}]},
    {"type": "array", "items": {"type": "object", "properties": {"sku": FIELDS[16][1], "qty": FIELDS[8][1]},
                                "required": ["sku", "qty"], "additionalProperties": False},
     "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"address": ADDRESS, "billing": {"$ref": "#/properties/address"}},
     "required": ["address"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "number"}}}}, "required": ["matrix"]},
    {"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "string", "maxLength": 25},
                                                "minItems": 2, "maxItems": 4},
                                      "final_answer": {"type": "integer"}},
     "required": ["steps", "final_answer"], "additionalProperties": False},
]

REGEXES = [
    r"[0-9]{3}-[0-9]{4}", r"(yes|no)", r"[A-Z][a-z]{2,8}", r"[0-9]+(\.[0-9]{1,2})?", r"[a-z]{1,12}@[a-z]{1,12}\.(com|org)",
    r"#[0-9a-f]{6}", r"(19|20)[0-9][0-9]-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", r"[A-Z]{2}[0-9]{6}",
    r"(true|false)", r"\$[0-9]{1,4}\.[0-9][0-9]", r"[a-z]{3,6}( [a-z]{3,6}){0,3}", r"v[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}",
    r"(low|medium|high) priority", r"[01]{8}", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", r"[A-Za-z0-9_]{4,12}",
    r"https://[a-z]{3,10}\.com/[a-z]{1,8}", r"-?[0-9]{1,3}", r"[aeiou]{2,5}", r"(ab|cd)+e",
    r"[0-9]{1,2}:[0-9][0-9] (AM|PM)", r"[A-Z]{3}", r"SKU-[0-9]{4}", r"[a-f0-9]{8}-[a-f0-9]{4}",
    r"(Mon|Tue|Wed|Thu|Fri|Sat|Sun)day?",
]
CHOICES = [
    ["positive", "negative", "neutral"], ["yes", "no"], ["red", "green", "blue", "yellow"], ["A", "B", "C", "D"],
    ["spam", "ham"], ["cat", "dog", "bird"], ["true", "false"], ["0", "1", "2", "3", "4", "5"],
    ["north", "south", "east", "west"], ["low", "medium", "high", "critical"], ["Paris", "London", "Tokyo"],
    ["buy", "sell", "hold"], ["small", "medium", "large"], ["en", "fr", "de", "ja"], ["ok"],
    ["approve", "reject", "escalate"], ["hot", "cold"], ["1st", "2nd", "3rd"], ["up", "down"], ["on", "off"],
]


def composed(seed: int) -> dict:
    """An object of 2-6 archetype fields, sometimes with a nested address, line items or a nullable field."""
    rng = random.Random(seed)
    fields = dict(rng.sample(FIELDS, rng.randint(2, 6)))
    shape = seed % 5
    if shape == 1:
        fields["address"] = ADDRESS
    elif shape == 2:
        fields["items"] = {"type": "array", "minItems": 1, "maxItems": 2,
                           "items": {"type": "object", "properties": {"sku": FIELDS[16][1], "quantity": FIELDS[8][1]},
                                     "required": ["sku", "quantity"], "additionalProperties": False}}
    elif shape == 3:
        return {"$defs": {"entry": {"type": "object", "properties": fields, "required": sorted(fields),
                                    "additionalProperties": False}},
                "type": "object", "properties": {"entries": {"type": "array", "items": {"$ref": "#/$defs/entry"},
                                                             "maxItems": 2}},
                "required": ["entries"], "additionalProperties": False}
    elif shape == 4:
        fields["meta"] = {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
            "source": {"enum": ["web", "app"]}}, "required": ["source"], "additionalProperties": False}]}
    required = sorted(rng.sample(sorted(fields), rng.randint(1, len(fields))))
    return {"type": "object", "properties": fields, "required": required, "additionalProperties": False}


def json_schemas(num_composed: int = 200) -> list[dict]:
    return HAND_WRITTEN + [composed(seed) for seed in range(num_composed)]
