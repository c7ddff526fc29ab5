"""The agent examples (examples/agent/): the calculator, the Python interpreter's limits and
network isolation, the guess-the-number environment and the BM25 search tool through the sandbox,
and their data."""
import asyncio
import importlib.util
import json
import os

import pytest

from verl_mcore.agent.sandbox import ToolSandbox
from verl_mcore.agent.tools import ToolCall
from verl_mcore.config.schema import AgentToolsConfig, EnvironmentConfig, SandboxConfig, ToolConfig
from verl_mcore.data.readers import read_file_rows

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "agent")


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"agent_example_{name}",
                                                  os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(name: str) -> list[dict]:
    return read_file_rows(os.path.join(EXAMPLES, "data", f"{name}.jsonl")).table.to_pylist()


def test_calculator():
    calc = _example("calculator").calculator
    assert calc("(504 + 383) - 25") == "862" and calc("54 / 6") == "9" and calc("7 / 2") == "3.5"
    assert calc("2 ** 10") == "1024" and calc("-3 * -(2 + 1)") == "9"
    assert calc("1 / 0") == "Error: division by zero"
    assert calc("9 ** 9 ** 9") == "Error: the power is too large to compute"
    assert calc("__import__('os').system('true')").startswith("Error: \"__import__('os')")
    assert calc("2 +") == "Error: '2 +' is not an arithmetic expression"


@pytest.fixture(scope="module")
def python_tool():
    return _example("python_tool")


def test_python_interpreter_limits(python_tool):
    run = python_tool.PythonInterpreter(timeout_s=3, max_memory_mb=256, max_output_bytes=1000)
    assert run("print(sum(range(10)))") == "45\n"
    assert run("x = 1") == "[the program printed nothing: use print()]"
    assert "ZeroDivisionError" in run("1 / 0")
    # A busy loop meets the CPU-time cap or, on a loaded machine, the wall-clock limit first.
    assert run("while True: pass").endswith(("[the program did not finish within 3 s and was stopped]",
                                             "[the program used more than 3 s of CPU]"))
    assert run("print('y' * 100000)").endswith("y\n[output stopped at 1000 bytes]")
    assert "MemoryError" in run("x = bytearray(1 << 30)")
    assert run("import os; print(sorted(os.environ))") == "['LC_CTYPE', 'PATH']\n"


@pytest.mark.parametrize("isolation", ["namespace", "audit_hook"])
def test_python_interpreter_has_no_network(python_tool, monkeypatch, isolation):
    if isolation == "namespace" and python_tool.network_isolation() != "namespace":
        pytest.skip("`unshare -rn` does not work on this machine")
    monkeypatch.setattr(python_tool, "network_isolation", lambda: isolation)
    run = python_tool.PythonInterpreter(timeout_s=5)
    code = ("import socket\n"
            "for host in ('127.0.0.1', '1.1.1.1'):\n"
            "    try:\n"
            "        socket.create_connection((host, 80), timeout=2)\n"
            "        print('connected', host)\n"
            "    except OSError as e:\n"
            "        print('refused', host, type(e).__name__, e)\n")
    out = run(code)
    assert "connected" not in out and out.count("refused") == 2, out
    if isolation == "audit_hook":
        assert "network access is disabled in this sandbox" in out


def test_guess_the_number_rules():
    game = _example("guess_number").GuessTheNumber(max_guesses=3)
    row = {"extra_info": {"target": 7, "low": 1, "high": 10}}
    assert game.reset(row).startswith("I am thinking of an integer from 1 to 10")
    assert game.step("I guess 5") == ("5 is too low: go higher. 2 guesses left.", 0.0, False)
    assert game.step("hmm") == ("That is not a number. Answer with one integer. 1 guess left.", 0.0, False)
    assert game.step("12") == ("12 is outside 1 to 10. No guesses left: the number was 7.", 0.0, True)
    game.reset(row)
    assert game.step("maybe 3, no: 7") == ("Correct! The number is 7.", 1.0, True)


