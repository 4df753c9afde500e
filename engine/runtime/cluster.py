"""One model across several machines (or local processes): start or join an MLX group.

Contract: rank 0 (the window, or `generate --ranks N`) calls `start(model, hosts)` or
`start_local(model, n, join_command)` (which spawns N-1 local ranks on loopback); every other
rank runs `join()`. Before anything loads, a handshake over a plain TCP control socket (JSON
lines, rank 0 listening; every wait has a deadline of ours) checks that all ranks run the same
Strata, MLX and mlx-lm versions, compute profile and model fingerprint (the library
manifest's), and refuses in one line naming what differs. Off loopback both sides first prove
the server's key (`cluster_key`: HMAC of the other's fresh nonce; nothing about the job before
it); a rank with no copy of a library model is sent its folder on the same line
(`send_model` / `receive_model`: installed atomically, kept only with the announced
fingerprint). Only then does every rank call
`mx.distributed.init(backend="ring", strict=True)` (MLX_HOSTFILE: a JSON list of
["ip:port"], MLX_RANK), load its share (engine.runtime.cluster_split) and, on rank 0, become a
`LoadedModel` whose forward drives every rank (`kv`: engine.kv's paged settings, which every
rank's caches then use over its own heads or layers). Each rank reports its share's weight
bytes and memory once loaded (`Cluster.ranks`), and its memory and KV when asked
(`Cluster.rank_memory`, the memory panel's rows). Tensors travel only over MLX's transport. A
rank that dies mid-reply ends the reply on rank 0 with one line (`Cluster` as a context
manager turns MLX's RuntimeError into `ClusterError`); `Cluster.close()` stops the others and
reaps the processes it started. `python -m engine.runtime.cluster` is `join()` from the
environment (MLX_HOSTFILE, MLX_RANK), for callers below the command.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import faulthandler
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any

import mlx.core as mx

from engine import __version__ as STRATA_VERSION
from engine.errors import StrataError
from engine.kv import KVGeometry, KVSettings
from engine.kv.prefix import PrefixCache, PrefixSettings, model_key
from engine.kv.prefix import settings_from_env as prefix_settings_from_env
from engine.library import Library, Manifest
from engine.library.store import MANIFEST
from engine.library.store import fingerprint as store_fingerprint
from engine.platform import ComputeProfile, MemorySnapshot, compute_profile, memory_facts
from engine.runtime.cluster_split import (
    ClusterError,
    ClusterPrefixCache,
    Follower,
    SplitModel,
    SplitPlan,
    choose_split,
    load_share,
    share_bytes,
    share_geometry,
    split_identity,
)
from engine.runtime.generate import LoadedModel
from engine.runtime.model import (
    ensure_mlx_lm,
    mlx_lm_version,
    model_identity,
    read_config,
    weights_fingerprint,
)
from engine.runtime.tokenizer import Tokenizer
from engine.telemetry import Timeline

__all__ = ["JOIN_COMMAND", "Cluster", "ClusterError", "SplitLoadedModel", "cluster_key",
           "identity", "join", "key_proof", "needs_key", "read_hostfile", "receive_model",
           "send_model", "start", "start_local", "write_hostfile"]

JOIN_TIMEOUT_S = 60.0
# STRATA_CLUSTER_CONTROL: the control socket's address (default: rank 0's host, port + 1).
CONTROL_ENV = "STRATA_CLUSTER_CONTROL"
# STRATA_CLUSTER_SPLIT: 'tensor' or 'pipeline' forces the split (default: tensor where it can).
SPLIT_ENV = "STRATA_CLUSTER_SPLIT"
# A joining rank started from the engine (the command has its own `strata join`).
JOIN_COMMAND = (sys.executable, "-m", "engine.runtime.cluster")
# The key off-loopback control and invite traffic must prove it holds: the server's key.
KEY_ENV = "STRATA_API_KEY"
# STRATA_CLUSTER_REQUIRE_KEY=1: ask for the key on loopback too (a policy test, a paranoid Mac).
REQUIRE_KEY_ENV = "STRATA_CLUSTER_REQUIRE_KEY"
NO_KEY = ("it has no key: off loopback the ranks must hold the server's key "
          "(STRATA_API_KEY, strata join --api-key)")


# -- hostfile and control socket --------------------------------------------------------------
def read_hostfile(path: str | Path) -> list[str]:
    """The ranks' "ip:port" addresses from an MLX hostfile (a JSON list of ["ip:port"] or of
    "ip:port"); one line naming the file if it is not one."""
    try:
        data = json.loads(Path(path).read_text())
        hosts = [h[0] if isinstance(h, list) else h for h in data]
        if len(hosts) < 2 or not all(isinstance(h, str) and ":" in h for h in hosts):
            raise ValueError("need a list of at least two 'ip:port'")
    except (OSError, ValueError, TypeError, IndexError) as exc:
        raise ClusterError(f"{path}: not an MLX hostfile ({exc})") from exc
    return [str(h) for h in hosts]


def write_hostfile(hosts: Sequence[str], path: Path) -> Path:
    path.write_text(json.dumps([[h] for h in hosts]))
    return path


def _split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    try:
        return host, int(port)
    except ValueError as exc:
        raise ClusterError(f"{addr!r}: not an ip:port address") from exc


def control_address(hosts: Sequence[str], control: str | None = None) -> tuple[str, int]:
    """`control` ("host:port"), else $STRATA_CLUSTER_CONTROL, else rank 0's host, port + 1."""
    if control or os.environ.get(CONTROL_ENV):
        return _split_addr(control or os.environ[CONTROL_ENV])
    host, port = _split_addr(hosts[0])
    return host, port + 1


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct free TCP ports on `host` (held together while picked, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class _Line:
    """JSON lines over a socket, every read under a deadline."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.buf = b""

    def send(self, obj: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(obj).encode() + b"\n")

    def recv(self, deadline: float, waiting: str) -> dict[str, Any]:
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClusterError(f"{self.peer}: no answer within the deadline ({waiting})")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError as exc:
                raise ClusterError(f"{self.peer}: connection lost ({waiting}: {exc})") from exc
            if not chunk:
                raise ClusterError(f"{self.peer}: closed the connection ({waiting})")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise ClusterError(f"{self.peer}: not a Strata rank ({exc})") from exc
        if not isinstance(obj, dict):
            raise ClusterError(f"{self.peer}: not a Strata rank")
        return obj

    def recv_to(self, fh: Any, n: int, timeout: float, waiting: str) -> None:
        """Exactly `n` raw bytes after the last line into `fh`, each read under `timeout`."""
        take, self.buf = self.buf[:n], self.buf[n:]
        fh.write(take)
        left = n - len(take)
        self.sock.settimeout(timeout)
        while left:
            try:
                chunk = self.sock.recv(min(left, 1 << 20))
            except OSError as exc:
                raise ClusterError(f"{self.peer}: connection lost ({waiting}: {exc})") from exc
            if not chunk:
                raise ClusterError(f"{self.peer}: closed the connection ({waiting}: "
                                   f"{left} bytes short)")
            fh.write(chunk)
            left -= len(chunk)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def gone(self) -> bool:
        """Whether the peer closed its end (its process ended), without blocking."""
        try:
            ready, _, _ = select.select([self.sock], [], [], 0)
            return bool(ready) and self.sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True


# -- the key ---------------------------------------------------------------------------------
def cluster_key(key: str | None = None) -> str | None:
    """The key this machine proves and checks: `key`, else $STRATA_API_KEY (the server's)."""
    return key or os.environ.get(KEY_ENV) or None


def needs_key(ip: str) -> bool:
    """Whether traffic with `ip` must prove the key: anything off loopback (or everything,
    with STRATA_CLUSTER_REQUIRE_KEY=1)."""
    if os.environ.get(REQUIRE_KEY_ENV) == "1":
        return True
    try:
        return not ipaddress.ip_address(ip.strip("[]")).is_loopback
    except ValueError:
        return ip != "localhost"


def key_proof(key: str, role: str, nonce: str) -> str:
    """HMAC-SHA256 of the other side's fresh nonce: proves the key without sending it."""
    return hmac.new(key.encode(), f"strata-cluster|{role}|{nonce}".encode(),
                    hashlib.sha256).hexdigest()


def proof_ok(key: str | None, role: str, nonce: str, proof: Any) -> bool:
    return (key is not None and isinstance(proof, str)
            and hmac.compare_digest(proof, key_proof(key, role, nonce)))


def _key_refusal(rank: int, ip: str, key: str | None, nonce: str,
                 answer: dict[str, Any]) -> str | None:
    """Rank 0's verdict on a joining rank's key proof (None: accepted, or not needed)."""
    if not needs_key(ip):
        return None
    if key is None:
        return (f"rank {rank} ({ip}) refused: it is off loopback and this Mac has no key "
                "(set the server's key: STRATA_API_KEY, or the window's server settings)")
    if answer.get("refused"):
        return f"rank {rank} ({ip}) refused: {answer['refused']}"
    if not proof_ok(key, "rank", nonce, answer.get("proof")):
        return f"rank {rank} ({ip}) refused: wrong or missing key (the server's key)"
    return None


# -- identity ---------------------------------------------------------------------------------
def identity(manifest: Manifest | None, profile: ComputeProfile) -> dict[str, Any]:
    """What must be the same on every rank: versions, compute profile, model fingerprint
    (None: this rank has no such model)."""
    return {
        "strata": STRATA_VERSION,
        "mlx": str(getattr(mx, "__version__", None)),
        "mlx-lm": mlx_lm_version(),
        "profile": [profile.name, profile.dtype, profile.dequantize],
        "fingerprint": None if manifest is None else weights_fingerprint(manifest),
    }


def _differs(rank: int, host: str, mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """One line naming the first thing rank `rank` differs in, or None."""
    for key, what in (("strata", "Strata version"), ("mlx", "MLX version"),
                      ("mlx-lm", "mlx-lm version"), ("profile", "compute profile"),
                      ("fingerprint", "model fingerprint")):
        a, b = mine.get(key), theirs.get(key)
        if key == "fingerprint" and b is None:
            return f"rank {rank} ({host}) refused: it has no copy of the model"
        if a != b:
            return f"rank {rank} ({host}) refused: {what} differs ({a} here, {b} there)"
    return None


def _resolve(model: str | Path, library: Library | None) -> tuple[Manifest, Path]:
    path = Path(model)
    if path.is_dir() and (path / "config.json").is_file():
        return {"name": path.name, "path": str(path)}, path
    manifest = (library or Library()).get(str(model))
    return manifest, Path(manifest["path"])


# -- shipping the model ----------------------------------------------------------------------
# Manifest fields the receiving library sets itself (Library.install) or that name this Mac.
_LOCAL_FIELDS = ("path", "name", "aliases", "bytes", "fingerprint", "created")


def _model_files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.iterdir()
                  if f.is_file() and f.name != MANIFEST and not f.name.startswith("."))


def send_model(line: _Line, rank: int, manifest: Manifest, folder: Path, timeout: float) -> None:
    """Rank 0: the model's folder to a rank that has no copy (over its authenticated control
    line), then its answer: the fingerprint of what it wrote, which must be this one."""
    files = _model_files(folder)
    want = weights_fingerprint(manifest)
    line.send({"ship": {"name": manifest.get("name"), "fingerprint": want,
                        "manifest": {k: v for k, v in manifest.items() if k not in _LOCAL_FIELDS},
                        "files": [[f.name, f.stat().st_size] for f in files]}})
    line.sock.settimeout(timeout)
    try:
        for f in files:
            with open(f, "rb") as fh:
                line.sock.sendfile(fh)
    except OSError as exc:
        raise ClusterError(f"{line.peer}: the model could not be sent ({exc})") from exc
    answer = line.recv(time.monotonic() + timeout, "the model shipped")
    ip = line.peer
    if "refused" in answer:
        raise ClusterError(f"{ip} refused the model sent: {answer['refused']}")
    if answer.get("shipped") != want:
        raise ClusterError(f"{ip} refused: the model sent arrived with fingerprint "
                           f"{answer.get('shipped')} (sent {want})")


def receive_model(line: _Line, spec: dict[str, Any], library: Library | None,
                  timeout: float) -> tuple[Manifest, Path]:
    """A rank with no copy: the folder rank 0 sends, written into this library atomically
    (Library.install: a temporary folder renamed into place only when complete, so a dropped
    line leaves nothing) and placed only if its weights' fingerprint is the one announced."""
    lib = library or Library()
    want = str(spec["fingerprint"])

    def build(tmp: Path) -> Manifest:
        for name, size in spec["files"]:
            if Path(name).name != name or name.startswith(".") or name == MANIFEST:
                raise ClusterError(f"rank 0 sent a file named {name!r}: not a model file")
            with open(tmp / name, "wb") as fh:
                line.recv_to(fh, int(size), timeout, f"the model's {name}")
        got = store_fingerprint(tmp)
        if got != want:
            raise ClusterError(f"the model sent has fingerprint {got}, not the {want} announced")
        return dict(spec["manifest"])

    manifest = lib.install(str(spec["name"]), build)
    return manifest, Path(manifest["path"])


# -- rank 0 -----------------------------------------------------------------------------------
def _gather(hosts: Sequence[str], job: dict[str, Any], mine: dict[str, Any], timeout: float,
            cancel: Callable[[], str | None], control: str | None,
            decide: Callable[[dict[int, dict[str, Any]]], dict[str, Any]] | None = None,
            key: str | None = None, ship: Callable[[int, _Line], None] | None = None
            ) -> list[tuple[_Line, dict[str, Any]]]:
    """Wait for every other rank on the control socket, check each one's identity, then tell
    all of them go (with the split: `decide(hellos by rank)`, else the job's) or the refusal
    line; returns (control line, identity) by rank, the lines left open: a rank's closing its
    line is how rank 0 sees it gone."""
    hellos: dict[int, dict[str, Any]] = {}
    host, port = control_address(hosts, control)
    n = len(hosts)
    deadline = time.monotonic() + timeout
    peers: dict[int, tuple[_Line, dict[str, Any]]] = {}
    with socket.create_server((host if host != "localhost" else "127.0.0.1", port),
                              reuse_port=False) as srv:
        try:
            while len(peers) < n - 1:
                why = cancel()
                if why:
                    raise ClusterError(f"the cluster did not start: {why}")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r in range(1, n) if r not in peers]
                    raise ClusterError(
                        f"rank{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(map(str, missing))} did not join within {timeout:g} s "
                        f"(control {host}:{port}): run `strata join` there")
                srv.settimeout(min(left, 0.5))
                try:
                    conn, addr = srv.accept()
                except TimeoutError:
                    continue
                line = _Line(conn, f"{addr[0]}:{addr[1]}")
                hello = line.recv(deadline, "hello")
                rank = int(hello.get("rank", -1))
                if not 0 < rank < n or rank in peers:
                    line.send({"refused": f"rank {rank} is not expected"})
                    line.close()
                    continue
                line.peer = f"rank {rank} ({addr[0]})"
                # The key first (both ways, off loopback): nothing about the job before it.
                nonce, asked = secrets.token_hex(16), str(hello.get("nonce") or "")
                line.send({"challenge": nonce,
                           "proof": key_proof(key, "rank0", asked) if key and asked else None})
                why = _key_refusal(rank, addr[0], key, nonce, line.recv(deadline, "its key"))
                if why:
                    for other, _ in [*peers.values(), (line, None)]:
                        with contextlib.suppress(OSError):
                            other.send({"refused": why})
                    line.close()
                    raise ClusterError(why)
                hellos[rank] = hello
                line.send(job)
                peers[rank] = (line, line.recv(deadline, "identity"))
            refusal, lacking = None, []
            for rank in sorted(peers):
                line, theirs = peers[rank]
                if ship is not None and theirs.get("fingerprint") is None and theirs.get("receive"):
                    # No copy there, but it takes one: the rest must match before it is sent.
                    theirs = {**theirs, "fingerprint": mine.get("fingerprint")}
                    lacking.append(rank)
                refusal = refusal or _differs(rank, line.sock.getpeername()[0], mine, theirs)
            for rank in lacking if not refusal else []:
                try:
                    assert ship is not None  # only then is a rank lacking
                    ship(rank, peers[rank][0])
                except ClusterError as exc:
                    refusal = str(exc)
                    break
            plan = job["plan"] if refusal or decide is None else decide(hellos)
            for line, _ in peers.values():
                with contextlib.suppress(OSError):
                    line.send({"refused": refusal} if refusal else {"go": plan})
            if refusal:
                raise ClusterError(refusal)
            return [peers[r] for r in sorted(peers)]
        except BaseException:
            for line, _ in peers.values():
                line.close()
            raise


def _init_group(hosts: Sequence[str], rank: int, hostfile: Path | None) -> Any:
    if hostfile is None:
        fd, name = tempfile.mkstemp(prefix="strata-hosts-", suffix=".json")
        os.close(fd)
        hostfile = write_hostfile(hosts, Path(name))
    # MLX reads the group from the environment; only for the init, or every process this
    # one starts later (a quantization child, a bench worker) would wait for the group too.
    saved = {k: os.environ.get(k) for k in ("MLX_HOSTFILE", "MLX_RANK")}
    os.environ["MLX_HOSTFILE"] = str(hostfile)
    os.environ["MLX_RANK"] = str(rank)
    try:
        group = mx.distributed.init(backend="ring", strict=True)
    except RuntimeError as exc:
        raise ClusterError(f"rank {rank}: the MLX group did not start ({exc})") from exc
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if group.size() != len(hosts) or group.rank() != rank:
        raise ClusterError(f"rank {rank}: MLX gave a group of {group.size()} "
                           f"(rank {group.rank()}), expected {len(hosts)}")
    return group


def _kv_to_json(kv: KVSettings | None) -> dict[str, Any] | None:
    if kv is None:
        return None
    d = dataclasses.asdict(kv)
    d["ssd_dir"] = None if kv.ssd_dir is None else str(kv.ssd_dir)
    return d


def _kv_from_json(d: dict[str, Any] | None) -> KVSettings | None:
    if not d:
        return None
    d = dict(d)
    d["ssd_dir"] = None if d.get("ssd_dir") is None else Path(d["ssd_dir"])
    return KVSettings(**d).validate()


class SplitLoadedModel(LoadedModel):
    """A LoadedModel over a SplitModel: the KV geometry is rank 0's share's (its KV heads or
    its layers), read without running a step on the other ranks. Its prefix cache holds rank
    0's part under a key naming the split, and drives every rank's (ClusterPrefixCache)."""

    @property
    def kv_geometry(self) -> KVGeometry:
        split = self.model
        if self._geometry is None:
            self._geometry = share_geometry(split.inner, split.plan, self.profile.dtype)
        return self._geometry

    def prefix_key(self) -> bytes:
        """The model's key with the split and rank 0's part in it (`split_identity`)."""
        bits, group = self.kv_encoding()
        ident = model_identity(self.manifest, self.config, self.profile, bits, group)
        return model_key(split_identity(ident, self.model.plan, 0))

    def new_prefix_cache(self, settings: PrefixSettings | None = None) -> PrefixCache:
        """As LoadedModel's, a ClusterPrefixCache: each lookup, restore and store also runs
        on every other rank, over its own page store (stored tails off: pages only)."""
        s = replace(settings or prefix_settings_from_env(), tails=False)
        if self.paged and self.kv_settings is not None:
            s = replace(s, page_tokens=self.kv_settings.page_tokens)
        bits, group = self.kv_encoding()
        pc = ClusterPrefixCache.for_geometry(self.kv_geometry, self.prefix_key(), s, bits, group)
        assert isinstance(pc, ClusterPrefixCache)  # for_geometry builds its own class
        pc.split = self.model
        pc.label(f"{self.manifest['name']} (split: {self.model.plan.mode} over "
                 f"{self.model.plan.ranks}, rank 0)")
        return pc


@dataclasses.dataclass(frozen=True)
class ClusterMemorySnapshot(MemorySnapshot):
    """A split model's MemorySnapshot (rank 0's process) with a row a rank, rank 0 first:
    host, weights_bytes (its share), kv_bytes (its caches: its heads or layers; None before
    it answered), prefix_bytes (its own page store on disk; None: no prefix cache there),
    rss_bytes, total_bytes, available_bytes."""

    ranks: tuple[dict[str, Any], ...] = ()


class Cluster:
    """Rank 0's view: the group, the split, the LoadedModel and the ranks it spawned."""

    def __init__(self, lm: LoadedModel, split: SplitModel,
                 peers: list[tuple[_Line, dict[str, Any]]],
                 procs: list[subprocess.Popen[bytes]] | None = None) -> None:
        self.lm = lm
        self.split = split
        self.lines = [line for line, _ in peers]
        self.peers = [ident for _, ident in peers]
        self.procs = procs or []
        # Per rank (0 first) once loaded: weight bytes of its share, its memory; see start.
        self.ranks: list[dict[str, Any]] = []
        # MLX's ring fails the collectives pending when a peer goes, but one posted after
        # that waits forever: every step first looks for a rank gone (process, control line).
        split.check = self.missing
        self.temp_files: list[Path] = []  # a hostfile written for local ranks
        self._closing = threading.Event()
        self._asked: set[int] = set()  # ranks asked for their memory, answer not yet read
        self.first_gone: str | None = None  # the rank the watch saw go first

    def watch(self) -> None:
        """Watch the control lines from a thread: when a rank goes (its line closes) the others
        are told to stop. With three ranks or more, a rank that loses a neighbour may be left
        waiting in a collective MLX posted after the failure, and rank 0 waiting on it; a
        survivor that ends closes its sockets, so MLX fails rank 0's pending step too."""
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self._closing.wait(0.1):
            gone = [r for r, line in enumerate(self.lines, start=1) if line.gone()]
            if not gone or self._closing.is_set():
                continue
            self.first_gone = "; ".join(f"rank {r} closed its connection" for r in gone)
            for r, line in enumerate(self.lines, start=1):
                if r not in gone:
                    with contextlib.suppress(OSError):
                        line.send({"abort": f"rank {gone[0]} is gone"})
            return

    def rank_memory(self, kv0: int | None = None, wait_s: float = 0.5
                    ) -> list[dict[str, Any]]:
        """Each rank's weights, KV and memory now (rank 0's KV: `kv0`, the pool's caches),
        asked on the control lines; a rank that does not answer within `wait_s` keeps its
        last figures (at first, its report once loaded, without KV)."""
        facts = memory_facts()
        if self.ranks:
            pc = self.lm.prefix_cache
            self.ranks[0] = {**self.ranks[0], "rss_bytes": facts.process_rss_bytes,
                             "available_bytes": facts.available_bytes, "kv_bytes": kv0,
                             "prefix_bytes": None if pc is None else pc.disk_bytes()}
        if self.split.broken or self._closing.is_set():
            return [dict(r) for r in self.ranks]
        # At most one answer outstanding a rank: data left unread on a line would hide its
        # close from `gone()` (a peek), so a late rank is read, not asked again.
        for r, line in enumerate(self.lines, start=1):
            if r not in self._asked:
                with contextlib.suppress(OSError):
                    line.send({"memory": 1})
                    self._asked.add(r)
        deadline = time.monotonic() + wait_s
        for r in sorted(self._asked):
            with contextlib.suppress(ClusterError):
                got = self.lines[r - 1].recv(deadline, "its memory")
                self._asked.discard(r)
                if r < len(self.ranks):
                    self.ranks[r] = got
        return [dict(r) for r in self.ranks]

    def snapshot(self, snap: MemorySnapshot, kv0: int | None) -> ClusterMemorySnapshot:
        """`snap` (rank 0's) with every rank's row (`rank_memory`)."""
        mine = {f.name: getattr(snap, f.name) for f in dataclasses.fields(MemorySnapshot)}
        return ClusterMemorySnapshot(**mine, ranks=tuple(self.rank_memory(kv0)))

    def missing(self) -> str | None:
        """Which ranks are gone (a spawned process exited, a control line closed), or None."""
        dead = _exited(self.procs)
        if dead:
            return dead
        gone = [f"rank {r} closed its connection"
                for r, line in enumerate(self.lines, start=1) if line.gone()]
        return "; ".join(gone) or None

    @property
    def plan(self) -> SplitPlan:
        return self.split.plan

    def lost(self, exc: BaseException) -> ClusterError:
        """The one line for a group that broke: which spawned rank exited, if one did."""
        deadline = time.monotonic() + 2.0  # a dying rank's exit is seen a moment later
        who = _exited(self.procs) or self.first_gone or self.missing()
        while not who and time.monotonic() < deadline:
            time.sleep(0.05)
            who = _exited(self.procs) or self.first_gone or self.missing()
        root = exc.__cause__ if isinstance(exc, ClusterError) and exc.__cause__ else exc
        tail = f"; {root}" if isinstance(root, RuntimeError) else ""  # MLX's own reason
        line = (f"the reply stopped after {self.split.decode_steps} decode steps: "
                f"{who or 'a rank was lost'}{tail}")
        self.split.broken = line
        return ClusterError(line)

    def explain(self, exc: BaseException) -> BaseException:
        """`exc` from a step as the cluster's one line (`lost`) when it is MLX's error from a
        lost rank or the split model's own; anything else unchanged."""
        if isinstance(exc, RuntimeError) or (isinstance(exc, ClusterError)
                                              and self.split.broken):
            return self.lost(exc)
        return exc

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if isinstance(exc, RuntimeError):
                raise self.lost(exc) from exc
            if isinstance(exc, ClusterError) and self.split.broken:
                raise self.lost(exc) from exc
        finally:
            self.close()

    def close(self, wait_s: float = 5.0) -> None:
        """Stop every rank (a quit step) and reap the processes started here: terminated,
        then killed, if they have not exited within `wait_s`."""
        self._closing.set()  # the lines close from here on: no aborts
        self.split.quit()
        deadline = time.monotonic() + wait_s
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(2.0)
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in self.temp_files:
            f.unlink(missing_ok=True)
        for line in self.lines:
            line.close()


def _loaded(rank: int, share: Any) -> dict[str, Any]:
    facts = memory_facts()
    return {"rank": rank, "weights_bytes": share_bytes(share), "rss_bytes": facts.process_rss_bytes,
            "total_bytes": facts.total_bytes, "available_bytes": facts.available_bytes,
            "host": socket.gethostname(), "mlx": str(getattr(mx, "__version__", None))}


def start(model: str | Path, hosts: Sequence[str], library: Library | None = None,
          profile: ComputeProfile | None = None, timeline: Timeline | None = None,
          timeout: float = JOIN_TIMEOUT_S, hostfile: Path | None = None,
          procs: list[subprocess.Popen[bytes]] | None = None,
          cancel: Callable[[], str | None] | None = None, control: str | None = None,
          kv: KVSettings | None = None, key: str | None = None) -> Cluster:
    """Rank 0: wait for the other ranks, check them, start the group, load rank 0's share and
    return the Cluster (its `lm` generates as a one-machine model does). `control`: the
    control socket's "host:port" (`control_address`). `kv`: paged KV settings (None or mode
    'mlx': mlx-lm's cache), set on `lm` and sent to every rank. `key`: what a rank off
    loopback must prove it holds, and this side proves to it (default $STRATA_API_KEY). A
    rank with no copy of a library model gets the model's folder, checked by fingerprint."""
    ensure_mlx_lm()
    timeline = timeline or Timeline()
    profile = profile or compute_profile()
    kv = None if kv is None or kv.mode == "mlx" else kv.validate()
    manifest, folder = _resolve(model, library)
    config = read_config(folder)
    force = os.environ.get(SPLIT_ENV) or None
    plan = choose_split(config, len(hosts), force)
    mine = identity(manifest, profile)
    job = {"model": manifest.get("name"), "fingerprint": mine["fingerprint"],
           "plan": plan.as_dict(), "kv": _kv_to_json(kv)}

    def decide(hellos: dict[int, dict[str, Any]]) -> dict[str, Any]:
        # Pipeline layers by each machine's available memory; ranks that share one machine
        # share its memory too, so there the layers are shared equally.
        nonlocal plan
        here = socket.gethostname()
        if all(h.get("host") == here for h in hellos.values()):
            return plan.as_dict()
        memory = [float(memory_facts().available_bytes)] + [
            float(hellos[r].get("memory") or 0) for r in range(1, len(hosts))]
        plan = choose_split(config, len(hosts), force, shares=memory)
        return plan.as_dict()

    def ship(rank: int, line: _Line) -> None:
        with timeline.phase("model shipped"):
            send_model(line, rank, manifest, folder, timeout)

    shippable = str(manifest.get("fingerprint") or "").startswith("sha256:")  # a library model
    with timeline.phase("cluster handshake"):
        peers = _gather(hosts, job, mine, timeout, cancel or (lambda: None), control, decide,
                        cluster_key(key), ship if shippable else None)
    try:
        with timeline.phase("cluster group"):
            group = _init_group(hosts, 0, hostfile)
        with timeline.phase("tokenizer"):
            tokenizer = Tokenizer.load(folder)
        with timeline.phase("weights"):
            share, config = load_share(folder, plan, group, profile)
    except BaseException:
        for line, _ in peers:
            line.close()
        raise
    split = SplitModel(share, config, plan, group)
    lm = SplitLoadedModel(split, config, tokenizer, manifest, profile, timeline)
    cluster = Cluster(lm, split, peers, procs)
    try:
        with timeline.phase("cluster shares"):
            # Each rank says what its share holds once loaded (its last word on the line:
            # after it, data on the line means nothing and a close means the rank is gone).
            deadline = time.monotonic() + timeout
            try:
                cluster.ranks = [_loaded(0, share)] + [
                    line.recv(deadline, "its share loaded") for line in cluster.lines]
            except ClusterError as exc:
                split.broken = str(exc)  # a rank that never loaded cannot take a quit step
                raise
        cluster.watch()
        with cluster_errors(cluster), timeline.phase("warm-up"):
            lm.warm_up()
    except BaseException:
        cluster.close()
        raise
    lm.kv_settings = kv
    return cluster


@contextlib.contextmanager
def cluster_errors(cluster: Cluster) -> Any:
    """MLX's RuntimeError from a broken group as the cluster's one line (group kept open)."""
    try:
        yield
    except RuntimeError as exc:
        raise cluster.lost(exc) from exc


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM when the process that started it exits."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_local(model: str | Path, n: int, join_command: Sequence[str] = JOIN_COMMAND,
                library: Library | None = None, profile: ComputeProfile | None = None,
                timeline: Timeline | None = None, timeout: float = JOIN_TIMEOUT_S,
                env: dict[str, str] | None = None, kv: KVSettings | None = None) -> Cluster:
    """Rank 0 with n-1 local ranks: `join_command` (the `join` subcommand, or JOIN_COMMAND)
    run n-1 times on loopback with MLX_HOSTFILE, MLX_RANK and the control address in the
    environment."""
    if n < 2:
        raise ClusterError(f"--ranks {n}: a split needs at least 2 ranks")
    ports = free_ports(n + 1)
    hosts = [f"127.0.0.1:{p}" for p in ports[:n]]
    fd, name = tempfile.mkstemp(prefix="strata-hosts-", suffix=".json")
    os.close(fd)
    hostfile = write_hostfile(hosts, Path(name))
    child_env = dict(os.environ if env is None else env)
    child_env.update({"MLX_HOSTFILE": str(hostfile), CONTROL_ENV: f"127.0.0.1:{ports[n]}"})
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(1, n):
            procs.append(subprocess.Popen(
                [*join_command], env={**child_env, "MLX_RANK": str(rank)},
                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent))  # noqa: PLW1509
        cluster = start(model, hosts, library, profile, timeline, timeout, hostfile, procs,
                        cancel=lambda: _exited(procs), control=child_env[CONTROL_ENV], kv=kv)
        cluster.temp_files.append(hostfile)
        return cluster
    except BaseException:
        hostfile.unlink(missing_ok=True)
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5.0)
            if p.poll() is None:
                p.kill()
                p.wait()
        raise


