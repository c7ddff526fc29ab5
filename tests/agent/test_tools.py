"""Tool schemas: derived from signatures and docstrings, or given; checked at start-up in a probe
process, naming the file and the tool; arguments checked against them before each call."""
import textwrap
from typing import Literal, Optional

import pytest

from verl_mcore.agent.tools import (ToolSchemaError, check_arguments, check_schema, derive_schema,
                                    load_tools)
from verl_mcore.config.schema import ToolConfig
from verl_mcore.user_code import UserCodeError


def search(query: str, top_k: int = 3, fields: Optional[list[str]] = None,
           mode: Literal["fast", "exact"] = "fast", api_key: str = "") -> str:
    """Search the corpus for documents.

    More text that is not the description.

    Args:
        query: the keywords
        top_k (int): how many documents,
            at most 10
        fields: which fields to search
        mode: how to match

    Returns:
        the documents
    """


def sphinx(x: float, flag: bool = False):
    """Scale a number.

    :param x: the number
    :param flag: whether to do it
    """


def test_derived_schema_from_signature_and_docstring():
    schema = derive_schema(search, "search", skip=("api_key",))
    assert schema == {"type": "function", "function": {
        "name": "search", "description": "Search the corpus for documents.",
        "parameters": {"type": "object", "required": ["query"], "properties": {
            "query": {"type": "string", "description": "the keywords"},
            "top_k": {"type": "integer", "description": "how many documents, at most 10"},
            "fields": {"anyOf": [{"type": "array", "items": {"type": "string"}},
                                 {"type": "null"}], "description": "which fields to search"},
            "mode": {"type": "string", "enum": ["fast", "exact"], "description": "how to match"},
        }}}}
    assert check_schema(schema, "here") == schema
    props = derive_schema(sphinx, "sphinx")["function"]["parameters"]["properties"]
    assert props == {"x": {"type": "number", "description": "the number"},
                     "flag": {"type": "boolean", "description": "whether to do it"}}


def test_arguments_checked_against_the_schema():
    schema = derive_schema(search, "search", skip=("api_key",))
    assert check_arguments(schema, {"query": "a", "top_k": 2, "fields": None, "mode": "exact"}) is None
    assert check_arguments(schema, {"query": "a", "fields": ["title"]}) is None
    assert check_arguments(schema, ["a"]) == 'the arguments must be a JSON object, got [\'a\'] (an array)'
    assert check_arguments(schema, {"top_k": 1}) == "missing required argument 'query'"
    assert check_arguments(schema, {"query": "a", "top_k": "2"}) == \
        "'top_k' must be an integer, got \"2\" (a string)"
    assert check_arguments(schema, {"query": "a", "top_k": True}) == \
        "'top_k' must be an integer, got True (a boolean)"
    assert check_arguments(schema, {"query": "a", "fields": [1]}) == \
        "'fields'[0] must be a string, got 1 (an integer)"
    assert check_arguments(schema, {"query": "a", "mode": "slow"}) == \
        "'mode' must be one of ['fast', 'exact'], got \"slow\" (a string)"
    assert check_arguments(schema, {"query": "a", "api_key": "x"}).startswith(
        "unknown argument 'api_key'")


def _file(tmp_path, source: str) -> str:
    path = tmp_path / "tools.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


GOOD = '''
    def add(a: int, b: int, scale: int = 1) -> int:
        """Add two numbers."""
        return (a + b) * scale


    class Lookup:
        """Look a word up."""

        def __init__(self, table=None):
            self.table = table or {}

        def __call__(self, word: str) -> str:
            return self.table.get(word, "?")


    def given(**kwargs):
        return str(kwargs)
'''


