"""An agent loop of 10 tool calls against a real `strata serve` (issue 22's target).

Not a test: a measurement, run by hand. `STRATA_HOME=... python -m
tests.engine.server.agent_loop` starts the server on loopback, then sends 10 chat requests
that each resend a ~3,000-token system prompt (wikitext) and a tool list with the growing
conversation (a tool call and its result per step), and prints each call's prompt tokens,
cached tokens and seconds as JSON lines. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai

REPO = Path(__file__).resolve().parents[3]
PORT = 8799
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "lookup", "description": "Look up a word in the notes",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                   "required": ["word"]}}}]


def _wait(client: openai.OpenAI) -> None:
    for _ in range(120):
        try:
            client.models.list()
            return
        except openai.APIConnectionError:
            time.sleep(1)


def main() -> None:
    srv = subprocess.Popen([sys.executable, "-m", "app", "serve", "--port", str(PORT)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="x",
                               timeout=600)
        _wait(client)
        notes = (REPO.parent / "shared/data/wikitext-2-test.txt").read_text()[:11000]
        msgs: list[Any] = [
            {"role": "system", "content": "You are a research agent. Use the tools to look "
                                          "things up. Reference notes:\n" + notes},
            {"role": "user", "content": "Find facts about Robert."}]
        for i in range(10):
            t = time.perf_counter()
            r = client.chat.completions.create(model="starter", messages=msgs, tools=TOOLS,
                                               temperature=0, max_tokens=16)
            u = r.usage
            assert u is not None and u.prompt_tokens_details is not None
            print(json.dumps({"call": i + 1, "prompt_tokens": u.prompt_tokens,
                              "cached_tokens": u.prompt_tokens_details.cached_tokens,
                              "seconds": round(time.perf_counter() - t, 2)}), flush=True)
            # The agent's turn: a tool call and its result, then the next request.
            call = {"id": f"call_{i}", "type": "function",
                    "function": {"name": "lookup", "arguments": json.dumps({"word": f"w{i}"})}}
            msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
            msgs.append({"role": "tool", "tool_call_id": f"call_{i}",
                         "content": f"w{i}: appears {i + 2} times."})
    finally:
        srv.terminate()
        srv.wait(timeout=30)


if __name__ == "__main__":
    main()
