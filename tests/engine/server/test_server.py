"""The OpenAI-compatible server, driven by the official `openai` client against a real
`strata serve` subprocess on loopback (with an API key) serving the starter model (the
`server` and `client` fixtures: conftest.py)."""

from __future__ import annotations

import json
import secrets
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.engine.server.conftest import KEY
from tests.helpers import run_strata

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _http(url: str, body: bytes | None = None, key: str | None = KEY
          ) -> tuple[int, dict[str, str], Any]:
    """(status, headers, JSON body) of a raw request, for what the client cannot send."""
    req = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, dict(exc.headers), json.loads(exc.read())


def _status(server: str) -> dict[str, Any]:
    code, _, body = _http(f"{server}/strata/status")
    assert code == 200
    return dict(body)


def _assert_error_shape(body: Any) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]


# -- answers ---------------------------------------------------------------------------------
def test_models_lists_the_starter(client: openai.OpenAI, starter: Any) -> None:
    ids = [m.id for m in client.models.list()]
    assert starter["name"] in ids
    assert client.models.retrieve("starter").id == starter["name"]  # aliases resolve


def test_chat_completion_answers_paris(client: openai.OpenAI, starter: Any) -> None:
    r = client.chat.completions.create(model="starter", messages=FRANCE,  # type: ignore[arg-type]
                                       temperature=0, max_tokens=16)
    assert "Paris" in (r.choices[0].message.content or "")
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.model == starter["name"]
    assert r.usage is not None and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_chat_matches_the_whole_reply(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="starter", messages=FRANCE, temperature=0, max_tokens=12)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    parts, finishes, usage = [], [], None
    for chunk in client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert "".join(parts) == whole
    assert len(finishes) == 1 and finishes[0] in ("stop", "length")
    assert usage is not None and usage.completion_tokens > 0


def test_text_completion_honours_stop(client: openai.OpenAI) -> None:
    r = client.completions.create(model="starter", prompt="The capital of France is",
                                  temperature=0, max_tokens=8, stop=["."])
    assert "Paris" in r.choices[0].text and "." not in r.choices[0].text
    assert r.choices[0].finish_reason == "stop"


def test_shared_system_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    marker = secrets.token_hex(4)  # a prefix no earlier request has warmed
    system = (f"Session {marker}. You are a terse assistant for a bakery. "
              + "Opening hours are nine to five, closed on Sundays. " * 20)
    usages = []
    for question in ("When do you open?", "Are you open on Sunday?"):
        r = client.chat.completions.create(
            model="starter", temperature=0, max_tokens=2,
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": question}])
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        usages.append(r.usage)
    assert usages[0].prompt_tokens > 200
    first = usages[0].prompt_tokens_details.cached_tokens or 0  # type: ignore[union-attr]
    second = usages[1].prompt_tokens_details.cached_tokens or 0  # type: ignore[union-attr]
    assert first < 20
    assert second > 200


def _wait_status(server: str, ok: Any, timeout: float = 10) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        s = _status(server)
        if ok(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


def test_clients_that_leave_free_their_slot(client: openai.OpenAI, server: str) -> None:
    before = _status(server)["cancelled"]
    stream = client.completions.create(model="starter", prompt="1, 2, 3, 4, 5,",
                                       temperature=0, max_tokens=2000, stream=True)
    got = [c for _, c in zip(range(3), stream, strict=False)]
    assert len(got) == 3
    assert _status(server)["running"] == 1

    # A request whose client gives up (queued, or decoding beside it in the batch) leaves
    # at once. It counts on past the client's second: a short answer, batched beside the
    # stream, could end within it on an idle machine.
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=1.0).completions.create(
            model="starter", prompt="1, 2, 3, 4, 5,", temperature=0, max_tokens=2000)
    s = _wait_status(server, lambda s: s["cancelled"] > before)
    assert (s["cancelled"], s["waiting"], s["running"]) == (before + 1, 0, 1), s

    stream.close()  # hang up mid-generation: the stream stops between tokens
    s = _wait_status(server, lambda s: s["cancelled"] > before + 1 and s["queue_depth"] == 0)
    assert (s["cancelled"], s["queue_depth"]) == (before + 2, 0), s

    t0 = time.monotonic()
    raw = client.chat.completions.with_raw_response.create(
        model="starter", messages=FRANCE, temperature=0, max_tokens=4)  # type: ignore[arg-type]
    assert raw.headers["x-strata-queue-depth"] == "1"
    assert raw.parse().choices[0].message.content
    assert time.monotonic() - t0 < 20


# -- refusals --------------------------------------------------------------------------------
def test_malformed_requests_get_openai_errors(client: openai.OpenAI, server: str) -> None:
    code, _, body = _http(f"{server}/chat/completions", b'{"model": "starter", "messages": [')
    assert code == 400
    _assert_error_shape(body)

    code, _, body = _http(f"{server}/chat/completions", b'{"model": "starter"}')
    assert code == 400 and body["error"]["param"] == "messages"

    code, _, body = _http(f"{server}/chat/completions", json.dumps(
        {"messages": FRANCE, "temperature": "hot"}).encode())
    assert code == 400 and body["error"]["param"] == "temperature"

    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="no-such-model", messages=FRANCE)  # type: ignore
    assert nf.value.status_code == 404
    _assert_error_shape(nf.value.response.json())

    with pytest.raises(openai.BadRequestError) as big:
        client.chat.completions.create(
            model="starter", max_tokens=4,
            messages=[{"role": "user", "content": "hello " * 9000}])
    err = big.value.response.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert "8192" in err["message"]
    assert _wait_status(server, lambda s: s["queue_depth"] == 0)["queue_depth"] == 0


