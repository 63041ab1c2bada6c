"""Typed query parameters of the store's GET routes (``/api/rollouts``, ``/api/trajectories``, ...).

Each route takes one ``QueryModel`` subclass as ``Annotated[Model, Query()]``: FastAPI validates the
fields and, since the model forbids extra fields, refuses an unknown parameter (a 400 in the error shape
of ``openai_errors.py``). An empty value counts as absent; a repeated list parameter (``ids``) and a
comma-separated one mean the same."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator

from tracegym.gateway.traces.store.rollouts import STATUSES


def _json_integer(value: Any) -> Any:
    if isinstance(value, bool | str):
        raise ValueError(f"expected an integer, got a {'boolean' if isinstance(value, bool) else 'string'}")
    return value


def integer(lo: int, hi: int) -> Any:
    """An integer field of a JSON body within [lo, hi]: pydantic takes ``true``/``false`` for 1/0 and
    ``"5"`` for 5, this refuses them (an integral number such as ``5.0`` is still 5, as JSON Schema's ``integer`` allows). The
    published schema is spelled out: pydantic's own loses the bounds behind the validator."""
    return Annotated[int, BeforeValidator(_json_integer), Field(ge=lo, le=hi),
                     WithJsonSchema({"type": "integer", "minimum": lo, "maximum": hi})]


class QueryModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _empty_is_absent(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out: dict[str, Any] = {}
        for key, value in data.items():
            if isinstance(value, list):
                value = [part for v in value for part in str(v).split(",") if part != ""]
                if value:
                    out[key] = value
            elif value != "":
                out[key] = value
        return out


# How these query parameters are documented in /openapi.json (the checks stay where they were: the store's
# and the assembly's, each a 400 in the gateway's error shape).
Status = Annotated[str | None, WithJsonSchema({"type": "string", "enum": list(STATUSES)})]
Mode = Annotated[str, WithJsonSchema({"type": "string", "enum": ["merge", "per_call"], "default": "merge"})]
Time = Annotated[str | None, WithJsonSchema({"anyOf": [{"type": "string", "format": "date-time"}, {"type": "number"}],
                                             "description": "ISO-8601 or epoch seconds"})]
Names = Annotated[list[str] | None, WithJsonSchema({"type": "string",
                                                    "description": "comma-separated, or the parameter repeated"})]
