"""Tool calling: tool lists into the model's prompt, the model's call syntax back into calls.

Contract: `parse_tools` / `parse_tool_choice` read OpenAI's `tools` and `tool_choice` (the
Anthropic side converts its own shapes to these). `prompt_ids(tok, messages, tools)` renders
messages (with assistant `tool_calls` and `tool` results) through the model's template and its
`tools` variable; a template that does not read `tools` gets the Hermes convention written in
(tool list in the system turn, calls as <tool_call> JSON, results as <tool_response>), as
Ollama and LM Studio do. `family_for(tok)` picks the call syntax from the template: Hermes/Qwen
`<tool_call>{json}</tool_call>`, Llama 3 JSON (`<|python_tag|>`), Mistral `[TOOL_CALLS]`,
gpt-oss harmony (`to=functions.NAME ... <|message|>{json}`), Gemma (`call:NAME{...}`).
`Family.parse(text, tools)` returns the text outside calls and the calls, or None when the
text holds no call or a malformed one (unknown name, bad JSON, arguments that fail the
function's JSON schema): the caller then returns the text as it is. `Family.grammar(tools)` is
a Lark grammar that makes the model emit exactly one valid call (tool_choice required or
named). `CallStream` holds streamed text back once a call may have begun.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.runtime.grammar import GrammarError, json_grammar, lark_grammar, lark_json
from engine.runtime.tokenizer import Tokenizer
from engine.server.host import RequestError

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


def make_tool(name: Any, description: Any, parameters: Any, param: str) -> Tool:
    if not isinstance(name, str) or not _NAME.match(name):
        raise RequestError(f"{param}: a tool needs a name of 1-64 letters, digits, _ . -",
                           param=param)
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise RequestError(f"{param}: parameters must be a JSON schema object", param=param)
    try:
        json_grammar(parameters, f"{param} parameters")  # unsupported features: 400 now
    except GrammarError as exc:
        raise RequestError(str(exc), param=param) from exc
    return Tool(name, description if isinstance(description, str) else "", parameters)


def parse_tools(raw: Any, param: str = "tools") -> list[Tool]:
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise RequestError(f"'{param}' must be a list of at most {MAX_TOOLS} tools", param=param)
    tools = []
    for i, t in enumerate(raw):
        where = f"{param}[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" \
                or not isinstance(t.get("function"), dict):
            raise RequestError(f"{where}: only function tools are supported", param=where)
        f = t["function"]
        tools.append(make_tool(f.get("name"), f.get("description"), f.get("parameters"), where))
    if len({t.name for t in tools}) != len(tools):
        raise RequestError(f"'{param}' names a function twice", param=param)
    return tools


def parse_tool_choice(raw: Any, tools: list[Tool]) -> str:
    """'auto', 'none', 'required' or a function's name."""
    if raw is None:
        return "auto" if tools else "none"
    if raw in ("auto", "none", "required"):
        choice = str(raw)
    elif isinstance(raw, dict) and raw.get("type") == "function" \
            and isinstance(raw.get("function"), dict):
        choice = str(raw["function"].get("name"))
        if choice not in {t.name for t in tools}:
            raise RequestError(f"'tool_choice' names {choice!r}, which is not in 'tools'",
                               param="tool_choice")
    else:
        raise RequestError("'tool_choice' must be 'auto', 'none', 'required' or "
                           "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if choice != "none" and not tools:
        raise RequestError("'tool_choice' needs 'tools'", param="tool_choice")
    return choice


def chosen(tools: list[Tool], choice: str) -> list[Tool]:
    """The tools a constrained call may use (required: any; named: that one)."""
    return tools if choice == "required" else [t for t in tools if t.name == choice]


# -- prompts -------------------------------------------------------------------------------
def _hermes_system(tools: list[Tool]) -> str:
    listing = "\n".join(json.dumps(t.openai()) for t in tools)
    return ("You may call one or more functions to assist with the user query. The function "
            f"signatures are within <tools></tools> tags:\n<tools>\n{listing}\n</tools>\n"
            "For each function call, return a JSON object with the function name and "
            "arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _hermes_call(c: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]}) \
        + "\n</tool_call>"


def template_messages(tok: Tokenizer, messages: list[dict[str, Any]], tools: list[Tool]
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) as the template takes them. `messages` are role/content dicts, with
    `tool_calls` ([{id, name, arguments}]) on assistant turns and `tool_call_id`/`name` on
    tool results."""
    uses_calls = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if tok.template_knows_tools:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{"id": c["id"], "type": "function",
                                    "function": {"name": c["name"], "arguments": c["arguments"]}}
                                   for c in m["tool_calls"]]
            out.append(m)
        return out, [t.openai() for t in tools] or None
    if not tools and not uses_calls:
        return [{"role": m["role"], "content": m["content"]} for m in messages], None
    out = []
    for m in messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_results"):
                out[-1]["content"] += "\n" + text  # several results: one user turn
            else:
                out.append({"role": "user", "content": text, "_results": True})
            continue
        content = m["content"]
        if m.get("tool_calls"):
            content = "\n".join([content, *map(_hermes_call, m["tool_calls"])]).strip()
        out.append({"role": m["role"], "content": content})
    if tools:
        block = _hermes_system(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return [{"role": m["role"], "content": m["content"]} for m in out], None


def prompt_ids(tok: Tokenizer, messages: list[dict[str, Any]], tools: list[Tool]) -> list[int]:
    msgs, listed = template_messages(tok, messages, tools)
    return tok.encode_chat(msgs, tools=listed)


# -- families ------------------------------------------------------------------------------
def _valid(tools: list[Tool], name: Any, args: Any) -> ToolCall | None:
    import jsonschema

    tool = next((t for t in tools if t.name == name), None)
    if tool is None or not isinstance(args, dict):
        return None
    try:
        jsonschema.validate(args, tool.parameters)
    except (jsonschema.ValidationError, jsonschema.SchemaError):
        return None
    return ToolCall(tool.name, args)


def _load(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _gemma_args(body: str) -> Any:
    """Gemma's `{key:<escape>text<escape>,n:3}` (or plain JSON) to a dict."""
    direct = _load(body)
    if direct is not None:
        return direct
    strings: list[str] = []

    def keep(m: re.Match[str]) -> str:
        strings.append(m.group(2))
        return f"\x00{len(strings) - 1}\x00"

    body = re.sub(r'(<escape>|<\|"\|>)(.*?)\1', keep, body, flags=re.S)
    body = re.sub(r"([{,]\s*)([A-Za-z_][\w\-]*)\s*:", r'\1"\2":', body)
    body = re.sub(r"\x00(\d+)\x00", lambda m: json.dumps(strings[int(m.group(1))]), body)
    return _load(body)


@dataclass(frozen=True)
class Family:
    """One tool-call syntax: how calls open (for streaming) and how to read and force them."""

    name: str
    starts: tuple[str, ...]  # text that begins a call anywhere
    leading_json: bool = False  # a reply that opens with "{" is a call (Llama 3)

    def parse(self, text: str, tools: list[Tool]) -> tuple[str, list[ToolCall]] | None:
        raw = getattr(self, f"_parse_{self.name}")(text)
        if raw is None:
            return None
        content, pairs = raw
        calls = [_valid(tools, n, a) for n, a in pairs]
        if not pairs or any(c is None for c in calls):
            return None
        return content.strip(), [c for c in calls if c is not None]

    # each returns (content, [(name, arguments)]) or None
    def _parse_hermes(self, text: str) -> tuple[str, list[tuple[Any, Any]]] | None:
        if "<tool_call>" not in text:
            return None
        bodies = re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, flags=re.S)
        content = re.sub(r"<tool_call>.*?(?:</tool_call>|$)", "", text, flags=re.S)
        pairs = []
        for b in bodies:
            obj = _load(b.strip())
            if not isinstance(obj, dict):
                return None
            pairs.append((obj.get("name"), obj.get("arguments", obj.get("parameters"))))
        return content, pairs

    def _parse_llama3(self, text: str) -> tuple[str, list[tuple[Any, Any]]] | None:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return self._parse_hermes(text)
        pairs = []
        for part in re.split(r"\}\s*;\s*\{", body):
            part = part if part.startswith("{") else "{" + part
            part = part if part.endswith("}") else part + "}"
            obj = _load(part)
            if not isinstance(obj, dict):
                return None
            pairs.append((obj.get("name"), obj.get("parameters", obj.get("arguments"))))
        return "", pairs

    def _parse_mistral(self, text: str) -> tuple[str, list[tuple[Any, Any]]] | None:
        if "[TOOL_CALLS]" not in text:
            return None
        content, _, rest = text.partition("[TOOL_CALLS]")
        rest = rest.strip()
        if "[ARGS]" in rest:  # v11+: NAME[ARGS]{json} repeated
            pairs = []
            for chunk in rest.split("[TOOL_CALLS]"):
                name, _, args = chunk.partition("[ARGS]")
                pairs.append((name.strip(), _load(args.strip())))
            return content, pairs
        obj = _load(rest)
        if isinstance(obj, dict):
            obj = [obj]
        if not isinstance(obj, list) or not all(isinstance(o, dict) for o in obj):
            return None
        return content, [(o.get("name"), o.get("arguments", o.get("parameters"))) for o in obj]

    def _parse_harmony(self, text: str) -> tuple[str, list[tuple[Any, Any]]] | None:
        found = re.findall(r"to=functions\.([\w.\-]+)[^<]*(?:<\|constrain\|>\s*\w*\s*)?"
                           r"<\|message\|>(.*?)(?:<\|call\|>|<\|end\|>|$)", text, flags=re.S)
        if not found:
            return None
        final = re.findall(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|end\|>|$)", text,
                           flags=re.S)
        return "".join(final), [(n, _load(a.strip())) for n, a in found]

    def _parse_gemma(self, text: str) -> tuple[str, list[tuple[Any, Any]]] | None:
        pattern = (r"(?:<start_function_call>|<\|tool_call>)\s*call:([\w.\-]+)\s*(\{.*?\})\s*"
                   r"(?:<end_function_call>|<tool_call\|>|$)")
        found = re.findall(pattern, text, flags=re.S)
        if not found:
            return None
        content = re.sub(pattern, "", text, flags=re.S)
        return content, [(n, _gemma_args(a)) for n, a in found]

    # -- constrained: one call, nothing else ---------------------------------------------
    def grammar(self, tools: list[Tool], tok: Tokenizer) -> str:
        """Lark text whose every sentence is one valid call of one of `tools`."""
        def lit(s: str) -> str:
            if s in tok.specials:
                return f"<[{tok.specials[s]}]>"  # the token itself, not its text spelled out
            return json.dumps(s)

        rules, alts = [], []
        for i, t in enumerate(tools):
            args = t.parameters
            if self.name in ("hermes", "llama3", "mistral"):
                key = "parameters" if self.name == "llama3" else "arguments"
                body = lark_json({"type": "object", "properties": {
                    "name": {"const": t.name}, key: args}, "required": ["name", key],
                    "additionalProperties": False})
            else:
                body = lark_json(args)
            rules.append(f"call{i}: {body}")
            if self.name == "hermes":
                alts.append(f'{lit("<tool_call>")} "\\n" call{i} "\\n" {lit("</tool_call>")}')
            elif self.name == "llama3":
                alts.append(f"call{i}")
            elif self.name == "mistral":
                alts.append(f'{lit("[TOOL_CALLS]")} "[" call{i} "]"')
            elif self.name == "harmony":
                alts.append(f'{lit("<|channel|>")} "commentary to=functions.{t.name} " '
                            f'{lit("<|constrain|>")} "json" {lit("<|message|>")} call{i}')
            else:  # gemma
                opener = "<|tool_call>" if "<|tool_call>" in tok.specials \
                    else "<start_function_call>"
                closer = "<tool_call|>" if opener == "<|tool_call>" else "<end_function_call>"
                alts.append(f'{lit(opener)} "call:{t.name}" call{i} {lit(closer)}')
        return "start: " + " | ".join(alts) + "\n" + "\n".join(rules)


