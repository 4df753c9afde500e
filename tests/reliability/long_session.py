"""Benchmark (not a test): one chat of many turns with the starter model, memory sampled.

Run `python -m tests.reliability.long_session [--turns 200] [--max-tokens 8]`. Each turn goes
through ChatSession (KV reused across turns) and is saved in a chat database, as the app
does. Prints one line per sampled turn (RSS, MLX active memory, KV bytes, tokens held,
seconds) and a summary: RSS growth beyond the KV the context needs is what must stay bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--every", type=int, default=10)
    args = ap.parse_args()

    import engine  # noqa: F401  (the OpenBLAS shim must load before mlx)

    # isort: split
    import mlx.core as mx
    import psutil

    from app.chat.store import ChatStore
    from engine.importers.starter import ensure_starter
    from engine.library import Library
    from engine.runtime.generate import ChatSession, LoadedModel
    from engine.runtime.sampling import SamplingParams

    home = Path(os.environ.get("STRATA_HOME") or tempfile.mkdtemp(prefix="strata-long-"))
    os.environ["STRATA_HOME"] = str(home)
    manifest = ensure_starter(Library(home))
    lm = LoadedModel.load(manifest["path"])
    proc = psutil.Process()
    store = ChatStore(home / "long-session.sqlite3")
    chat = store.create_chat(model=manifest["name"])
    session = ChatSession(lm, system="You are a terse assistant. Answer in a few words.")
    greedy = SamplingParams(temperature=0.0)
    rows = []
    t_start = time.perf_counter()
    rss0 = proc.memory_info().rss
    for turn in range(1, args.turns + 1):
        text = f"Turn {turn}: name one animal."
        store.add_message(chat.id, "user", text)
        reply = store.add_message(chat.id, "assistant", "", status="streaming")
        t0 = time.perf_counter()
        out = "".join(ev.text for ev in session.send(text, greedy, max_tokens=args.max_tokens))
        store.update_message(reply.id, out, status="complete")
        dt = time.perf_counter() - t0
        if turn == 1 or turn % args.every == 0 or turn == args.turns:
            row = {"turn": turn, "rss_mb": proc.memory_info().rss / 2**20,
                   "mlx_active_mb": mx.get_active_memory() / 2**20,
                   "kv_mb": session.cache.nbytes / 2**20, "tokens": len(session.cache.tokens),
                   "turn_s": round(dt, 2)}
            rows.append(row)
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)
    first, last = rows[0], rows[-1]
    growth = last["rss_mb"] - first["rss_mb"]
    kv_growth = last["kv_mb"] - first["kv_mb"]
    print(json.dumps({"turns": args.turns, "seconds": round(time.perf_counter() - t_start, 1),
                      "rss_start_mb": round(rss0 / 2**20, 1),
                      "rss_growth_mb": round(growth, 1), "kv_growth_mb": round(kv_growth, 1),
                      "growth_beyond_kv_mb": round(growth - kv_growth, 1),
                      "messages_saved": len(store.messages(chat.id))}))
    store.close()


if __name__ == "__main__":
    main()
