"""Tool-call syntax of each template family read back into calls, schema-checked; the forcing
grammars compile; streamed text is held back only once a call may have begun."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.runtime.grammar import GrammarError, GrammarProcessor, json_grammar, lark_grammar
from engine.runtime.tokenizer import Tokenizer
from engine.server.host import RequestError
from engine.server.tools import (
    FAMILIES,
    CallStream,
    family_for,
    parse_tool_choice,
    parse_tools,
    prompt_ids,
)

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def tools() -> Any:
    return parse_tools(WEATHER)


@pytest.fixture(scope="module")
def tok(starter: dict[str, Any]) -> Tokenizer:
    return Tokenizer.load(Path(starter["path"]))


@pytest.mark.parametrize("family, text, content", [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 2}}\n</tool_call>', "Let me look."),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', ""),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
               '"days": 2}}', ""),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
                '"days": 2}}]', ""),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}', ""),
    ("harmony", '<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant'
                '<|channel|>commentary to=functions.get_weather <|constrain|>json'
                '<|message|>{"city": "Paris", "days": 2}', ""),
    ("gemma", "<start_function_call>call:get_weather{city:<escape>Paris<escape>,days:2}"
              "<end_function_call>", ""),
    ("gemma", '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>', ""),
])
def test_each_family_reads_its_calls(tools: Any, family: str, text: str, content: str) -> None:
    parsed = FAMILIES[family].parse(text, tools)
    assert parsed is not None, text
    got_content, calls = parsed
    assert got_content == content
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris",
                                                                       "days": 2})]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": 3}}\n</tool_call>',  # schema
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # unknown function
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # cut short
    "The weather is fine.",  # no call at all
])
def test_malformed_calls_are_not_calls(tools: Any, text: str) -> None:
    assert FAMILIES["hermes"].parse(text, tools) is None


def test_streamed_text_is_held_only_at_a_call(tools: Any) -> None:
    s = CallStream(FAMILIES["hermes"], tools)
    out = [s.feed(d) for d in ["Sure", ", checking <tool", "_call>\n", '{"name": "get_weather", ',
                               '"arguments": {"city": "Oslo"}}\n</tool_call>']]
    assert out == ["Sure", ", checking ", "", "", ""]
    rest, calls = s.finish()
    assert rest == "" and calls is not None and calls[0].arguments == {"city": "Oslo"}

    s = CallStream(FAMILIES["hermes"], tools)
    assert s.feed("a <tool") == "a "
    assert s.feed("box> here") == "<toolbox> here"  # the held "<tool" was no call
    assert s.finish() == ("", None)


def test_tool_choice_is_checked(tools: Any) -> None:
    assert parse_tool_choice(None, tools) == "auto"
    assert parse_tool_choice({"type": "function", "function": {"name": "get_weather"}},
                             tools) == "get_weather"
    with pytest.raises(RequestError, match="not in 'tools'"):
        parse_tool_choice({"type": "function", "function": {"name": "nope"}}, tools)
    with pytest.raises(RequestError, match="needs 'tools'"):
        parse_tool_choice("required", [])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_grammar_compiles(tools: Any, tok: Tokenizer, family: str) -> None:
    grammar = lark_grammar(FAMILIES[family].grammar(tools, tok))
    GrammarProcessor(tok, grammar)  # the matcher accepts it with the real vocabulary


def test_schema_limits_are_one_line(tok: Tokenizer) -> None:
    with pytest.raises(GrammarError, match="enum of 5000 values"):
        json_grammar({"enum": list(range(5000))})
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(60):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(GrammarError, match="nested too deep"):
        json_grammar(deep)
    with pytest.raises(GrammarError, match="Unimplemented keys"):
        json_grammar({"type": "object", "not": {}})


QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{%- for t in tools %}\n{{ t | tojson }}"
    "{%- endfor %}\n</tools>\nCall them in <tool_call></tool_call> tags.<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n{%- elif m.tool_calls %}<|im_start|>assistant"
    "{%- for c in m.tool_calls %}\n<tool_call>\n{{ {'name': c.function.name, 'arguments': "
    "c.function.arguments} | tojson }}\n</tool_call>{%- endfor %}<|im_end|>\n{%- else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_a_template_with_tools_gets_them_itself(tok: Tokenizer, tmp_path: Path,
                                                tools: Any) -> None:
    import json
    import shutil

    shutil.copy(tok.folder / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": QWEN_LIKE, "eos_token": "<|im_end|>"}))
    qwen = Tokenizer.load(tmp_path)
    assert qwen.template_knows_tools and not tok.template_knows_tools
    assert family_for(qwen).name == "hermes"
    history: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "name": "get_weather", "arguments": {"city": "Oslo"}}]},
               {"role": "tool", "content": "Rain", "tool_call_id": "c1", "name": "get_weather"}]
    text = qwen.decode(prompt_ids(qwen, history, tools))
    assert '"name": "get_weather", "description": "Weather for a city"' in text  # its listing
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    assert "<tool_response>\nRain\n</tool_response>" in text
    assert "You may call one or more functions" not in text  # not Strata's fallback text

    # The starter's template knows no tools: the Hermes convention is written in.
    fallback = tok.decode(prompt_ids(tok, history, tools))
    assert "You may call one or more functions" in fallback and "<tools>" in fallback
    assert "<tool_response>\nRain\n</tool_response>" in fallback