def _exited(procs: Sequence[subprocess.Popen[bytes]]) -> str | None:
    dead = [f"rank {r} exited (code {p.returncode})"
            for r, p in enumerate(procs, start=1) if p.poll() is not None]
    return "; ".join(dead) or None


# -- ranks > 0 --------------------------------------------------------------------------------
def join(hostfile: str | Path | None = None, rank: int | None = None,
         library: Library | None = None, profile: ComputeProfile | None = None,
         timeout: float = JOIN_TIMEOUT_S, say: Callable[[str], None] | None = None,
         key: str | None = None) -> int:
    """A rank > 0: reach rank 0's control socket, prove the key both ways when rank 0 is off
    loopback (`key`, default $STRATA_API_KEY), send this rank's identity, take the model's
    folder if this library has no copy, wait for go, start the group, load this rank's share
    and run rank 0's steps until it quits; returns the steps run. Every wait before the group
    runs has a deadline (`timeout` s)."""
    say = say or (lambda _msg: None)
    where = hostfile or os.environ.get("MLX_HOSTFILE")
    if not where:
        raise ClusterError("no hostfile: pass --hostfile or set MLX_HOSTFILE")
    hosts = read_hostfile(where)
    if rank is None:
        try:
            rank = int(os.environ.get("MLX_RANK", ""))
        except ValueError as exc:
            raise ClusterError("no rank: pass --rank or set MLX_RANK") from exc
    if not 0 < rank < len(hosts):
        raise ClusterError(f"rank {rank}: a joining rank is 1 to {len(hosts) - 1}")
    ensure_mlx_lm()
    profile = profile or compute_profile()
    host, port = control_address(hosts)
    deadline = time.monotonic() + timeout
    line = _connect(host, port, deadline, timeout)
    key = cluster_key(key)
    try:
        nonce = secrets.token_hex(16)
        line.send({"rank": rank, "memory": memory_facts().available_bytes,
                   "host": socket.gethostname(), "nonce": nonce})
        challenge = line.recv(deadline, "rank 0's key")
        if "refused" in challenge:
            raise ClusterError(str(challenge["refused"]))
        if needs_key(host):
            why = (NO_KEY if key is None else None if proof_ok(key, "rank0", nonce,
                   challenge.get("proof")) else "rank 0 does not hold its key")
            if why or key is None:
                with contextlib.suppress(OSError):
                    line.send({"refused": why})
                raise ClusterError(f"rank {rank}: refused rank 0 at {host}: {why}")
            line.send({"proof": key_proof(key, "rank", str(challenge.get("challenge")))})
        else:
            line.send({"proof": None})
        job = line.recv(deadline, "the model from rank 0")
        if "refused" in job:
            raise ClusterError(str(job["refused"]))
        try:
            manifest, folder = _resolve(str(job["model"]), library)
        except Exception:  # noqa: BLE001 - no copy: said to rank 0, which sends one
            manifest, folder = None, None
        line.send({**identity(manifest, profile), "receive": manifest is None})
        verdict = line.recv(time.monotonic() + timeout, "rank 0's go")
        if "ship" in verdict:
            say(f"rank {rank}: receiving {verdict['ship'].get('name')} from rank 0")
            try:
                manifest, folder = receive_model(line, verdict["ship"], library, timeout)
            except StrataError as exc:
                with contextlib.suppress(OSError):
                    line.send({"refused": str(exc)})
                raise ClusterError(f"rank {rank}: the model from rank 0 was not kept: "
                                   f"{exc}") from exc
            line.send({"shipped": weights_fingerprint(manifest)})
            verdict = line.recv(time.monotonic() + timeout, "rank 0's go")
    except BaseException:
        line.close()
        raise
    if "refused" in verdict or folder is None:
        line.close()
        raise ClusterError(str(verdict.get("refused") or "no copy of the model here"))
    plan = SplitPlan.from_dict(verdict["go"])
    say(f"rank {rank}: joining a {plan.mode} split of {job['model']} over {plan.ranks} ranks")
    # init cannot be interrupted (it holds the GIL): a C-level watchdog ends this process if
    # a neighbour never comes.
    with open(os.devnull, "w") as devnull:
        faulthandler.dump_traceback_later(timeout, exit=True, file=devnull)
        try:
            group = _init_group(hosts, rank, Path(where))
        finally:
            faulthandler.cancel_dump_traceback_later()
    share, config = load_share(folder, plan, group, profile)
    follower = Follower(share, config, plan, group, getattr(mx, profile.dtype),
                        _kv_from_json(job.get("kv")), manifest, profile)
    done = threading.Event()
    try:
        line.send(_loaded(rank, share))
        memory = _loaded(rank, share)
        threading.Thread(target=_watch_rank0, args=(line, done, rank, follower, memory),
                         daemon=True).start()
        return follower.serve()  # the control line stays open: rank 0 watches it
    except OSError as exc:
        raise ClusterError(f"rank {rank}: rank 0 closed the connection ({exc})") from exc
    except RuntimeError as exc:
        raise ClusterError(f"rank {rank}: the group was lost ({exc})") from exc
    finally:
        done.set()
        line.close()


