"""Tools: what the model calls, what comes back, and how a tool declares its arguments.

A tool is a function, or a class whose instances are called, in a user's Python file, named in
the config like every other user object (config ToolConfig: path, name, kwargs):

    def calculator(expression: str) -> str:
        '''Evaluate an arithmetic expression.

        Args:
            expression: the expression, e.g. "(3 + 4) * 2"
        '''

Its schema is OpenAI's: {"type": "function", "function": {"name", "description", "parameters":
{"type": "object", "properties": {...}, "required": [...]}}}. It is the config's `schema`, else
the object's `schema` attribute, else derived here from the signature's annotations (str, int,
float, bool, list[...], dict, Optional[...], Literal[...]) and the docstring (its first paragraph
describes the tool, its "Args:" section the parameters). A function's config kwargs go to every
call and are no part of the schema; a class is constructed with them once per sandbox worker.

Start-up (load_tools): each file is imported in a probe process (user_code.check_import), where
the schema is resolved and checked against the signature and a class is constructed once, so a
bad file, a missing name or an invalid schema fail before any model is built, naming the file
and the tool. The probe returns the schema: the trainer never imports a tool's file.

Each call's arguments are checked against the schema before the call (check_arguments): a
missing required key, an unknown key or a wrong type is a `bad_arguments` result the model reads,
not a crash.
"""
from __future__ import annotations

import collections.abc
import inspect
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from verl_mcore.user_code import check_import, load_user_object

# What a call can come to. ok: the tool's text; error: it raised, or its worker died; timeout:
# no result within the sandbox's timeout_s; unknown_tool / bad_arguments: refused before any
# call; parse_error: the model's text held no well-formed call.
Status = Literal["ok", "error", "timeout", "unknown_tool", "bad_arguments", "parse_error"]
STATUSES: tuple[str, ...] = typing.get_args(Status)

