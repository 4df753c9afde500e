"""The starter model end to end: fetched, imported, and answering through the real CLI.

Also: Strata's greedy tokens equal mlx-lm's for the same imported model and prompt.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.importers.starter import SHA256, starter_gguf
from tests.helpers import REPO, run_strata

QUESTION = "What is the capital of France?"


def test_starter_is_in_library_with_manifest(starter: dict[str, Any]) -> None:
    assert starter["name"] == "smollm2-135m-instruct"
    assert "starter" in starter["aliases"]
    assert starter["source_format"] == "gguf"
    assert starter["architecture"] == "llama"
    assert starter["context_length"] == 8192
    assert starter["quantization"]["embedding"] == ["affine 8-bit g32 (from Q8_0, exact)"]
    assert starter["quantization"]["mlp"] == ["affine 4-bit g32 (from Q4_1, exact)"]
    assert 5.0 < starter["bits_per_weight"] < 6.5
    assert starter["fingerprint"].startswith("sha256:")
    folder = Path(starter["path"])
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "manifest.json"):
        assert (folder / name).is_file(), name


def test_starter_gguf_checksum_verified() -> None:
    import hashlib

    path = starter_gguf()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == SHA256


def test_generate_names_paris(starter: dict[str, Any], strata_home: Path) -> None:
    proc = run_strata("generate", "--model", "starter", "--prompt", QUESTION, "--temp", "0",
                      home=strata_home)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_generate_json_fields(starter: dict[str, Any], strata_home: Path) -> None:
    proc = run_strata("generate", "--model", "smollm2-135m-instruct", "--prompt", QUESTION,
                      "--temp", "0", "--max-tokens", "16", "--json", home=strata_home)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in ("text", "prompt_tokens", "generated_tokens", "ttft_s", "prefill_tps",
                "decode_tps", "peak_memory_bytes", "finish_reason"):
        assert key in out, key
    assert "Paris" in out["text"]
    assert out["prompt_tokens"] > 10
    assert 0 < out["generated_tokens"] <= 16
    assert out["finish_reason"] in ("stop", "length")
    assert out["ttft_s"] > 0 and out["peak_memory_bytes"] > 0


def test_models_lists_starter(starter: dict[str, Any], strata_home: Path) -> None:
    proc = run_strata("models", "--json", home=strata_home)
    assert proc.returncode == 0, proc.stderr
    names = [m["name"] for m in json.loads(proc.stdout)]
    assert "smollm2-135m-instruct" in names


@pytest.mark.parametrize("profile", ["cpu-f32", "native"])
def test_greedy_tokens_equal_mlx_lm(starter_lm: Any, starter: dict[str, Any], profile: str
                                    ) -> None:
    """Same model folder, same prompt: Strata's greedy tokens are mlx-lm's, token for token
    (64 in float32; 32 in the native profile, whose quantized CPU matmuls run at ~9 tok/s)."""
    from engine.platform import compute_profile
    from engine.runtime.generate import LoadedModel, generate
    from engine.runtime.sampling import SamplingParams

    n = 64 if profile == "cpu-f32" else 32
    story = "Write a short story about a robot who learns to paint."
    messages = [{"role": "user", "content": story}]
    ref = subprocess.run(
        [sys.executable, str(REPO / "tests" / "engine" / "mlxlm_reference.py"), starter["path"],
         profile, str(n)],
        input=json.dumps(messages), capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert ref.returncode == 0, ref.stderr
    expected = json.loads(ref.stdout.strip().splitlines()[-1])
    lm = starter_lm if starter_lm.profile.name == profile else LoadedModel.load(
        starter["path"], profile=compute_profile(profile))
    ids = lm.tokenizer.encode_chat(messages)
    assert ids == expected["prompt_ids"]
    tokens = [ev.token for ev in generate(lm, ids, SamplingParams(temperature=0), n)
              if ev.token is not None]
    assert len(expected["tokens"]) == n
    assert tokens == expected["tokens"]


def test_chat_in_the_terminal(starter: dict[str, Any], strata_home: Path) -> None:
    """Two turns over stdin: the second answer uses the first turn's context."""
    proc = run_strata("chat", "--model", "starter", "--temp", "0", "--max-tokens", "40",
                      home=strata_home,
                      input="What is the capital of France?\nAnd of Germany?\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout and "Berlin" in proc.stdout
    assert "prompt tokens cached" in proc.stderr


def test_load_refuses_when_memory_would_not_fit(starter: dict[str, Any], strata_home: Path
                                                ) -> None:
    """Weights (as the profile holds them) plus the full-context KV over the cap: refused."""
    proc = run_strata("generate", "--model", "starter", "--prompt", "hi", home=strata_home,
                      env={"STRATA_MAX_MEMORY_MB": "300"})
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("strata: error: smollm2-135m-instruct: needs")
    assert "GB is available" in lines[0] and "Traceback" not in proc.stderr
    ok = run_strata("generate", "--model", "starter", "--prompt", "hi", "--max-tokens", "1",
                    home=strata_home, env={"STRATA_MAX_MEMORY_MB": "4000"})
    assert ok.returncode == 0, ok.stderr