RANK0_GRACE_S = 3.0


def _watch_rank0(line: _Line, done: threading.Event, rank: int,
                 follower: Follower | None = None, memory: dict[str, Any] | None = None) -> None:
    """Ends this process when rank 0's control line closes and the steps have not ended
    within RANK0_GRACE_S: after MLX's ring has failed its pending collectives, one posted
    later waits forever, and a follower that lost a neighbour may be in just that one. Also
    answers rank 0's `memory` requests (the memory panel's row for this Mac) meanwhile."""
    why = "rank 0 closed the connection and the group did not end"
    with contextlib.suppress(OSError):
        line.sock.settimeout(None)
        while chunk := line.sock.recv(4096):
            if b"abort" in chunk:  # rank 0 saw another rank go: end now (see Cluster.watch)
                with contextlib.suppress(ValueError):
                    why = json.loads(chunk.splitlines()[0])["abort"]
                break
            for _ in range(chunk.count(b'"memory"')):
                facts = memory_facts()
                line.send({**(memory or {"rank": rank}), "rss_bytes": facts.process_rss_bytes,
                           "available_bytes": facts.available_bytes,
                           "kv_bytes": follower.kv_bytes() if follower is not None else None,
                           "prefix_bytes": (follower.prefix_bytes() if follower is not None
                                            else None)})
        else:
            if done.wait(RANK0_GRACE_S):
                return
    if done.is_set():
        return
    print(f"strata: error: rank {rank}: {why}; stopping", file=sys.stderr, flush=True)
    os._exit(1)


def _connect(host: str, port: int, deadline: float, timeout: float) -> _Line:
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=1.0)
            return _Line(sock, f"rank 0 ({host}:{port})")
        except OSError:
            if time.monotonic() >= deadline:
                raise ClusterError(f"rank 0 did not answer at {host}:{port} within "
                                   f"{timeout:g} s") from None
            time.sleep(0.1)


if __name__ == "__main__":  # JOIN_COMMAND: a rank started by start_local below the command
    try:
        join(say=lambda msg: print(msg, file=sys.stderr, flush=True))
    except ClusterError as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        sys.exit(1)
