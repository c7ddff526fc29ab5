"""Tool calls parsed from model text: the hermes format, its malformed cases as ParseErrors, and
a user's parser named in the config."""
import pytest

from verl_mcore.agent.parsers import load_parser, parse_error_result, parse_hermes
from verl_mcore.agent.tools import ToolCall
from verl_mcore.config.schema import UserFunctionConfig


def test_several_calls_and_string_arguments():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
            '"1 + 2"}}\n</tool_call>\n<tool_call>{"name": "search", "arguments": "{\\"query\\": '
            '\\"x\\"}"}</tool_call><tool_call>{"name": "now"}</tool_call> done')
    turn = parse_hermes(text)
    assert [(c.name, c.arguments) for c in turn.calls] == [
        ("calculator", {"expression": "1 + 2"}), ("search", {"query": "x"}), ("now", {})]
    assert turn.errors == [] and turn.content == "Let me compute.\n\n done"
    assert turn.calls[0].text.startswith("<tool_call>\n{") and turn.calls[0].text.endswith("</tool_call>")
    assert parse_hermes("no calls here").calls == []


@pytest.mark.parametrize("text, message", [
    ('<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>', "the call is not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'the call has no "name"'),
    ('<tool_call>{"name": 3}</tool_call>', 'the call has no "name"'),
    ('<tool_call>["f"]</tool_call>', "the call must be a JSON object"),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '"arguments" must be a JSON object'),
    ('<tool_call>{"name": "f", "arguments": "{x"}</tool_call>', '"arguments" is a string that is not valid JSON'),
    ('<tool_call>{"name": "f", "arguments": {}}', "a <tool_call> is not closed by </tool_call>"),
    ('{"name": "f"}</tool_call>', "a </tool_call> closes no <tool_call>"),
])
def test_malformed_calls_are_parse_errors(text, message):
    turn = parse_hermes(text)
    assert turn.calls == [] and len(turn.errors) == 1
    assert turn.errors[0].message.startswith(message)
    result = parse_error_result(turn.errors[0])
    assert result.status == "parse_error"
    assert result.text.startswith(f"Error: the tool call could not be parsed: {message}")


def test_an_unclosed_call_before_a_good_one():
    turn = parse_hermes('<tool_call>{"name": "a"} <tool_call>{"name": "b"}</tool_call>')
    assert turn.calls == [] and "not closed by </tool_call> before the next one" in turn.errors[0].message
    turn = parse_hermes('<tool_call>{"name": "a"}</tool_call> then <tool_call>{"name": "b"')
    assert [c.name for c in turn.calls] == ["a"] and len(turn.errors) == 1


def test_a_long_bad_call_is_quoted_cut():
    turn = parse_hermes("<tool_call>" + "x" * 1000 + "</tool_call>")
    assert len(turn.errors[0].text) == 203 and turn.errors[0].text.endswith("...")


def test_parser_from_config(tmp_path):
    assert load_parser(UserFunctionConfig(name="hermes"), "agent.parser") is parse_hermes
    with pytest.raises(ValueError, match=r"agent.parser.name='json' is not a built-in parser \(\['hermes'\]\)"):
        load_parser(UserFunctionConfig(name="json"), "agent.parser")
    path = tmp_path / "my_parser.py"
    path.write_text(
        "from verl_mcore.agent.tools import ToolCall\n"
        "from verl_mcore.agent.parsers import ParseError\n"
        "def parse(text, prefix='CALL '):\n"
        "    out = []\n"
        "    for line in text.splitlines():\n"
        "        if line.startswith(prefix):\n"
        "            name, _, arg = line[len(prefix):].partition(' ')\n"
        "            out.append(ToolCall(name, {'x': arg}) if name else ParseError('no name', line))\n"
        "    return out\n"
        "def broken(text):\n"
        "    return 'nope'\n")
    parser = load_parser(UserFunctionConfig(path=str(path), name="parse", kwargs={"prefix": "DO "}),
                         "agent.parser")
    turn = parser("DO f 1\nsay\nDO \n")
    assert turn.calls == [ToolCall("f", {"x": "1"})] and turn.errors[0].message == "no name"
    broken = load_parser(UserFunctionConfig(path=str(path), name="broken"), "agent.parser")
    with pytest.raises(TypeError, match=r"agent.parser .*my_parser.py:broken returned str"):
        broken("x")
    with pytest.raises(ValueError, match=r"parse\(text, prefix='CALL '\) cannot be called as "
                                            r"parse\(text, y=...\)"):
        load_parser(UserFunctionConfig(path=str(path), name="parse", kwargs={"y": 1}), "agent.parser")
