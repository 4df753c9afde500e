"""Child process for the kill -9 tests: set up, print READY, then write in a loop until killed.

Run as `python -m tests.reliability.kill_child TARGET FOLDER`. TARGET is kv (paged KV store
with its SSD tier), prefix (prefix-cache pages through the writer thread), import (tiny GGUF
imports into a library, new names and replacements) or chat (chat database replies). After
each finished unit of work it prints `DONE <what>`, so the parent knows what must survive.
"""

from __future__ import annotations

import sys
from pathlib import Path


def say(text: str) -> None:
    print(text, flush=True)


def kv(folder: Path) -> None:
    import mlx.core as mx

    from engine.kv import KVSettings
    from engine.kv.store import KVStore
    from tests.reliability.common import page_arrays

    P, H, D = 128, 2, 64
    settings = KVSettings(mode="exact", page_tokens=P, ssd_dir=folder, ram_mb=1,
                          sink_tokens=P, window_tokens=P, budget_tokens=4 * P)
    store = KVStore(settings, n_layers=1, kv_heads=H, head_dim=D)
    say(f"SESSION {store.folder}")
    page = 0
    while True:
        k, v = page_arrays(0, page, 0, (H, P, D))
        store.commit(0, mx.array(k), mx.array(v))
        if page == 0:
            store.flush()
            say("READY")
        page += 1


def prefix(folder: Path) -> None:
    from engine.kv.prefix import _Job, chain_hashes
    from tests.reliability.common import (
        PAGE,
        new_prefix_cache,
        prefix_pages,
        prefix_prompt,
    )

    cache = new_prefix_cache(folder)
    seed = 0
    while True:
        prompt = prefix_prompt(4, seed)
        hashes = chain_hashes(prompt, PAGE, cache.key, 4)
        ks, vs = prefix_pages(4, seed)
        pages = [(d, hashes[d - 1] if d else bytes(32), hashes[d],
                  __import__("numpy").asarray(prompt[d * PAGE:(d + 1) * PAGE], "<u4"))
                 for d in range(4)]
        cache._q.put(_Job(pages, ks, vs, 0))  # what store() queues, minus the MLX copy
        cache.flush()
        say(f"DONE {seed}")
        if seed == 0:
            say("READY")
        seed += 1


def import_models(home: Path) -> None:
    from engine.importers import import_path
    from engine.library.store import Library

    library = Library(home)
    source = home.parent / "tiny.gguf"
    i = 0
    while True:
        name = "fixed" if i % 2 else f"m{i % 6}"
        import_path(library, source, name=name, replace=True)
        say(f"DONE {name}")
        if i == 0:
            say("READY")
        i += 1


def chat(db: Path) -> None:
    from app.chat.store import ChatStore

    store = ChatStore(db)
    c = store.create_chat(model="m")
    i = 0
    while True:
        store.add_message(c.id, "user", f"question {i}")
        m = store.add_message(c.id, "assistant", "", status="streaming")
        text = ""
        for j in range(5):
            text += f"part {j} of reply {i}. "
            store.update_message(m.id, text)
        store.update_message(m.id, text, status="complete", stats={"n": i})
        say(f"DONE {m.id} {i}")
        if i == 0:
            say("READY")
        i += 1


def main() -> None:
    target, folder = sys.argv[1], Path(sys.argv[2])
    {"kv": kv, "prefix": prefix, "import": import_models, "chat": chat}[target](folder)


if __name__ == "__main__":
    main()