@pytest.fixture(scope="module")
def examples_sandbox():
    cfg = AgentToolsConfig(
        tools=[ToolConfig(path=os.path.join(EXAMPLES, "calculator.py"), name="calculator"),
               ToolConfig(path=os.path.join(EXAMPLES, "search_tool.py"), name="CorpusSearch",
                          kwargs={"top_k": 2}),
               ToolConfig(path=os.path.join(EXAMPLES, "python_tool.py"), name="PythonInterpreter",
                          kwargs={"timeout_s": 5})],
        environment=EnvironmentConfig(path=os.path.join(EXAMPLES, "guess_number.py"),
                                      name="GuessTheNumber", kwargs={"max_guesses": 7}),
        sandbox=SandboxConfig(num_workers=2, timeout_s=20))
    with ToolSandbox.from_config(cfg) as sb:
        yield sb


def test_the_examples_schemas(examples_sandbox):
    schemas = {s["function"]["name"]: s["function"] for s in examples_sandbox.schemas}
    assert sorted(schemas) == ["CorpusSearch", "calculator", "python"]
    assert schemas["calculator"]["parameters"]["required"] == ["expression"]
    assert schemas["CorpusSearch"]["description"] == "Search the encyclopedia and return the best-matching articles."
    assert schemas["CorpusSearch"]["parameters"]["properties"]["query"]["type"] == "string"


def test_word_problems_are_solved_by_the_calculator(examples_sandbox):
    rows = _rows("word_problems")
    assert len(rows) >= 30 and {r["data_source"] for r in rows} == {"openai/gsm8k"}
    first = rows[0]  # "Fatima has 504 pencils. They buy 383 more ... give away 25."
    result = examples_sandbox.call_sync(ToolCall("calculator", {"expression": "504 + 383 - 25"}))
    assert (result.status, result.text) == ("ok", first["reward_model"]["ground_truth"])
    result = examples_sandbox.call_sync(ToolCall("python", {"code": "print(504 + 383 - 25)"}))
    assert result.text == "862\n"


def test_every_search_question_is_answered_by_its_top_results(examples_sandbox):
    rows = _rows("search_questions")
    assert len(rows) >= 16
    with open(os.path.join(EXAMPLES, "data", "corpus.jsonl")) as f:
        assert len([json.loads(line) for line in f]) >= 30
    for row in rows:
        question = row["prompt"][0]["content"].split("?")[0]
        found = examples_sandbox.call_sync(ToolCall("CorpusSearch", {"query": question}))
        assert found.status == "ok" and row["reward_model"]["ground_truth"] in found.text, question
    none = examples_sandbox.call_sync(ToolCall("CorpusSearch", {"query": "zzzz qqqq"}))
    assert none.text == "No article matches 'zzzz qqqq'. Try other keywords."


def test_a_game_through_the_sandbox(examples_sandbox):
    row = _rows("guess_number")[0]
    target, high = row["extra_info"]["target"], row["extra_info"]["high"]

    async def play():  # a binary search, as a model that follows the hints would
        async with examples_sandbox.session() as game:
            await game.reset(row)
            low, top, rewards = 1, high, []
            while True:
                guess = (low + top) // 2
                step = await game.step(f"My guess: {guess}")
                rewards.append(step.reward)
                if step.done:
                    return step, rewards
                low, top = (guess + 1, top) if "go higher" in step.observation else (low, guess - 1)

    step, rewards = asyncio.run(play())
    assert step.observation == f"Correct! The number is {target}." and rewards[-1] == 1.0
    assert sum(rewards) == 1.0


def test_the_search_reward_reads_the_final_answer_only():
    score = _example("rewards").contains_answer
    response = ("<tool_call>{...}</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n"
                "[Mount Selk] ... 1,208 metres high.\n</tool_response><|im_end|>\n"
                "<|im_start|>assistant\nIt is 1208 metres high.")
    assert score("agent/veltar_search", response, "1,208") == 1.0
    assert score("agent/veltar_search", response.replace("1208", "1200"), "1,208") == 0.0
    assert score("agent/veltar_search", "orrin", "Orrin") == 1.0
