"""Tool schemas from callables: type hints and Google-style docstrings, as transformers renders them."""

from __future__ import annotations

import enum
from typing import Any, Literal, Optional, Union

import pytest

from agentkv.toolschema import ToolSchemaError, function_schema, is_tool_schema, json_type, parse_docstring


class Custom:
    """A class no JSON schema describes."""


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


def get_weather(city: str, unit: Literal["c", "f"] = "c", days: int = 1) -> str:
    """Current weather in a city.

    Args:
        city: The city's name,
            as the user wrote it.
        unit: Temperature unit.
        days (int): How many days to forecast.

    Returns:
        A short report.
    """
    return "sunny"


def paint(colour: Colour, layers: list[int], tags: dict[str, str], note: Optional[str] = None,
          size: Union[int, float] = 1, point: tuple[int, str] = (0, "")) -> None:
    """Paint something.

    Args:
        colour: Which colour.
        layers: Layer thicknesses.
        tags: Free-form tags.
        note: An optional note.
        size: Size in any unit.
        point: Where.
    """


def drink(beverage: str) -> str:
    """Drink a beverage.

    Args:
        beverage: The beverage to drink (choices: ["tea", "coffee"])
    """
    return beverage


def test_schema_of_a_documented_function():
    """Name, summary, typed and described properties, and required arguments come out in OpenAI's tool form."""
    assert function_schema(get_weather) == {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city's name, as the user wrote it."},
            "unit": {"type": "string", "enum": ["c", "f"], "description": "Temperature unit."},
            "days": {"type": "integer", "description": "How many days to forecast."},
        }, "required": ["city"]}}}


@pytest.mark.parametrize("func", [get_weather, paint, drink])
def test_matches_transformers_get_json_schema(func):
    """The schema equals transformers' get_json_schema output, less its non-OpenAI "return" entry."""
    get_json_schema = pytest.importorskip("transformers.utils").get_json_schema
    expected = get_json_schema(func)
    expected["function"].pop("return", None)
    assert function_schema(func) == expected


@pytest.mark.parametrize(("hint", "schema"), [
    (Optional[int], {"type": "integer", "nullable": True}),
    (Union[int, str], {"type": ["integer", "string"]}),
    (int | None, {"type": "integer", "nullable": True}),
    (list[Literal[1, 2]], {"type": "array", "items": {"type": "integer", "enum": [1, 2]}}),
    (tuple[int, ...], {"type": "array", "items": {"type": "integer"}}),
    (dict, {"type": "object"}),
    (Any, {}),
    (Colour, {"type": "string", "enum": ["red", "blue"]}),
    (Union[list[int], str], {"anyOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "string"}]}),
])
def test_json_types(hint, schema):
    """Each supported type hint maps to the JSON schema a chat template expects."""
    assert json_type(hint) == schema


def test_docstring_choices_become_an_enum():
    """A trailing "(choices: [...])" in an argument's description becomes its enum."""
    prop = function_schema(drink)["function"]["parameters"]["properties"]["beverage"]
    assert prop == {"type": "string", "enum": ["tea", "coffee"], "description": "The beverage to drink"}


def test_missing_type_hint_is_an_error_naming_the_argument():
    """An argument without a type hint raises ToolSchemaError that names it and the tool."""
    def lookup(key, limit: int = 3) -> str:
        """Look up."""
        return key

    with pytest.raises(ToolSchemaError, match="'key' of tool 'lookup'"):
        function_schema(lookup)


def test_unsupported_type_is_an_error():
    """A custom class has no JSON schema: the error says to pass an explicit schema."""
    def use(thing: Custom) -> None:
        """Use a thing."""

    with pytest.raises(ToolSchemaError, match="explicit schema"):
        function_schema(use)


def test_self_and_variadic_parameters_are_skipped_and_undocumented_is_allowed():
    """A method's self, *args and **kwargs are left out; a function without a docstring still gets a schema."""
    class Box:
        def put(self, item: str, *rest: str, **extra: Any) -> None:
            pass

    assert function_schema(Box().put, name="box_put") == {"type": "function", "function": {
        "name": "box_put", "parameters": {"type": "object", "properties": {"item": {"type": "string"}},
                                          "required": ["item"]}}}


def test_parse_docstring_sections():
    """The summary stops at the first section; Args entries are read one per name, multi-line joined."""
    summary, args = parse_docstring(get_weather.__doc__)
    assert summary == "Current weather in a city."
    assert args == {"city": "The city's name, as the user wrote it.", "unit": "Temperature unit.",
                    "days": "How many days to forecast."}


def test_is_tool_schema():
    """Only a {"type": "function", "function": {"name": ...}} dict counts as a tool schema."""
    assert is_tool_schema(function_schema(drink))
    assert not is_tool_schema({"type": "function", "function": {}}) and not is_tool_schema(drink)
