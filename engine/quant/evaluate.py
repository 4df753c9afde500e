"""Measure a model's quality against a reference model on a text.

Contract: `evaluate(library, model, reference, text, tokens, window)` tokenizes the first
`tokens` tokens of the text with the reference's tokenizer, runs both models over
non-overlapping windows of `window` tokens (each window starts fresh, with BOS when the
tokenizer has one) and returns an `EvalResult`: the model's and the reference's perplexity,
the mean KL(reference || model) of next-token distributions, top-1 agreement, bits per weight
and bytes on disk (from the manifest), weight bytes and peak memory as loaded under the
compute profile, and greedy generation tokens/s. Both models run under the same compute
profile (on the Linux CPU: dequantized to float32, so numbers are those of the stored weights).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.errors import Cancelled, StrataError
from engine.library.store import Library
from engine.platform import parameter_bytes
from engine.runtime.generate import LoadedModel, generate
from engine.runtime.sampling import SamplingParams
from engine.telemetry import CancelFlag, Progress


@dataclass
class EvalResult:
    model: str
    reference: str
    text: str
    tokens: int
    window: int
    perplexity: float
    reference_perplexity: float
    kl_mean: float
    top1_agreement: float
    bits_per_weight: float | None
    bytes_on_disk: int | None
    weights_bytes_loaded: int
    peak_memory_bytes: int
    generation_tps: float
    profile: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def eval_tokens(tokenizer: Any, text_path: Path, n_tokens: int) -> list[int]:
    try:
        text = text_path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise StrataError(f"{text_path}: cannot read text ({exc.__class__.__name__})") from exc
    # Enough characters for n_tokens (wikitext averages under 5 characters a token).
    ids: list[int] = tokenizer.encode(text[: max(n_tokens, 64) * 10], add_bos=False)
    if len(ids) < 16:
        raise StrataError(f"{text_path}: too short to evaluate ({len(ids)} tokens)")
    return ids[:n_tokens]


def _windows(ids: list[int], window: int, bos: int | None) -> list[list[int]]:
    out = []
    for i in range(0, len(ids), window):
        w = ids[i: i + window]
        if bos is not None:
            w = [bos, *w]
        if len(w) >= 2:
            out.append(w)
    return out


def _logprobs(model: Any, ids: list[int]) -> Any:
    import mlx.core as mx  # heavy: MLX loads only when a model runs

    logits = model(mx.array(ids[:-1])[None])[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _generation_tps(lm: LoadedModel, n: int = 32) -> float:
    prompt = lm.tokenizer.encode("The history of the city begins", add_bos=None)
    last = None
    for ev in generate(lm, prompt, SamplingParams(temperature=0.0), max_tokens=n):
        last = ev
    return float(last.decode_tps) if last is not None else 0.0


@dataclass
class ReferencePass:
    """The reference's log-probabilities over the evaluation windows, computed once."""

    name: str
    windows: list[list[int]]
    logprobs: list[Any]
    nll: float
    count: int


def reference_pass(ref: Any, name: str, text: Path, tokens: int, window: int,
                   cancel: CancelFlag | None = None) -> ReferencePass:
    import mlx.core as mx  # heavy: MLX loads only when a model runs

    ids = eval_tokens(ref.tokenizer, text, tokens)
    windows = _windows(ids, window, ref.tokenizer.bos_id)
    lps, nll, count = [], 0.0, 0
    for w in windows:
        if cancel is not None and cancel():
            raise Cancelled("evaluation")
        lp = _logprobs(ref.model, w)
        step = -mx.take_along_axis(lp, mx.array(w[1:])[:, None], axis=-1).sum()
        mx.eval(lp, step)
        lps.append(lp)
        nll += _scalar(step)
        count += len(w) - 1
    return ReferencePass(name, windows, lps, nll, count)


def evaluate(
    library: Library,
    model: str,
    reference: str,
    text: Path,
    tokens: int = 4096,
    window: int = 1024,
    gen_tokens: int = 32,
    progress: Progress | None = None,
    cancel: CancelFlag | None = None,
    cache: dict[tuple[str, str, int, int], ReferencePass] | None = None,
) -> EvalResult:
    """Quality of `model` against `reference` on `text`. See the module docstring.

    `cache` keeps reference passes between calls, so a table of models costs one reference
    pass (about 0.8 GB of float32 log-probabilities for 4,096 tokens).
    """
    import mlx.core as mx  # heavy: MLX loads only when a model runs

    if tokens < 16 or window < 16:
        raise StrataError("evaluate at least 16 tokens, in windows of at least 16")
    text = Path(text)
    if not text.is_file():
        raise StrataError(f"{text}: no such text file")
    ref_manifest = library.get(reference)
    manifest = library.get(model)
    cancel = cancel or (lambda: False)
    # The model alone first, so its peak memory is its own: cached reference passes are
    # subtracted, they stay resident between models.
    held = sum(int(lp.nbytes) for rp in (cache or {}).values() for lp in rp.logprobs)
    mx.reset_peak_memory()
    lm = LoadedModel.load(manifest["path"], library)
    lm.manifest = manifest
    weights_bytes = parameter_bytes(lm.model)
    tps = _generation_tps(lm, gen_tokens) if gen_tokens > 0 else 0.0
    peak = int(mx.get_peak_memory()) - held
    key = (ref_manifest.get("fingerprint") or ref_manifest["path"], str(text.resolve()),
           tokens, window)
    ref_pass = cache.get(key) if cache is not None else None
    if ref_pass is None:
        same = Path(ref_manifest["path"]).resolve() == Path(manifest["path"]).resolve()
        ref = lm if same else LoadedModel.load(ref_manifest["path"], library, warm_up=False)
        if ref.tokenizer.encode("Hello world, 123.") != lm.tokenizer.encode("Hello world, 123."):
            raise StrataError(f"{model} and {reference} do not share a tokenizer")
        ref_pass = reference_pass(ref, ref_manifest["name"], text, tokens, window, cancel)
        del ref
        if cache is not None:
            cache[key] = ref_pass
    nll = kl = 0.0
    agree = 0
    for i, (w, lp_ref) in enumerate(zip(ref_pass.windows, ref_pass.logprobs, strict=True)):
        if cancel():
            raise Cancelled("evaluation")
        target = mx.array(w[1:])
        lp = _logprobs(lm.model, w)
        step = (
            -mx.take_along_axis(lp, target[:, None], axis=-1).sum(),
            (mx.exp(lp_ref) * (lp_ref - lp)).sum(),
            (lp.argmax(-1) == lp_ref.argmax(-1)).sum(),
        )
        mx.eval(step)
        nll += _scalar(step[0])
        kl += _scalar(step[1])
        agree += int(step[2].item())
        if progress is not None:
            progress(i + 1, len(ref_pass.windows))
    count = ref_pass.count
    return EvalResult(
        model=manifest["name"], reference=ref_manifest["name"], text=text.name,
        tokens=count, window=window,
        perplexity=math.exp(nll / count), reference_perplexity=math.exp(ref_pass.nll / count),
        kl_mean=max(kl / count, 0.0), top1_agreement=agree / count,
        bits_per_weight=manifest.get("bits_per_weight"), bytes_on_disk=manifest.get("bytes"),
        weights_bytes_loaded=weights_bytes, peak_memory_bytes=peak,
        generation_tps=tps, profile=lm.profile.name)


def _scalar(a: Any) -> float:
    return float(a.item())
