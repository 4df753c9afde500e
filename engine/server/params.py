"""Request fields into engine terms, shared by the OpenAI and Anthropic surfaces.

Contract: each reader takes the parsed JSON body and returns the engine's value, or raises a
RequestError (400) naming the field: sampling settings, max tokens, stop strings, logprobs,
`response_format` as a grammar (engine.runtime.grammar; an unsupported schema feature is one
400), and chat messages as the role/content dicts chat templates take (assistant `tool_calls`
and `tool` results kept for engine.server.tools). `text_size` counts a request's characters for
the refusal before tokenizing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from engine.errors import StrataError
from engine.runtime.grammar import GrammarError, json_grammar
from engine.runtime.sampling import SamplingParams
from engine.runtime.tokenizer import Tokenizer
from engine.server.host import MAX_TOP_LOGPROBS, Host, RequestError
from engine.server.tools import Tool, prompt_ids

MAX_STOPS = 16


def model_of(host: Host, body: dict[str, Any]) -> str:
    """The library name of the body's `model` (the server's default when absent)."""
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise RequestError("'model' must be a string", param="model")
    return str(host.resolve(name or None)["name"])


def number(body: dict[str, Any], key: str, default: float, integer: bool = False) -> Any:
    value = body.get(key)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise RequestError(f"'{key}' must be {'an integer' if integer else 'a number'}",
                           param=key)
    return value


def sampling(body: dict[str, Any], default_temperature: float = 1.0) -> SamplingParams:
    for key in ("frequency_penalty", "presence_penalty"):
        if number(body, key, 0.0) != 0:
            raise RequestError(f"'{key}' is not supported; use 'repetition_penalty'", param=key)
    seed = body.get("seed")
    if seed is not None:
        seed = number(body, "seed", 0, integer=True)
    params = SamplingParams(
        temperature=float(number(body, "temperature", default_temperature)),
        top_p=float(number(body, "top_p", 1.0)),
        top_k=int(number(body, "top_k", 0, integer=True)),
        min_p=float(number(body, "min_p", 0.0)),
        repetition_penalty=float(number(body, "repetition_penalty", 1.0)),
        seed=seed,
    )
    try:
        return params.validate()
    except StrataError as exc:
        raise RequestError(str(exc)) from exc


def max_tokens(body: dict[str, Any], default: int | None,
               keys: tuple[str, ...] = ("max_completion_tokens", "max_tokens")) -> int | None:
    key = next((k for k in keys if body.get(k) is not None), None)
    if key is None:
        return default
    value = number(body, key, 0, integer=True)
    if value < 1:
        raise RequestError(f"'{key}' must be at least 1", param=key)
    return int(value)


def stop_strings(body: dict[str, Any], key: str = "stop") -> tuple[str, ...]:
    stop = body.get(key)
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) \
            or len(stop) > MAX_STOPS:
        raise RequestError(f"'{key}' must be a string or a list of at most {MAX_STOPS} strings",
                           param=key)
    return tuple(s for s in stop if s)


def top_logprobs(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) \
            or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise RequestError(f"'{key}' must be an integer from 0 to {MAX_TOP_LOGPROBS}", param=key)
    return value


def response_grammar(fmt: Any, param: str = "response_format") -> str | None:
    """OpenAI's response_format ({type: text | json_object | json_schema}) as a grammar."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise RequestError(f"'{param}' must be an object", param=param)
    kind = fmt.get("type")
    try:
        if kind in (None, "text"):
            return None
        if kind == "json_object":
            return json_grammar(None)
        if kind == "json_schema":
            spec = fmt.get("json_schema", fmt)  # Responses' text.format has it inline
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise RequestError(f"'{param}.json_schema.schema' must be a JSON schema object",
                                   param=param)
            return json_grammar(schema, f"{param} schema")
    except GrammarError as exc:
        raise RequestError(str(exc), param=param, code="unsupported_schema") from exc
    raise RequestError(f"'{param}.type' must be 'text', 'json_object' or 'json_schema'",
                       param=param)


# -- messages ------------------------------------------------------------------------------
def _arguments(raw: Any, param: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw) if isinstance(raw, str) else None
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise RequestError(f"{param}: function arguments must be a JSON object", param=param)
    return value


def _text(content: Any, param: str) -> str:
    if content is None:
        return ""  # an assistant turn that only called tools
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text",
                                                                       "output_text") \
                    or not isinstance(part.get("text"), str):
                raise RequestError(f"{param}: only text content parts are supported",
                                   param=param)
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{param}.content must be a string or a list of parts", param=param)


def chat_messages(raw: Any, param: str = "messages") -> list[dict[str, Any]]:
    """OpenAI messages to role/content dicts (with tool_calls / tool_call_id / name)."""
    if not isinstance(raw, list) or not raw:
        raise RequestError(f"'{param}' must be a non-empty list", param=param)
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> function name, for the tool results
    for i, m in enumerate(raw):
        where = f"{param}[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"{where} must be an object with a 'role'", param=where)
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ("system", "user", "assistant", "tool"):
            raise RequestError(f"{where} has an unknown role {m['role']!r}", param=where)
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise RequestError(f"{where}.tool_calls must be a list", param=where)
            msg["tool_calls"] = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise RequestError(f"{where}.tool_calls[{j}] needs a function name",
                                       param=where)
                cid = str(c.get("id") or f"call_{i}_{j}")
                names[cid] = fn["name"]
                msg["tool_calls"].append({"id": cid, "name": fn["name"],
                                          "arguments": _arguments(fn.get("arguments"), where)})
        if role == "tool":
            cid = str(m.get("tool_call_id") or "")
            msg["tool_call_id"] = cid
            msg["name"] = str(m.get("name") or names.get(cid, ""))
        out.append(msg)
    return out


def text_size(messages: list[dict[str, Any]], tools: list[Tool]) -> int:
    size = sum(len(m["content"]) for m in messages)
    size += sum(len(json.dumps(c["arguments"])) for m in messages for c in m.get("tool_calls", ()))
    return size + sum(len(json.dumps(t.parameters)) + len(t.description) for t in tools)


def chat_prompt(messages: list[dict[str, Any]], tools: list[Tool],
                seen: Callable[[Tokenizer], None] | None = None
                ) -> Callable[[Tokenizer], list[int]]:
    """The prompt builder a GenerationJob runs on the engine thread; `seen(tok)` learns the
    tokenizer first (the reply's tool-call syntax depends on its template)."""
    def build(tok: Tokenizer) -> list[int]:
        from jinja2.exceptions import TemplateError

        if seen is not None:
            seen(tok)
        try:
            return prompt_ids(tok, messages, tools)
        except TemplateError as exc:  # e.g. a template that insists roles alternate
            raise RequestError(f"the model's chat template refused the messages: {exc}",
                               param="messages") from exc

    return build
