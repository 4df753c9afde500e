"""Benchmark arithmetic and records: statistics over trials, ratios, flat figures, CSV, schema.

Contract: pure functions over plain dicts (the JSON of `strata bench`), no MLX and no I/O
beyond the writers at the end. A statistic is {"median", "min", "max", "n"}; a ratio is
Strata's median / the peer's median for the same figure (so >1 is better for tok/s and
worse for seconds and bytes; `FIGURES` says which way each figure is good). The result's
JSON Schema is schema.json beside this file; `validate` checks a result against it.
"""

from __future__ import annotations

import csv
import json
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

SCHEMA_ID = "strata-bench/2"
SCHEMA_PATH = Path(__file__).with_name("schema.json")

Stat = dict[str, float]

# figure key -> (unit, higher is better, label)
FIGURES: dict[str, tuple[str, bool, str]] = {
    "load_cold_s": ("s", False, "load, cold"),
    "load_warm_s": ("s", False, "load, warm"),
    "ttft_s": ("s", False, "first token, no cached prefix"),
    "ttft_cached_s": ("s", False, "first token, cached prefix"),
    "prompt_tps": ("tok/s", True, "prompt tok/s"),
    "decode_tps": ("tok/s", True, "generated tok/s"),
    "rss_peak_bytes": ("B", False, "process peak (RSS)"),
    "footprint_bytes": ("B", False, "physical footprint"),
    "mlx_peak_bytes": ("B", False, "MLX peak"),
    "mlx_active_bytes": ("B", False, "MLX active"),
    "kv_bytes": ("B", False, "KV cache"),
    "kv_ram_bytes": ("B", False, "KV in RAM"),
    "kv_ssd_bytes": ("B", False, "KV on SSD"),
    "ssd_read_mbs": ("MB/s", True, "SSD read, depth sweep"),
    "ssd_write_mbs": ("MB/s", True, "SSD write, depth sweep"),
}


def stat(values: Iterable[float]) -> Stat:
    """Median, min and max of the trials (an empty list is an error: nothing was measured)."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("no values to summarize")
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
            "n": len(vals)}


def ratio(ours: Stat | None, theirs: Stat | None) -> float | None:
    """Strata median / peer median; None when either is missing or the peer's is zero."""
    if not ours or not theirs or not theirs.get("median"):
        return None
    return float(ours["median"]) / float(theirs["median"])


def figure_key(name: str, depth: int | None = None) -> str:
    """'prompt_tps@4096' for per-depth figures, the plain name otherwise."""
    return name if depth is None else f"{name}@{depth}"


def base_figure(key: str) -> str:
    return key.split("@", 1)[0]


def flat_figures(run: dict[str, Any]) -> dict[str, Stat]:
    """One subject's figures as {figure key: stat}: loads, first tokens, per-depth speeds,
    memory (a memory figure is one reading, so its median, min and max coincide)."""
    out: dict[str, Stat] = {}
    load = run.get("load") or {}
    for src, key in (("cold_s", "load_cold_s"), ("warm_s", "load_warm_s")):
        if load.get(src):
            out[key] = load[src]
    ttft = run.get("ttft") or {}
    for src, key in (("uncached", "ttft_s"), ("cached", "ttft_cached_s")):
        if (ttft.get(src) or {}).get("ttft_s"):
            out[key] = ttft[src]["ttft_s"]
    for d in run.get("depths") or []:
        for name in ("prompt_tps", "decode_tps"):
            if d.get(name):
                out[figure_key(name, int(d["depth"]))] = d[name]
    mem = run.get("memory") or {}
    for name in ("rss_peak_bytes", "footprint_bytes", "mlx_peak_bytes", "mlx_active_bytes",
                 "kv_bytes", "kv_ram_bytes", "kv_ssd_bytes"):
        if mem.get(name) is not None:
            out[name] = _one(float(mem[name]))
    io = run.get("io") or {}
    if io.get("seconds"):
        out["ssd_read_mbs"] = _one(io["read_bytes"] / io["seconds"] / 1e6)
        out["ssd_write_mbs"] = _one(io["write_bytes"] / io["seconds"] / 1e6)
    return out


def _one(v: float) -> Stat:
    return {"median": v, "min": v, "max": v, "n": 1}


def ratios_against(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, float]:
    """{figure key: Strata / peer} for the figures both subjects have."""
    a, b = flat_figures(ours), flat_figures(peer)
    out: dict[str, float] = {}
    for key in a:
        r = ratio(a[key], b.get(key))
        if r is not None:
            out[key] = r
    return out