FAMILIES = {
    "hermes": Family("hermes", ("<tool_call>",)),
    "llama3": Family("llama3", ("<|python_tag|>", "<tool_call>"), leading_json=True),
    "mistral": Family("mistral", ("[TOOL_CALLS]",)),
    "harmony": Family("harmony", ("to=functions.", "<|channel|>commentary to=")),
    "gemma": Family("gemma", ("<start_function_call>", "<|tool_call>")),
}


def family_for(tok: Tokenizer) -> Family:
    """The call syntax the model's template teaches (Hermes when the template has none:
    that is the convention written into its prompt)."""
    src = str(tok.template_source or "") if tok.template_knows_tools else ""
    if "[TOOL_CALLS]" in src:
        return FAMILIES["mistral"]
    if "<|channel|>" in src or "<|constrain|>" in src:
        return FAMILIES["harmony"]
    if "<start_function_call>" in src or "<|tool_call>" in src:
        return FAMILIES["gemma"]
    if "<tool_call>" in src:
        return FAMILIES["hermes"]
    if "<|python_tag|>" in src or "ipython" in src:
        return FAMILIES["llama3"]
    return FAMILIES["hermes"]


class CallStream:
    """Streamed text with calls held back: `feed` returns what may go out now; `finish`
    returns (text not yet sent, calls or None)."""

    def __init__(self, family: Family, tools: list[Tool]) -> None:
        self.family, self.tools = family, tools
        self.text = ""
        self.sent = 0
        self.capturing = False

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.capturing:
            return ""
        rest = self.text[self.sent:]
        if self.family.leading_json and self.sent == 0:
            head = rest.lstrip()
            if not head or head[0] == "{" or "<|python_tag|>".startswith(head[:14]):
                if head.startswith("{") or head.startswith("<|python_tag|>"):
                    self.capturing = True
                return ""
        hits = [i for i in (rest.find(s) for s in self.family.starts) if i >= 0]
        if hits:
            self.capturing = True
            out = rest[: min(hits)]
        else:
            hold = 0
            for s in self.family.starts:
                for k in range(min(len(s) - 1, len(rest)), 0, -1):
                    if rest.endswith(s[:k]):
                        hold = max(hold, k)
                        break
            out = rest[: len(rest) - hold]
        self.sent += len(out)
        return out

    def finish(self) -> tuple[str, list[ToolCall] | None]:
        parsed = self.family.parse(self.text, self.tools) if self.capturing else None
        if parsed is not None:
            return "", parsed[1]
        rest = self.text[self.sent:]
        self.sent = len(self.text)
        return rest, None


class ToolUse:
    """One request's tools and tool_choice; learns the model's call syntax from its tokenizer
    (on the engine thread, before the reply starts)."""

    def __init__(self, tools: list[Tool], choice: str) -> None:
        self.tools, self.choice = tools, choice
        self.family = FAMILIES["hermes"]

    @property
    def active(self) -> bool:
        """Whether replies are read for calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return bool(self.tools) and self.choice not in ("none", "auto")

    def seen(self, tok: Tokenizer) -> None:
        self.family = family_for(tok)

    def grammar(self, tok: Tokenizer) -> str | None:
        """The grammar that forces one call (tool_choice required or named), else None."""


        if not self.forced:
            return None
        return lark_grammar(family_for(tok).grammar(chosen(self.tools, self.choice), tok),
                            "the tool call grammar")

    def stream(self) -> CallStream:
        return CallStream(self.family, self.tools)

    def parse(self, text: str) -> tuple[str, list[ToolCall] | None]:
        """(content, calls); calls None (content = all the text) when there is no valid call."""
        if not self.active:
            return text, None
        parsed = self.family.parse(text, self.tools)
        return (text, None) if parsed is None else parsed