def test_load_tools_probes_and_resolves(tmp_path):
    path = _file(tmp_path, GOOD)
    explicit = {"type": "function", "function": {"name": "free_form", "description": "Anything.",
                                                  "parameters": {"type": "object", "properties": {
                                                      "x": {"type": "string"}}}}}
    specs = load_tools([ToolConfig(path=path, name="add", kwargs={"scale": 2}),
                        ToolConfig(path=path, name="Lookup", kwargs={"table": {"a": "b"}}),
                        ToolConfig(path=path, name="given", schema=explicit)], "agent.tools")
    assert [(s.name, s.kind, s.key) for s in specs] == [
        ("add", "function", "agent.tools[0]"), ("Lookup", "class", "agent.tools[1]"),
        ("free_form", "function", "agent.tools[2]")]
    # the function's config kwargs are no part of its schema
    assert specs[0].schema["function"]["parameters"]["required"] == ["a", "b"]
    assert "scale" not in specs[0].schema["function"]["parameters"]["properties"]
    assert specs[1].schema["function"]["description"] == "Look a word up."
    assert specs[2].schema["function"]["parameters"]["required"] == []
    assert specs[0].load()(a=1, b=2) == 6 and specs[1].load()(word="a") == "b"


@pytest.mark.parametrize("source, name, kwargs, error, message", [
    ("def f(:\n", "f", {}, UserCodeError, r"agent.tools\[0\].path=.*tools.py.*SyntaxError"),
    ("def f(x: int):\n    '''F.'''\n", "g", {}, UserCodeError,
     r"agent.tools\[0\].name='g': .*tools.py defines no such name \(it defines \['f'\]\)"),
    ("def f(x):\n    '''F.'''\n", "f", {}, UserCodeError,
     r"agent.tools\[0\].name='f' in .*tools.py: parameter 'x' of f has no type annotation"),
    ("def f(x: int):\n    pass\n", "f", {}, UserCodeError, r"f has no docstring to describe it"),
    ("def f(x: object):\n    '''F.'''\n", "f", {}, UserCodeError, r"annotation <class 'object'> has no JSON type"),
    ("def f(x: int):\n    '''F.'''\n", "f", {"y": 1}, UserCodeError,
     r"f\(x: int\) cannot be called with the schema's required arguments \['x'\] and the config kwargs \['y'\]"),
    ("class C:\n    '''C.'''\n", "C", {}, UserCodeError, r"class C has no __call__ method"),
    ("class C:\n    def __init__(self, n):\n        raise ValueError('n is bad')\n"
     "    def __call__(self, x: int):\n        '''C.'''\n", "C", {"n": 1}, UserCodeError,
     r"constructing C\(\*\*agent.tools\[0\].kwargs\) raised ValueError: n is bad"),
    ("def f(x: int):\n    '''F.'''\nf.schema = {'type': 'function', 'function': {'name': 'has space'}}\n",
     "f", {}, UserCodeError, r"function.name='has space' must be 1-64 letters"),
    ("def f(x: int):\n    '''F.'''\nf.schema = {'type': 'function', 'function': {'name': 'f', "
     "'parameters': {'type': 'object', 'properties': {'x': {'type': 'int'}}}}}\n",
     "f", {}, UserCodeError, r"function.parameters.properties.x: type 'int' is not a JSON type"),
    ("def f(x: int):\n    '''F.'''\nf.schema = {'type': 'function', 'function': {'name': 'f', "
     "'parameters': {'type': 'object', 'properties': {'y': {'type': 'string'}}}}}\n",
     "f", {}, UserCodeError, r"the schema's properties \['y'\] are not parameters of f\(x: int\)"),
])
def test_start_up_failures_name_the_file_and_the_tool(tmp_path, source, name, kwargs, error, message):
    path = _file(tmp_path, source)
    with pytest.raises(error, match=message):
        load_tools([ToolConfig(path=path, name=name, kwargs=kwargs)], "agent.tools")


def test_two_tools_of_one_name(tmp_path):
    path = _file(tmp_path, GOOD)
    with pytest.raises(ToolSchemaError, match=r"agent.tools\[1\] \(.*:add\) and agent.tools\[0\] "
                                              r".*:add are both named 'add'"):
        load_tools([ToolConfig(path=path, name="add"), ToolConfig(path=path, name="add")],
                   "agent.tools")