# OpenAI's rule for function names; also what keeps a metric name safe.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_JSON_TYPES = ("string", "integer", "number", "boolean", "array", "object", "null")
_PY_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
             dict: "object", type(None): "null"}


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: the tool's name and its JSON arguments; `text` is the
    call as the model wrote it (for logs)."""

    name: str
    arguments: dict = field(default_factory=dict)
    text: str = ""


@dataclass(frozen=True)
class ToolResult:
    """What a call came to: `text` (the observation the model reads), `status` (STATUSES),
    `seconds` spent, `tool` the name called (as the model wrote it), `detail` more for the logs
    (a traceback) that the model does not see."""

    text: str
    status: Status
    seconds: float = 0.0
    tool: str = ""
    detail: str = ""


@dataclass(frozen=True)
class ToolSpec:
    """A loaded tool, picklable to the sandbox workers: `name` the model calls it by; `key` the
    config key (agent.tools[0]); `path` / `attr` / `kwargs` what the worker loads; `kind`
    "function" or "class"; `schema` resolved and checked."""

    name: str
    key: str
    path: str
    attr: str
    kwargs: dict
    kind: str
    schema: dict

    @property
    def label(self) -> str:
        return f"{self.key} {self.path}:{self.attr}"

    def load(self):
        """In a sandbox worker: the callable (a function with its kwargs bound, or an instance)."""
        obj = load_user_object(self.path, self.attr, self.key)
        if self.kind == "class":
            return obj(**self.kwargs)
        kwargs = self.kwargs
        return lambda **arguments: obj(**arguments, **kwargs)


class ToolSchemaError(ValueError):
    """A tool's schema is invalid, or does not fit its function's signature."""


# ------------------------------------------------------------------ schemas

def check_schema(schema: Any, where: str) -> dict:
    """`schema` checked for the shape OpenAI's tools take; raises ToolSchemaError naming `where`
    and the field."""
    if not isinstance(schema, dict) or schema.get("type") != "function" \
            or not isinstance(schema.get("function"), dict):
        raise ToolSchemaError(f"{where}: a tool schema is {{'type': 'function', 'function': "
                              f"{{'name', 'description', 'parameters'}}}}, got {schema!r:.200}")
    fn = schema["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolSchemaError(f"{where}: function.name={name!r} must be 1-64 letters, digits, "
                              "'_' or '-'")
    if not isinstance(fn.get("description", ""), str):
        raise ToolSchemaError(f"{where}: function.description must be a string")
    params = fn.get("parameters", {"type": "object"})
    _check_type_schema(params, f"{where}: function.parameters")
    params = dict(params, properties=params.get("properties", {}),
                  required=params.get("required", []))
    if params.get("type") != "object":
        raise ToolSchemaError(f"{where}: function.parameters must have type 'object' (the "
                              f"arguments are a JSON object), got {params.get('type')!r}")
    missing = [k for k in params.get("required", []) if k not in params.get("properties", {})]
    if missing:
        raise ToolSchemaError(f"{where}: function.parameters.required names {missing}, which "
                              "are not in its properties")
    return {"type": "function", "function": dict(fn, parameters=params)}


def _check_type_schema(node: Any, where: str) -> None:
    if not isinstance(node, dict):
        raise ToolSchemaError(f"{where} must be a JSON-schema object, got {node!r:.120}")
    types = node.get("type")
    for t in (types if isinstance(types, list) else [types] if types is not None else []):
        if t not in _JSON_TYPES:
            raise ToolSchemaError(f"{where}: type {t!r} is not a JSON type {list(_JSON_TYPES)}")
    if types is None and "enum" not in node and "anyOf" not in node:
        raise ToolSchemaError(f"{where}: give a 'type' (one of {list(_JSON_TYPES)}), an 'enum' "
                              "or an 'anyOf'")
    if "enum" in node and not isinstance(node["enum"], list):
        raise ToolSchemaError(f"{where}: enum must be a list")
    for i, option in enumerate(node.get("anyOf", [])):
        _check_type_schema(option, f"{where}.anyOf[{i}]")
    if "items" in node:
        _check_type_schema(node["items"], f"{where}.items")
    properties = node.get("properties", {})
    if not isinstance(properties, dict):
        raise ToolSchemaError(f"{where}: properties must be a mapping of name to schema")
    for k, v in properties.items():
        _check_type_schema(v, f"{where}.properties.{k}")
    required = node.get("required", [])
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        raise ToolSchemaError(f"{where}: required must be a list of property names")


def derive_schema(fn: Any, name: str, skip: tuple[str, ...] = (), doc: Optional[str] = None,
                  where: str = "") -> dict:
    """The schema of calling `fn` with JSON arguments: one property per parameter except `skip`
    (the config's kwargs) and *args / **kwargs, required when it has no default; types from the
    annotations; descriptions from the docstring (`doc`, default fn's)."""
    doc = inspect.cleandoc(doc if doc is not None else (inspect.getdoc(fn) or ""))
    description, arg_docs = _parse_docstring(doc)
    if not description:
        raise ToolSchemaError(f"{where}: {name} has no docstring to describe it to the model: "
                              "write one (its first paragraph describes the tool, an 'Args:' "
                              "section the parameters) or give the schema")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # an annotation naming what the file does not import
        raise ToolSchemaError(f"{where}: the annotations of {name} cannot be resolved ({e}): "
                              "fix them or give the schema") from None
    properties, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.name in skip or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name not in hints:
            raise ToolSchemaError(f"{where}: parameter {p.name!r} of {name} has no type "
                                  "annotation: annotate it (str, int, float, bool, list[...], "
                                  "dict, Optional[...], Literal[...]) or give the schema")
        prop = _json_schema_of(hints[p.name], f"{where}: parameter {p.name!r} of {name}")
        if p.name in arg_docs:
            prop["description"] = arg_docs[p.name]
        properties[p.name] = prop
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


def _json_schema_of(tp: Any, where: str) -> dict:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in _PY_TYPES:
        return {"type": _PY_TYPES[tp]}
    if origin is Literal:
        kinds = sorted({_PY_TYPES[type(a)] for a in args})
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X, or null
            inner = _json_schema_of(options[0], where)
            return {"anyOf": [inner, {"type": "null"}]}
        return {"anyOf": [_json_schema_of(a, where) for a in args]}
    if origin in (list, tuple, collections.abc.Sequence):
        node = {"type": "array"}
        if args and args[0] is not Ellipsis:
            node["items"] = _json_schema_of(args[0], where)
        return node
    if origin is dict or tp is typing.Any:
        return {"type": "object"} if origin is dict else {}
    raise ToolSchemaError(f"{where}: annotation {tp!r} has no JSON type: use str, int, float, "
                          "bool, list[...], dict, Optional[...] or Literal[...], or give the schema")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(the first paragraph, {parameter: description}) of a Google-style ("Args:") or
    Sphinx-style (":param x:") docstring."""
    first = doc.split("\n\n")[0].strip()
    if re.match(r"(Args|Arguments|Parameters):|:param ", first):
        first = ""
    args: dict[str, str] = {}
    current: Optional[str] = None
    section_indent: Optional[int] = None  # inside "Args:": the entries' indentation
    for line in doc.splitlines():
        stripped, indent = line.strip(), len(line) - len(line.lstrip())
        sphinx = re.match(r":param\s+(?:\w+\s+)?(\w+):\s*(.*)", stripped)
        if sphinx:
            current, section_indent = sphinx.group(1), None
            args[current] = sphinx.group(2)
        elif re.fullmatch(r"(Args|Arguments|Parameters):", stripped):
            current, section_indent = None, -1
        elif not stripped:
            continue
        elif section_indent is not None and indent == 0:  # the next section
            current, section_indent = None, None
        elif section_indent is not None and section_indent in (-1, indent):
            entry = re.match(r"(\w+)\s*(?:\([^)]*\))?:\s*(.*)", stripped)
            if entry:
                section_indent, current = indent, entry.group(1)
                args[current] = entry.group(2)
        elif current is not None and indent > 0:  # a description's next line
            args[current] += " " + stripped
    return " ".join(first.split()), {k: " ".join(v.split()) for k, v in args.items()}


def resolve_schema(obj: Any, name: str, kwargs: dict, given: dict, where: str) -> tuple[str, dict]:
    """(kind, schema) of the tool object `obj` (config name `name`): a function or a class,
    its schema given / its `schema` attribute / derived, checked, and checked to fit the
    signature that will be called."""
    if inspect.isclass(obj):
        # Its instances' __call__ (getattr on the class would give type.__call__).
        call = next((vars(k)["__call__"] for k in obj.__mro__
                     if k is not object and "__call__" in vars(k)), None)
        kind = "class"
        if not callable(call):
            raise ToolSchemaError(f"{where}: class {name} has no __call__ method: its instances "
                                  "are what the model calls")
        fit = inspect.signature(call)
        fit = fit.replace(parameters=list(fit.parameters.values())[1:])  # less `self`
    elif callable(obj):
        kind, call, fit = "function", obj, inspect.signature(obj)
    else:
        raise ToolSchemaError(f"{where}: {name} is an object of type {type(obj).__name__}, not a "
                              "function or a class")
    if given:
        schema = given
    elif isinstance(getattr(obj, "schema", None), dict):
        schema = obj.schema
    else:
        # A function's config kwargs are not the model's; a class's __call__ has `self` first.
        skip = tuple(kwargs) if kind == "function" else (next(iter(inspect.signature(call).parameters)),)
        # A class: its __call__'s own docstring, else the class's (not inspect.getdoc, which
        # would find object's "Call self as a function." for a __call__ without one).
        doc = (call.__doc__ or obj.__doc__ or "") if kind == "class" else None
        schema = derive_schema(call, name, skip=skip, doc=doc, where=where)
    schema = check_schema(schema, where)
    _check_fits(fit, schema, kwargs if kind == "function" else {}, name, where)
    return kind, schema


def _check_fits(signature: inspect.Signature, schema: dict, kwargs: dict, name: str,
                where: str) -> None:
    """Every property can be passed by keyword, and the required ones (plus a function's config
    kwargs) are enough to call it."""
    params = schema["function"]["parameters"]
    accepts_any = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
    keywords = {p.name for p in signature.parameters.values()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    extra = [k for k in params.get("properties", {}) if k not in keywords and not accepts_any]
    if extra:
        raise ToolSchemaError(f"{where}: the schema's properties {extra} are not parameters of "
                              f"{name}{signature}")
    clash = [k for k in params.get("properties", {}) if k in kwargs]
    if clash:
        raise ToolSchemaError(f"{where}: {clash} are both schema properties (the model's "
                              "arguments) and config kwargs")
    try:
        signature.bind(**{k: None for k in params.get("required", [])}, **kwargs)
    except TypeError as e:
        raise ToolSchemaError(f"{where}: {name}{signature} cannot be called with the schema's "
                              f"required arguments {params.get('required', [])} and the config "
                              f"kwargs {sorted(kwargs)}: {e}") from None


def check_tool(obj: Any, key: str, path: str, name: str, kwargs: dict, schema: dict,
               construct: bool = False) -> dict:
    """The import probe's check of a tool (user_code.check_import): its resolved kind and schema,
    JSON-serialisable; a class is constructed once with its kwargs when `construct`."""
    where = f"{key}.name={name!r} in {path}"
    kind, resolved = resolve_schema(obj, name, kwargs, schema, where)
    if kind == "class" and construct:
        try:
            obj(**kwargs)
        except Exception as e:
            raise ToolSchemaError(f"{where}: constructing {name}(**{key}.kwargs) raised "
                                  f"{type(e).__name__}: {e}") from None
    return {"kind": kind, "schema": resolved}


def load_tools(configs: list, key: str) -> list[ToolSpec]:
    """ToolSpecs of the config's tools (`key`: "agent.tools"), each file imported and checked in
    a probe process first (check_tool). Two tools of one name fail, naming both."""
    specs: list[ToolSpec] = []
    for i, cfg in enumerate(configs):
        item = f"{key}[{i}]"
        found = check_import(cfg.path, cfg.name, item, cfg.import_timeout_s,
                             f"{item}.import_timeout_s",
                             check=(check_tool, (item, cfg.path, cfg.name, dict(cfg.kwargs),
                                                 dict(cfg.schema))))
        schema = found["schema"]
        tool = schema["function"]["name"]
        same = [s for s in specs if s.name == tool]
        if same:
            raise ToolSchemaError(f"{item} ({cfg.path}:{cfg.name}) and {same[0].label} are both "
                                  f"named {tool!r}: the model could not tell them apart")
        specs.append(ToolSpec(tool, item, os.path.abspath(os.path.expanduser(cfg.path)),
                              cfg.name, dict(cfg.kwargs), found["kind"], schema))
    return specs


# ------------------------------------------------------------------ arguments

def check_arguments(schema: dict, arguments: Any) -> Optional[str]:
    """None when `arguments` fit the tool's schema, else what is wrong, in words the model can
    act on ("missing required argument 'x'", "'n' must be an integer, got "3" (a string)")."""
    params = schema["function"]["parameters"]
    if not isinstance(arguments, dict):
        return f"the arguments must be a JSON object, got {_describe(arguments)}"
    return _check_value(params, arguments, "arguments", top=True)


def _check_value(node: dict, value: Any, where: str, top: bool = False) -> Optional[str]:
    if "anyOf" in node:
        problems = [_check_value(option, value, where) for option in node["anyOf"]]
        if all(problems):
            return problems[0]
    if "enum" in node and value not in node["enum"]:
        return f"{where} must be one of {node['enum']}, got {_describe(value)}"
    types = node.get("type")
    if types is not None:
        types = types if isinstance(types, list) else [types]
        if not any(_is_type(value, t) for t in types):
            return f"{where} must be {' or '.join(_article(t) for t in types)}, got {_describe(value)}"
    if isinstance(value, dict) and "properties" in node:
        props = node["properties"]
        for k in node.get("required", []):
            if k not in value:
                return f"missing required argument {k!r}" if top else f"{where} lacks key {k!r}"
        # The arguments themselves become keyword arguments: an unknown one is refused unless
        # the schema allows more; inside them, only where it says additionalProperties: false.
        unknown = [k for k in value if k not in props]
        if unknown and node.get("additionalProperties", not top) is False:
            known = ", ".join(repr(k) for k in props) or "none"
            return (f"unknown argument {unknown[0]!r} (the arguments are {known})" if top
                    else f"{where} has an unknown key {unknown[0]!r}")
        for k, v in value.items():
            if k in props:
                problem = _check_value(props[k], v, repr(k) if top else f"{where}.{k}")
                if problem:
                    return problem
    if isinstance(value, list) and "items" in node:
        for i, v in enumerate(value):
            problem = _check_value(node["items"], v, f"{where}[{i}]")
            if problem:
                return problem
    return None


def _is_type(value: Any, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool) or (
            isinstance(value, float) and value.is_integer())
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return {"string": str, "boolean": bool, "array": list, "object": dict,
            "null": type(None)}[t] is type(value)


def _article(t: str) -> str:
    return {"integer": "an integer", "array": "an array", "object": "an object",
            "null": "null"}.get(t, f"a {t}")


def _describe(value: Any) -> str:
    kind = {str: "a string", bool: "a boolean", int: "an integer", float: "a number",
            list: "an array", dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
    text = repr(value) if not isinstance(value, str) else '"' + value + '"'
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({kind})"
