"""Data the benchmarks ship with: JSON schemas for the structured workloads and the Hugging Face
configs of models that run with dummy weights.

Kept as Python so an installed package carries them without package-data settings and without
the repository's `benchmarks/` folder.
"""

from __future__ import annotations

import copy
from typing import Any

# Structured-output schemas by name; the json workloads use DEFAULT_SCHEMA_NAME unless told.
# Bounds on lengths and counts keep valid outputs well inside 128 tokens.
_SCHEMAS: dict[str, dict[str, Any]] = {
    "structured_schema_1": {
        "title": "UserProfile",
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "email": {
                "type": "string",
                "pattern": "^[a-z0-9._]{1,10}@[a-z0-9]{1,8}\\.(com|org|net)$",
            },
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "is_active": {"type": "boolean"},
            "role": {"type": "string", "enum": ["admin", "editor", "viewer", "guest"]},
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string", "minLength": 1, "maxLength": 12},
                    "city": {"type": "string", "minLength": 1, "maxLength": 10},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["street", "city", "zip"],
                "additionalProperties": False,
            },
            "tags": {
                "type": "array",
                "items": {"type": "string", "minLength": 1, "maxLength": 8},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["name", "email", "age", "is_active", "role", "address", "tags"],
        "additionalProperties": False,
    },
    "structured_schema_2": {
        "title": "Order",
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
            "customer": {"type": "string", "minLength": 1, "maxLength": 20},
            "status": {
                "type": "string",
                "enum": ["pending", "paid", "shipped", "delivered", "cancelled"],
            },
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 20},
                        "unit_price": {"type": "number", "minimum": 0},
                    },
                    "required": ["sku", "quantity", "unit_price"],
                    "additionalProperties": False,
                },
            },
            "express": {"type": "boolean"},
            "notes": {"type": ["string", "null"], "maxLength": 40},
        },
        "required": ["order_id", "customer", "status", "items", "express", "notes"],
        "additionalProperties": False,
    },
    "structured_schema_3": {
        "title": "CalendarEvent",
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 1, "maxLength": 30},
            "date": {
                "type": "string",
                "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$",
            },
            "start_time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
            "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
            "location": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "room": {"type": "string", "maxLength": 12},
                            "floor": {"type": "integer", "minimum": 0, "maximum": 50},
                        },
                        "required": ["room", "floor"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {
                            "url": {
                                "type": "string",
                                "pattern": "^https://[a-z0-9.]{3,30}/[a-z0-9]{1,12}$",
                            },
                        },
                        "required": ["url"],
                        "additionalProperties": False,
                    },
                ]
            },
            "attendees": {
                "type": "array",
                "items": {"type": "string", "maxLength": 16},
                "maxItems": 4,
            },
            "priority": {"type": "string", "enum": ["low", "normal", "high"]},
        },
        "required": [
            "title", "date", "start_time", "duration_minutes", "location", "attendees", "priority",
        ],
        "additionalProperties": False,
    },
    "structured_schema_4": {
        "title": "WeatherReport",
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 20},
            "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
            "humidity_percent": {"type": "integer", "minimum": 0, "maximum": 100},
            "condition": {
                "type": "string",
                "enum": ["sunny", "cloudy", "rain", "snow", "fog", "storm"],
            },
            "wind": {
                "type": "object",
                "properties": {
                    "speed_kmh": {"type": "number", "minimum": 0, "maximum": 300},
                    "direction": {
                        "type": "string",
                        "enum": ["N", "NE", "E", "SE", "S", "SW", "W", "NW"],
                    },
                },
                "required": ["speed_kmh", "direction"],
                "additionalProperties": False,
            },
            "alerts": {
                "type": "array",
                "items": {"type": "string", "maxLength": 24},
                "maxItems": 2,
            },
        },
        "required": ["city", "temperature_c", "humidity_percent", "condition", "wind", "alerts"],
        "additionalProperties": False,
    },
}
SCHEMA_NAMES: tuple[str, ...] = tuple(_SCHEMAS)
DEFAULT_SCHEMA_NAME = "structured_schema_1"

# Hugging Face config.json contents by model name; weights come from --load-format dummy.
_MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "pad_token_id": 151643,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
}
MODEL_CONFIG_NAMES: tuple[str, ...] = tuple(_MODEL_CONFIGS)


def builtin_schema(name: str = DEFAULT_SCHEMA_NAME) -> dict[str, Any]:
    """A fresh copy of a shipped schema (callers may mutate it). Raises KeyError if unknown."""
    return copy.deepcopy(_SCHEMAS[name])


def model_config(name: str) -> dict[str, Any]:
    """A fresh copy of a shipped model config. Raises KeyError if unknown."""
    return copy.deepcopy(_MODEL_CONFIGS[name])