def compute_ratios(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each (model, setting): every peer run that finished something, against Strata."""
    out: list[dict[str, Any]] = []
    for ours in runs:
        if ours["subject"] != "strata":
            continue
        for peer in runs:
            if peer["subject"] == "strata" or peer["model"] != ours["model"]:
                continue
            if peer.get("setting", "default") not in ("default", ours.get("setting")):
                continue
            figs = ratios_against(ours, peer)
            if figs:
                out.append({"model": ours["model"], "setting": ours.get("setting", "default"),
                            "peer": peer["subject"], "figures": figs})
    return out


# -- writers ------------------------------------------------------------------------------
CSV_FIELDS = ("model", "setting", "subject", "figure", "unit", "median", "min", "max", "n")


def csv_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (model, setting, subject, figure), plus a ratio_vs_<peer> column each."""
    ratios = {(r["model"], r["setting"], r["peer"]): r["figures"]
              for r in result.get("ratios", [])}
    peers = sorted({r["peer"] for r in result.get("ratios", [])})
    rows: list[dict[str, Any]] = []
    for run in result.get("runs", []):
        setting = run.get("setting", "default")
        for key, s in flat_figures(run).items():
            row: dict[str, Any] = {
                "model": run["model"], "setting": setting, "subject": run["subject"],
                "figure": key, "unit": FIGURES.get(base_figure(key), ("", True, ""))[0],
                "median": s["median"], "min": s["min"], "max": s["max"], "n": s["n"]}
            for peer in peers:
                r = (ratios.get((run["model"], setting, peer)) or {}).get(key)
                row[f"ratio_vs_{peer}"] = r if run["subject"] == "strata" and r else ""
            rows.append(row)
    return rows


def write_csv(result: dict[str, Any], path: Path | str) -> None:
    rows = csv_rows(result)
    peers = sorted({r["peer"] for r in result.get("ratios", [])})
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=[*CSV_FIELDS, *(f"ratio_vs_{p}" for p in peers)])
        w.writeheader()
        w.writerows(rows)


def write_json(result: dict[str, Any], path: Path | str) -> None:
    """Write atomically, so a Ctrl-C mid-write never leaves half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(path)


# -- schema -------------------------------------------------------------------------------
def schema() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())
    return loaded


_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "boolean": (bool,),
    "integer": (int,), "number": (int, float), "null": (type(None),),
}


def validate(doc: Any, sch: dict[str, Any] | None = None) -> list[str]:
    """Errors of `doc` against the schema ([] when valid). Supports the JSON Schema subset
    schema.json uses: type (or a list of types), properties, required, additionalProperties,
    items, enum, minimum, $ref into #/$defs. No dependency on the jsonschema package."""
    root = sch or schema()
    errors: list[str] = []

    def check(value: Any, s: dict[str, Any], where: str) -> None:
        if "$ref" in s:
            name = s["$ref"].rsplit("/", 1)[-1]
            check(value, root["$defs"][name], where)
            return
        types = s.get("type")
        if types is not None:
            allowed = [types] if isinstance(types, str) else list(types)
            ok = any(isinstance(value, _TYPES[t]) and not (t in ("integer", "number")
                                                           and isinstance(value, bool))
                     for t in allowed)
            if not ok:
                errors.append(f"{where}: expected {'/'.join(allowed)}, "
                              f"got {type(value).__name__}")
                return
        if "enum" in s and value not in s["enum"]:
            errors.append(f"{where}: {value!r} not one of {s['enum']}")
        if "minimum" in s and isinstance(value, (int, float)) and value < s["minimum"]:
            errors.append(f"{where}: {value} < {s['minimum']}")
        if isinstance(value, dict):
            props = s.get("properties", {})
            for key in s.get("required", []):
                if key not in value:
                    errors.append(f"{where}: missing {key!r}")
            extra = s.get("additionalProperties", True)
            for key, v in value.items():
                if key in props:
                    check(v, props[key], f"{where}.{key}")
                elif extra is False:
                    errors.append(f"{where}: unexpected {key!r}")
                elif isinstance(extra, dict):
                    check(v, extra, f"{where}.{key}")
        if isinstance(value, list) and isinstance(s.get("items"), dict):
            for i, v in enumerate(value):
                check(v, s["items"], f"{where}[{i}]")

    check(doc, root, "$")
    return errors