def test_api_key_is_required(server: str) -> None:
    code, headers, body = _http(f"{server}/models", key=None)
    assert code == 401
    _assert_error_shape(body)
    with openai.OpenAI(base_url=server, api_key="sk-wrong", max_retries=0) as wrong, \
            pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="starter", messages=FRANCE)  # type: ignore
    code, _, body = _http(f"{server}/models")
    assert code == 200 and body["data"]


def test_exposed_address_needs_a_key(strata_home: Path) -> None:
    r = run_strata("serve", "--host", "0.0.0.0", "--port", "0", home=strata_home,
                   env={"STRATA_API_KEY": None}, timeout=60)
    assert r.returncode == 1
    assert "api key" in r.stderr.lower() or "api-key" in r.stderr.lower()


def test_loopback_detection() -> None:
    from engine.server.api import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("10.0.0.2")


def test_usage_reports_drafted_tokens_in_openais_fields() -> None:
    from engine.server.api import usage
    from engine.telemetry import GenerationEvent

    ev = GenerationEvent(text="", token=None, prompt_tokens=40, cached_tokens=32,
                         generated_tokens=20, ttft_s=0.1, prefill_tps=0.0, decode_tps=9.0,
                         peak_memory_bytes=0, finish_reason="length", drafted_tokens=14,
                         accepted_tokens=11)
    u = usage(ev)
    assert u["completion_tokens_details"] == {"accepted_prediction_tokens": 11,
                                              "rejected_prediction_tokens": 3}
    assert u["prompt_tokens_details"] == {"cached_tokens": 32} and u["total_tokens"] == 60


def test_a_stopped_server_whose_teardown_hangs_still_exits_130(tmp_path: Path) -> None:
    """SIGTERM arms `exit_later`: a process whose exit waits on a thread that never ends (as
    a hung teardown would) is ended with Ctrl-C's status after the grace period, and says
    where it hung."""
    import subprocess
    import sys

    from tests.helpers import REPO
    script = tmp_path / "hang.py"
    script.write_text(
        "import threading\n"
        "from engine.server.api import exit_later\n"
        "def stuck_in_teardown():\n"
        "    threading.Event().wait()\n"
        "threading.Thread(target=stuck_in_teardown).start()  # not a daemon: exit waits\n"
        "exit_later(130, 0.5)\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 130, done.stderr[-2000:]
    assert time.monotonic() - start < 30
    assert "shutdown took over 0.5 s" in done.stderr and "stuck_in_teardown" in done.stderr
