"""The `strata` command (also `python -m app`): the composition root, floor 6.

Contract: each subcommand prints its result on stdout (JSON with --json) and progress on
stderr. A user error (engine.errors.StrataError) prints one line, `strata: error: ...`, and
exits 1; Ctrl-C exits 130. `strata` with no subcommand opens the window. This module may import
every floor below it; it imports PySide6 (through app.main) only when the window opens, so
headless subcommands (generate, serve, bench, ...) start without Qt.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from engine.errors import StrataError


def _progress_printer(label: str) -> Callable[[int, int], None]:
    tty = sys.stderr.isatty()
    last = [-1]

    def show(done: int, total: int) -> None:
        pct = int(100 * done / max(total, 1))
        if pct == last[0]:
            return
        last[0] = pct
        if tty:
            print(f"\r{label}: {pct:3d}%", end="" if done < total else "\n", file=sys.stderr,
                  flush=True)
        elif done == total:
            print(f"{label}: done", file=sys.stderr)

    return show


def _library() -> Any:
    from engine.library import Library  # each command imports only what it runs (start-up)

    return Library()


def _print(obj: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(obj, indent=2, sort_keys=True))


# -- subcommands --------------------------------------------------------------------------
def cmd_pull(args: argparse.Namespace) -> int:
    lib = _library()
    if args.what == "starter":
        from engine.importers.starter import ensure_starter  # start-up: this command's only

        m = ensure_starter(lib, progress=lambda msg: print(msg, file=sys.stderr),
                           import_progress=_progress_printer("importing"))
    else:
        from engine.importers.hub import pull_hub  # start-up: this command's only

        m = pull_hub(lib, args.what, name=args.name,
                     progress=_progress_printer("pulling"))
    if args.json:
        _print(m, True)
    else:
        print(f"{m['name']}: ready ({m['bytes'] / 1e6:.1f} MB, {m['bits_per_weight']} bits/weight)")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    models = _library().manifests()
    if args.json:
        _print(models, True)
        return 0
    if not models:
        print("no models yet: try `strata pull starter`")
        return 0
    print(f"{'NAME':32} {'ALIASES':12} {'SIZE':>9} {'BPW':>6} {'CTX':>7}  SOURCE")
    for m in models:
        print(f"{m['name']:32} {','.join(m.get('aliases', [])):12} "
              f"{m['bytes'] / 1e6:8.1f}M {m['bits_per_weight']:6.2f} "
              f"{m.get('context_length') or '-':>7}  {m.get('source_format')}")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    """`strata cache`: where the page store is and what it holds (stored runs, live sessions);
    --clear removes the stored runs (a live session's pages stay)."""
    from engine.kv.prefix import clear_folder, folder_summary, settings_from_env  # start-up
    from engine.kv.settings import settings_from_env as kv_settings  # start-up: as above

    s = settings_from_env()
    folder = s.root()
    summary = folder_summary(folder)
    runs, size = summary["runs"], summary["bytes"]
    try:  # the RAM tier's budget per session (a bad setting is the chat's to report)
        ram = kv_settings().ram_bytes()
    except (ValueError, StrataError):
        ram = None
    info: dict[str, Any] = {"folder": str(folder), **summary,
                            "budget_bytes": int(s.budget_mb * (1 << 20)),
                            "ram_budget_bytes": ram}
    if args.clear:
        info["removed_runs"], info["removed_bytes"] = clear_folder(folder)
    if args.json:
        _print(info, True)
    elif args.clear:
        print(f"removed {info['removed_runs']} files ({info['removed_bytes'] / 2**20:.1f} MB) "
              f"from {folder}")
    else:  # MB as the budget setting counts them (2^20 bytes)
        live = summary["session_bytes"]
        rate = summary["hit_rate"]
        print(f"page store: {folder}: {summary['pages']} pages in {runs} runs "
              f"({summary['shared_pages']} shared by more than one stored prompt), "
              f"{summary['tails']} prompt tails, {size / 2**20:.1f} MB stored + "
              f"{live / 2**20:.1f} MB in {summary['sessions']} live sessions of a "
              f"{s.budget_mb:g} MB budget (STRATA_PREFIX_MB; stored pages make room for "
              "sessions)")
        print(f"  live sessions: {summary['ram_pages']} pages in RAM "
              f"({summary['ram_bytes'] / 2**20:.1f} MB"
              + ("" if ram is None else f" of a {ram / 2**20:.0f} MB budget per session, "
                 "STRATA_KV_RAM_MB") + f"), {summary['held_pages']} stored pages mapped "
              "(never evicted while mapped)")
        print("  hit rate: " + ("no prompt yet" if rate is None else
                                f"{summary['found_pages']} of {summary['asked_pages']} pages "
                                f"asked for were stored ({100 * rate:.0f}%)"))
        for m in summary["models"]:
            print(f"  {m['name'] or 'unnamed model'}: {m['pages']} pages "
                  f"({m['shared_pages']} shared) in {m['runs']} runs, "
                  f"{m['bytes'] / 2**20:.1f} MB")
        if summary["stale_files"]:
            print(f"  {summary['stale_files']} files of an older format "
                  f"({summary['stale_bytes'] / 2**20:.1f} MB), removed first when space runs "
                  "out or by --clear")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from engine.importers import import_path  # start-up: this command's only
    from engine.quant.cli import print_quantized, requantize_from_args  # start-up: as above

    # An import with a recipe: the importer opens the source, quantization makes the model.
    requantize = requantize_from_args(args)  # None without --recipe
    _check_import_fits(Path(args.path), args.recipe, args.context)
    m = import_path(_library(), Path(args.path), name=args.name,
                    progress=_progress_printer("importing"), requantize=requantize,
                    context=args.context)
    if requantize is not None:
        print_quantized(m, args.json)
    elif args.json:
        _print(m, True)
    else:
        print(f"imported {m['name']} ({m['bytes'] / 1e6:.1f} MB, "
              f"{m['bits_per_weight']} bits/weight)")
    return 0


def _check_import_fits(path: Path, recipe: str | None, context: int | None = None) -> None:
    """Refuse, in one line with the numbers and the largest context that would fit, an import
    of a model that would not fit in this machine's memory once loaded (at `context`, else
    STRATA_CONTEXT, else the trained one); nothing is written before."""
    from engine.errors import ImportFailed  # start-up: with the importers, below
    from engine.importers import open_source
    from engine.platform import compute_profile
    from engine.quant.quantize import expected_sizes

    source = open_source(path)
    profile = compute_profile()
    size = None
    if recipe and not profile.dequantize:  # kept quantized: the recipe's size on disk
        try:
            size = expected_sizes(source, [recipe])[recipe][1]
        except StrataError:
            size = None  # 'auto' or a recipe file: sized when it runs
    fit = source.preflight(profile, context, stored_bytes=size)
    if not fit.fits:
        raise ImportFailed(fit.refusal(source.path.name))


def cmd_rm(args: argparse.Namespace) -> int:
    m = _library().remove(args.name)
    print(f"removed {m['name']}")
    return 0


def _sampling(args: argparse.Namespace) -> Any:
    from engine.runtime.sampling import SamplingParams  # start-up: only when generating

    return SamplingParams(temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
                          min_p=args.min_p, repetition_penalty=args.repeat_penalty,
                          seed=args.seed).validate()


def _kv_settings(args: argparse.Namespace) -> Any:
    """KVSettings from --kv-* options (None: mlx-lm's in-memory KVCache)."""
    from engine.kv import settings_from_env  # start-up: MLX loads only when generating

    settings = settings_from_env(mode=args.kv_mode, ram_mb=args.kv_ram_mb, bits=args.kv_bits,
                                 budget_tokens=args.kv_budget)
    return None if settings.mode == "mlx" else settings


def _add_kv(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-mode", choices=("mlx", "exact", "sparse"),
                   help="KV cache: paged exact (default), paged sparse, or mlx-lm's in memory")
    p.add_argument("--kv-ram-mb", type=int, help="RAM tier budget of the paged KV cache")
    p.add_argument("--kv-bits", type=int, choices=(16, 8, 4),
                   help="KV precision: 16 as computed (default); 8 or 4 quantize the pages "
                        "(paged modes only)")
    p.add_argument("--kv-budget", type=int, metavar="TOKENS",
                   help="sparse mode: tokens attended per step (sinks and window included)")


def _system_text(args: argparse.Namespace) -> str | None:
    """--system, or the text of --system-file (one line naming the file if unreadable)."""
    if getattr(args, "system_file", None) is None:
        return str(args.system) if args.system else None
    try:
        return Path(args.system_file).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise StrataError(f"{args.system_file}: cannot read the system prompt ({exc})"
                          ) from exc


def _json_schema_grammar(path: str | None) -> str | None:
    """--json-schema FILE: the schema's grammar, or one line naming the file and the reason."""
    if path is None:
        return None
    from engine.runtime.grammar import GrammarError, json_grammar  # start-up: llguidance

    try:
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise StrataError(f"{path}: cannot read the JSON schema ({exc})") from exc
    try:
        return json_grammar(schema, where=path)
    except GrammarError as exc:
        raise StrataError(str(exc)) from exc


def cmd_generate(args: argparse.Namespace) -> int:
    # Start-up: the runtime (and MLX with it) loads only for the commands that generate.
    from engine.runtime.generate import generate
    from engine.runtime.pool import ModelPool, PoolSettings
    from engine.telemetry import PROCESS_START, Timeline

    if args.prompt_file is not None:
        try:
            prompt_text = Path(args.prompt_file).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise StrataError(f"{args.prompt_file}: cannot read prompt ({exc})") from exc
    else:
        prompt_text = args.prompt
    system = _system_text(args)  # an unreadable file fails before the model loads
    grammar = _json_schema_grammar(args.json_schema)  # so does a bad schema
    params = _sampling(args)
    timeline = Timeline()
    timeline.add("interpreter and imports", PROCESS_START)
    # Bad KV or prefix-cache options fail before the model loads.
    pool = ModelPool(_library(), PoolSettings(kv=_kv_settings(args),
                                              prefix_cache=args.prefix_cache))
    cluster = _start_cluster(args, timeline) if args.ranks > 1 else None
    lm = cluster.lm if cluster is not None else pool.get(args.model, timeline=timeline)
    if cluster is not None and args.prefix_cache:
        lm.enable_prefix_cache(pool.prefix_settings())  # each rank keeps its own share's pages
    messages = ([{"role": "system", "content": system}] if system else [])
    messages.append({"role": "user", "content": prompt_text})
    ids = (lm.tokenizer.encode(prompt_text) if args.raw else lm.tokenizer.encode_chat(messages))
    parts: list[str] = []
    last = None
    processors = []
    if grammar is not None:
        from engine.runtime.grammar import GrammarProcessor  # start-up: llguidance only here

        processors.append(GrammarProcessor(lm.tokenizer, grammar))
    # A split model's other ranks follow one token a step: no drafts there.
    drafter: Any = "off" if cluster is not None else args.draft
    if drafter not in ("auto", "off", "lookup"):  # a draft model: same vocabulary or one line
        from engine.runtime.generate import LoadedModel  # start-up: as above
        from engine.runtime.speculative import ModelDrafter

        drafter = ModelDrafter(lm, LoadedModel.load(args.draft, library=_library()))
    # A split model: a rank lost mid-reply is one line; the other ranks stop with the reply.
    with cluster if cluster is not None else contextlib.nullcontext():
        for ev in generate(lm, ids, params, args.max_tokens, stop=args.stop or (),
                           timeline=timeline, logits_processors=processors,
                           drafter=drafter):
            parts.append(ev.text)
            if not args.json:
                print(ev.text, end="", flush=True)
            last = ev
    assert last is not None
    if not args.json:
        print()
    if args.timeline:
        print("timeline (s since process start):", file=sys.stderr)
        for phase, start, end in timeline.marks:
            print(f"  {phase:26} {start - PROCESS_START:8.3f} -> "
                  f"{end - PROCESS_START:8.3f}  ({end - start:.3f})", file=sys.stderr)
    if args.json:
        out = {
            "model": lm.manifest["name"],
            "text": "".join(parts),
            "prompt_tokens": last.prompt_tokens,
            "cached_tokens": last.cached_tokens,
            "generated_tokens": last.generated_tokens,
            "ttft_s": round(last.ttft_s, 4),
            "prefill_tps": round(last.prefill_tps, 2),
            "decode_tps": round(last.decode_tps, 2),
            "peak_memory_bytes": last.peak_memory_bytes,
            "finish_reason": last.finish_reason,
            "drafted_tokens": last.drafted_tokens,
            "accepted_tokens": last.accepted_tokens,
            "profile": lm.profile.name,
            "timeline": {k: round(v, 4) for k, v in timeline.durations().items()},
        }
        _print(out, True)
    return 0


def _start_cluster(args: argparse.Namespace, timeline: Any) -> Any:
    """`generate --ranks N`: rank 0 here, N-1 local `strata join` ranks on loopback."""
    from engine.runtime.cluster import start_local  # start-up: only when split

    return start_local(args.model, args.ranks, [sys.executable, "-m", "app", "join"],
                       library=_library(), timeline=timeline, kv=_kv_settings(args))


def cmd_join(args: argparse.Namespace) -> int:
    """`strata join`: a rank > 0 of a split model; runs rank 0's steps until it quits. With
    no hostfile: wait on --listen, advertised by mDNS, and run each rank rank 0 invites."""
    from engine.runtime.cluster import join  # start-up: MLX loads only when joining

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.hostfile or os.environ.get("MLX_HOSTFILE"):
        join(args.hostfile, args.rank, library=_library(), timeout=args.timeout, say=say,
             key=args.api_key)
        return 0
    from engine.runtime.cluster_find import Waiter  # start-up: as above

    waiter = Waiter(args.listen, join_command=[sys.executable, "-m", "app", "join"],
                    advertise=not args.no_advertise, say=say, key=args.api_key)
    say(f"waiting for rank 0 on port {waiter.port}"
        f"{'' if args.no_advertise else ' (advertised on the local network)'}")
    # SIGTERM (a service manager, a test) stops it as Ctrl-C does: the invited rank with it.
    signal.signal(signal.SIGTERM, lambda *_: waiter.stop())
    try:
        waiter.serve()
    except KeyboardInterrupt:
        pass
    finally:
        waiter.stop()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from engine.runtime.pool import ModelPool, PoolSettings  # start-up: MLX loads only here

    params = _sampling(args)
    pool = ModelPool(_library(), PoolSettings(prefix_cache=args.prefix_cache))
    lm = pool.get(args.model)
    drafter: Any = args.draft
    if drafter not in ("auto", "off", "lookup"):  # a draft model: same vocabulary or one line
        from engine.runtime.generate import LoadedModel  # start-up: MLX loads only here
        from engine.runtime.speculative import ModelDrafter

        drafter = ModelDrafter(lm, LoadedModel.load(args.draft, library=_library()))

    def new_session() -> Any:
        pool.forget(0)
        session = pool.session(0)
        system = _system_text(args)
        if system:
            session.messages.append({"role": "system", "content": system})
        return session

    session = new_session()
    tty = sys.stdin.isatty()
    print(f"chatting with {lm.manifest['name']} ({lm.profile.name}); /reset, /exit",
          file=sys.stderr)
    while True:
        if tty:
            print(">>> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            break
        if text == "/reset":
            session = new_session()
            continue
        stopped = [False]
        last = None
        try:
            # The flag is read within this turn only.
            for ev in session.send(text, params, args.max_tokens,
                                   cancel=lambda: stopped[0], drafter=drafter):  # noqa: B023
                print(ev.text, end="", flush=True)
                last = ev
        except KeyboardInterrupt:
            stopped[0] = True
        print()
        if last is not None:
            print(f"[{last.generated_tokens} tokens, first after {last.ttft_s:.2f}s, "
                  f"{last.decode_tps:.1f} tok/s, {last.cached_tokens} prompt tokens cached]",
                  file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from engine.bench import run_cli  # build_parser imported it already (argparse only)

    return run_cli(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from engine.server.api import serve  # start-up: Starlette and uvicorn load only here

    def announce(line: str) -> None:
        print(line, flush=True)  # the first stdout line: scripts and tests read the address

    return serve(host=args.host, port=args.port, model=args.model,
                 api_key=args.api_key or os.environ.get("STRATA_API_KEY") or None,
                 announce=announce, max_batch=args.max_batch, max_queue=args.max_queue)


def cmd_window(args: argparse.Namespace) -> int:
    """Open the desktop window (or render it to a PNG with --screenshot)."""
    try:
        from app import main as app_main  # PySide6 loads only when the window opens
    except ImportError as exc:
        raise StrataError(f"the desktop window needs PySide6 ({exc}); "
                          "use `strata chat` in the terminal") from exc
    screenshot = getattr(args, "screenshot", None)
    if getattr(args, "demo", False) and screenshot is None:
        raise StrataError("--demo works with --screenshot FILE")
    return int(app_main.run(screenshot=screenshot, view=getattr(args, "view", "chat"),
                            demo=getattr(args, "demo", False),
                            theme=getattr(args, "theme", "system")))


def cmd_smoke(args: argparse.Namespace) -> int:
    """`strata --smoke`: one JSON line on stdout (engine/bench/smoke.py, Qt's half in
    app/smoke.py)."""
    from app.smoke import qt_probe  # PySide6 is imported by the probe itself, when it runs
    from engine.bench.smoke import run_smoke  # start-up: loads the runtime and MLX

    print(json.dumps(run_smoke(qt_probe=qt_probe), sort_keys=True), flush=True)
    return 0


# -- parser -------------------------------------------------------------------------------
def _add_draft(p: argparse.ArgumentParser) -> None:
    """generate and chat: --draft, speculative decoding's drafter."""
    p.add_argument("--draft", default="auto", metavar="{auto,off,lookup,MODEL}",
                   help="speculative decoding: auto (prompt lookup when it is faster, the "
                        "default), off, lookup (always), or a library model with the same "
                        "vocabulary that drafts")


def _add_sampling(p: argparse.ArgumentParser, temp: float) -> None:
    p.add_argument("--model", default="starter", help="library name or alias (default: starter)")
    system = p.add_mutually_exclusive_group()
    system.add_argument("--system", help="system prompt")
    system.add_argument("--system-file", help="system prompt read from this file")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=temp, help="temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="neither read nor write the prompt-prefix cache on the SSD "
                        "(STRATA_PREFIX_DIR, STRATA_PREFIX_MB)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="strata",
        description="Run language models locally. With no command, opens the window.")
    parser.add_argument("--screenshot", metavar="FILE",
                        help="render the window offscreen to a PNG after start-up, then exit")
    parser.add_argument("--view",
                        choices=("chat", "library", "memory", "benchmark", "discover"),
                        default="chat",
                        help="the view to show (default: chat)")
    parser.add_argument("--demo", action="store_true",
                        help="with --screenshot: first run a short scripted chat (temperature 0)")
    parser.add_argument("--theme", choices=("system", "light", "dark"), default="system",
                        help="window palette (default: the system's)")
    parser.add_argument("--smoke", action="store_true",
                        help="self-test: load the starter model, generate one token, print "
                             "one JSON line and exit (also in the packaged app)")
    sub = parser.add_subparsers(dest="command")

    p = sub.add_parser("pull", help="fetch the starter model or a Hugging Face repository")
    p.add_argument("what", help="'starter' or OWNER/NAME")
    p.add_argument("--name", help="library name (default: from the source)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("models", help="list the library")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("cache", help="show the page store on the SSD (stored prefixes, live "
                                     "sessions), or --clear it")
    p.add_argument("--clear", action="store_true", help="remove every stored prefix")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_cache)

    p = sub.add_parser("import", help="import a .gguf file, an MLX folder or a HF folder")
    p.add_argument("path")
    p.add_argument("--name")
    from engine.quant.cli import add_recipe_arguments  # start-up: the parser's quant part

    add_recipe_arguments(p, required=False)  # without --recipe: weights as stored
    p.add_argument("--context", type=int, metavar="TOKENS",
                   help="the context the model will run at (default: its trained one); "
                        "the memory check counts the KV at it, and loads use it")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("rm", help="remove a model from the library")
    p.add_argument("name")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("generate", help="complete one prompt")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file")
    _add_sampling(p, temp=0.7)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="no chat template")
    p.add_argument("--timeline", action="store_true", help="print the first-token timeline")
    p.add_argument("--json-schema", metavar="FILE",
                   help="constrain the output to JSON valid against this JSON schema")
    _add_kv(p)
    p.add_argument("--ranks", type=int, default=1, metavar="N",
                   help="split the model across N local processes (MLX ring on loopback)")
    _add_draft(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("join", help="serve as a rank > 0 of a model split across machines")
    p.add_argument("--hostfile", help="MLX hostfile: JSON list of [\"ip:port\"] per rank "
                   "(default: $MLX_HOSTFILE)")
    p.add_argument("--rank", type=int, help="this machine's rank (default: $MLX_RANK)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds to wait for rank 0 and the other ranks (default: 60)")
    p.add_argument("--listen", type=int, default=5170, metavar="PORT",
                   help="with no hostfile: wait for rank 0 on this port (default: 5170)")
    p.add_argument("--no-advertise", action="store_true",
                   help="with no hostfile: do not announce this machine by mDNS")
    p.add_argument("--api-key", help="the key rank 0 off loopback must prove, and this Mac "
                   "proves to it: the server's key (default: $STRATA_API_KEY)")
    p.set_defaults(func=cmd_join)

    p = sub.add_parser("chat", help="chat in the terminal")
    _add_sampling(p, temp=0.7)
    _add_draft(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="serve the OpenAI API on this machine (loopback)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: 127.0.0.1); others need an API key")
    p.add_argument("--port", type=int, default=8765, help="port (default: 8765; 0: any free)")
    p.add_argument("--model", default="starter", help="model to load first (default: starter)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' "
                   "(default: $STRATA_API_KEY)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="requests decoded together in one batch (default: 8)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting beyond the batch before a 429 (default: 64)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="measure speed and memory against mlx-lm and llama.cpp")
    from engine.bench import add_arguments  # argparse only: a suite loads when it runs

    add_arguments(p)  # every suite: quick, full, kv, prefix, kvbits
    p.set_defaults(func=cmd_bench)

    from engine.quant.cli import add_commands as add_quant_commands  # quantize, recipes, eval

    add_quant_commands(sub, open_source=_open_source, progress=_progress_printer)
    return parser


def _open_source(where: str, library: Any) -> Any:
    """engine.importers.open_source, for `strata quantize` (quant may not import importers)."""
    from engine.importers import open_source  # start-up: only when a quantize runs

    return open_source(where, library)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = (cmd_smoke if args.smoke else cmd_window) if args.command is None else args.func
    try:
        return int(func(args))
    except StrataError as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("strata: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0

