"""Twenty varied JSON schemas (with a prompt each) shared by the grammar unit and end-to-end tests.

Strings carry ``maxLength`` so a small model cannot ramble past ``max_tokens`` inside one.
"""

from __future__ import annotations

S = {"type": "string", "maxLength": 20}

CASES: list[tuple[str, dict]] = [
    (
        "a person",
        {
            "type": "object",
            "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"],
        },
    ),
    (
        "a city",
        {
            "type": "object",
            "properties": {"city": S, "country": S, "population": {"type": "integer", "minimum": 0}},
            "required": ["city", "country", "population"],
        },
    ),
    (
        "a colour choice",
        {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    ),
    (
        "a rating",
        {
            "type": "object",
            "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": S},
            "required": ["stars", "comment"],
        },
    ),
    (
        "a temperature",
        {
            "type": "object",
            "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60}},
            "required": ["celsius"],
        },
    ),
    (
        "a shopping list",
        {
            "type": "object",
            "properties": {"items": {"type": "array", "items": S, "minItems": 1, "maxItems": 4}},
            "required": ["items"],
        },
    ),
    (
        "a book",
        {
            "type": "object",
            "properties": {
                "title": S,
                "author": {"type": "object", "properties": {"first": S, "last": S}, "required": ["first", "last"]},
                "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
            },
            "required": ["title", "author", "year"],
        },
    ),
    (
        "a yes/no answer",
        {
            "type": "object",
            "properties": {"answer": {"type": "boolean"}, "reason": S},
            "required": ["answer", "reason"],
        },
    ),
    (
        "three numbers",
        {"type": "array", "items": {"type": "integer", "minimum": -100, "maximum": 100}, "minItems": 3, "maxItems": 3},
    ),
    ("a traffic light state", {"enum": ["red", "amber", "green"]}),
    (
        "an order",
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1},
                "lines": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 10}},
                        "required": ["sku", "qty"],
                    },
                },
            },
            "required": ["id", "lines"],
        },
    ),
    (
        "a point",
        {
            "type": "object",
            "properties": {
                "x": {"type": "number", "minimum": 0, "maximum": 1},
                "y": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        },
    ),
    (
        "an optional nickname",
        {
            "type": "object",
            "properties": {"name": S, "nickname": {"type": ["string", "null"], "maxLength": 10}},
            "required": ["name", "nickname"],
        },
    ),
    (
        "a pet",
        {
            "type": "object",
            "properties": {
                "pet": {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {"kind": {"const": "dog"}, "barks": {"type": "boolean"}},
                            "required": ["kind", "barks"],
                        },
                        {
                            "type": "object",
                            "properties": {
                                "kind": {"const": "cat"},
                                "lives": {"type": "integer", "minimum": 1, "maximum": 9},
                            },
                            "required": ["kind", "lives"],
                        },
                    ]
                }
            },
            "required": ["pet"],
        },
    ),
    (
        "a version",
        {
            "type": "object",
            "properties": {"version": {"type": "string", "pattern": "^[0-9]{1,2}\\.[0-9]{1,2}\\.[0-9]{1,2}$"}},
            "required": ["version"],
        },
    ),
    (
        "a tree",
        {
            "$defs": {
                "leaf": {
                    "type": "object",
                    "properties": {"value": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["value"],
                }
            },
            "type": "object",
            "properties": {"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/$defs/leaf"}},
            "required": ["left", "right"],
        },
    ),
    (
        "a matrix",
        {
            "type": "array",
            "minItems": 2,
            "maxItems": 2,
            "items": {
                "type": "array",
                "minItems": 2,
                "maxItems": 2,
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
            },
        },
    ),
    (
        "a weather report",
        {
            "type": "object",
            "properties": {
                "sky": {"enum": ["sunny", "cloudy", "rainy"]},
                "wind_kmh": {"type": "integer", "minimum": 0, "maximum": 200},
                "humid": {"type": "boolean"},
            },
            "required": ["sky", "wind_kmh", "humid"],
        },
    ),
    ("a short label", {"type": "string", "minLength": 1, "maxLength": 12}),
    (
        "a status with tags",
        {
            "type": "object",
            "properties": {
                "status": {"enum": ["open", "closed"]},
                "tags": {"type": "array", "items": {"enum": ["bug", "ui", "docs"]}, "maxItems": 3},
                "priority": {"type": "integer", "minimum": 1, "maximum": 3},
            },
            "required": ["status", "tags", "priority"],
        },
    ),
]
