"""Macs that can join a split model: a waiting `strata join`, found by mDNS or by address.

Contract: `Waiter(port)` is a `strata join` with no hostfile: it listens on TCP `port` (JSON
lines, one request a connection: `info` -> this machine's `facts()`; `reserve` -> a free port
for its rank; `invite` (hosts, rank, control) -> it runs that rank as a child process, one
group at a time, then waits again, since MLX's group is process-global) and, unless told
not to, advertises itself by mDNS (`_strata._tcp.local.`, through `zeroconf`) with the same
facts in its TXT record. On rank 0's side, `browse(seconds)` lists the waiters mDNS finds,
`probe("host:port")` asks one typed by address, and `start_invited(model, waiters)` reserves a
port on each, invites them and starts the split (engine.runtime.cluster.start);
`preflight(model, peers)` says whether the model fits this Mac and across the peers, per Mac.
Every wait has a deadline; a waiter that cannot be reached or refuses is one ClusterError
line. From off loopback, `reserve` and `invite` first prove the server's key (the waiter
answers a challenge; `ask(..., key=)`); `info` stays open, as mDNS publishes it anyway.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine import __version__ as STRATA_VERSION
from engine.kv import KVSettings
from engine.library import Library
from engine.platform import compute_profile, memory_facts
from engine.runtime.cluster import (
    CONTROL_ENV,
    JOIN_COMMAND,
    JOIN_TIMEOUT_S,
    KEY_ENV,
    SPLIT_ENV,
    Cluster,
    cluster_key,
    free_ports,
    key_proof,
    needs_key,
    proof_ok,
    start,
    write_hostfile,
)
from engine.runtime.cluster_split import ClusterError, choose_split
from engine.runtime.fit import ClusterFit, Fit, WeightSizes, chosen_context, cluster_fit, estimate
from engine.runtime.model import mlx_lm_version, read_config

SERVICE = "_strata._tcp.local."
WAIT_PORT = 5170  # `strata join`'s default listening port
ASK_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Peer:
    """A Mac waiting to join: where to reach it and what it says about itself."""

    address: str  # "host:port" of its waiter
    host: str
    strata: str
    mlx: str
    mlx_lm: str
    profile: str
    total_bytes: int
    available_bytes: int
    busy: bool = False
    pid: int | None = None  # the invited rank's process while busy

    @classmethod
    def from_facts(cls, address: str, d: dict[str, Any]) -> Peer:
        return cls(address, str(d.get("host", "")), str(d.get("strata", "")),
                   str(d.get("mlx", "")), str(d.get("mlx-lm", "")), str(d.get("profile", "")),
                   int(d.get("total_bytes", 0)), int(d.get("available_bytes", 0)),
                   str(d.get("busy", "")).lower() in ("1", "true"),
                   int(d["pid"]) if d.get("pid") else None)


def facts(busy: bool = False) -> dict[str, Any]:
    """This machine as a waiter describes it (also its mDNS TXT record)."""
    mem = memory_facts()
    return {"host": socket.gethostname(), "strata": STRATA_VERSION,
            "mlx": str(getattr(mx, "__version__", None)), "mlx-lm": mlx_lm_version(),
            "profile": compute_profile().name, "total_bytes": mem.total_bytes,
            "available_bytes": mem.available_bytes, "busy": busy}


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(f"{addr!r}: not a host:port address")
    return host, int(port)


def ask(address: str, request: dict[str, Any], timeout: float = ASK_TIMEOUT_S,
        key: str | None = None) -> dict[str, Any]:
    """One request to a waiter at "host:port", its one-line answer. A waiter that asks for
    the key (off loopback: a reserve or an invite) gets `key`'s proof (default
    $STRATA_API_KEY, the server's key)."""
    host, port = _split(address)
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock, \
                sock.makefile("rwb") as f:
            f.write(json.dumps(request).encode() + b"\n")
            f.flush()
            line = f.readline()
            with contextlib.suppress(ValueError, AttributeError):
                challenge = json.loads(line).get("challenge")
                if challenge:
                    mine = cluster_key(key)
                    if mine is None:
                        raise ClusterError(f"{address}: it asks for the key (the server's "
                                           f"key): set {KEY_ENV} or the window's server key")
                    f.write(json.dumps({"proof": key_proof(mine, "invite", str(challenge))})
                            .encode() + b"\n")
                    f.flush()
                    line = f.readline()
    except OSError as exc:
        raise ClusterError(f"{address}: no Strata waiting there ({exc})") from exc
    try:
        answer = json.loads(line)
    except ValueError as exc:
        raise ClusterError(f"{address}: not a Strata join ({exc})") from exc
    if not isinstance(answer, dict):
        raise ClusterError(f"{address}: not a Strata join")
    if "refused" in answer:
        raise ClusterError(f"{address}: {answer['refused']}")
    return answer


def probe(address: str) -> Peer:
    """A waiter typed by address: what it says about itself."""
    return Peer.from_facts(address, ask(address, {"op": "info"}))


# -- the waiting side -------------------------------------------------------------------------
class Waiter:
    """`strata join` with no hostfile: answers info, reserves ports, runs invited ranks."""

    def __init__(self, port: int = WAIT_PORT, host: str = "0.0.0.0",
                 join_command: Sequence[str] = JOIN_COMMAND, advertise: bool = True,
                 say: Callable[[str], None] | None = None,
                 env: dict[str, str] | None = None, key: str | None = None) -> None:
        self.srv = socket.create_server((host, port))
        # The key a reserve or invite from off loopback must prove (the server's key); the
        # invited rank proves and checks it again on rank 0's control line.
        self.key = cluster_key(key) if env is None else key or env.get(KEY_ENV) or None
        self.port = int(self.srv.getsockname()[1])
        self.join_command = list(join_command)
        self.say = say or (lambda _m: None)
        self.env = dict(os.environ if env is None else env)
        if self.key:
            self.env[KEY_ENV] = self.key
        self.child: subprocess.Popen[bytes] | None = None
        self.runs: list[int] = []  # exit codes of the ranks run so far
        self._stop = threading.Event()
        self._zc: Any = None
        self._info: Any = None
        if advertise:
            self._advertise()

    def _advertise(self) -> None:
        import zeroconf  # third-party; only a waiter that advertises needs it

        addr = os.environ.get("STRATA_MDNS_INTERFACE") or local_address()
        props = {k: str(v) for k, v in facts().items()}
        name = f"{socket.gethostname()}-{self.port}.{SERVICE}"
        self._info = zeroconf.ServiceInfo(SERVICE, name, port=self.port, properties=props,
                                          addresses=[socket.inet_aton(addr)],
                                          server=f"{socket.gethostname()}.local.")
        self._zc = zeroconf.Zeroconf(interfaces=_interfaces(addr))
        self._zc.register_service(self._info)

    @property
    def busy(self) -> bool:
        return self.child is not None and self.child.poll() is None

    def serve(self, once: bool = False) -> None:
        """Answer until `stop()` (`once`: until one invited rank has run)."""
        self.srv.settimeout(0.2)
        while not self._stop.is_set():
            if self.child is not None and self.child.poll() is not None:
                self.runs.append(int(self.child.returncode))
                self.say(f"the rank ended (code {self.child.returncode}); waiting again")
                self.child = None
                if once:
                    return
            try:
                conn, _ = self.srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(ASK_TIMEOUT_S)
        try:
            peer = str(conn.getpeername()[0])
            with conn.makefile("rwb") as f:
                try:
                    req = json.loads(f.readline())
                    req = req if isinstance(req, dict) else {}
                    why = self._key_refusal(f, peer) if req.get("op") != "info" else None
                    reply = {"refused": why} if why else self._reply(req)
                except (ValueError, KeyError, TypeError, ClusterError) as exc:
                    reply = {"refused": f"bad request ({exc})"}
                f.write(json.dumps(reply).encode() + b"\n")
                f.flush()
        except OSError:
            pass  # the asker went away: nothing to answer

    def _key_refusal(self, f: Any, peer: str) -> str | None:
        """Off loopback, anything but `info` first proves the key (HMAC of a fresh nonce)."""
        if not needs_key(peer):
            return None
        if self.key is None:
            return (f"{peer} is off loopback and this waiter has no key: start strata join "
                    f"with --api-key (the server's key) or {KEY_ENV}")
        nonce = secrets.token_hex(16)
        f.write(json.dumps({"challenge": nonce}).encode() + b"\n")
        f.flush()
        answer = json.loads(f.readline() or b"{}")
        if not proof_ok(self.key, "invite", nonce, answer.get("proof")):
            return f"{peer}: wrong or missing key (the server's key)"
        return None

    def _reply(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "info":  # with the invited rank's process id while one runs
            pid = self.child.pid if self.busy and self.child is not None else None
            return {**facts(self.busy), "pid": pid}
        if self.busy:
            return {"refused": "busy: already a rank of a split model"}
        if op == "reserve":  # the ring binds it on whichever address rank 0 reaches us at
            return {"port": free_ports(1, "0.0.0.0")[0]}
        if op == "invite":
            self._run(list(req["hosts"]), int(req["rank"]), str(req["control"]))
            return {"ok": True}
        return {"refused": f"unknown request {op!r}"}

    def _run(self, hosts: list[str], rank: int, control: str) -> None:
        fd, name = tempfile.mkstemp(prefix="strata-hosts-", suffix=".json")
        os.close(fd)
        hostfile = write_hostfile(hosts, Path(name))
        env = {**self.env, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank),
               CONTROL_ENV: control}
        self.say(f"invited as rank {rank} of {len(hosts)} (rank 0 at {hosts[0]})")
        # A fresh process per group: MLX's group lives as long as its process.
        self.child = subprocess.Popen(self.join_command, env=env, stdin=subprocess.DEVNULL)

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self.srv.close()
        if self._zc is not None:
            with contextlib.suppress(Exception):  # noqa: BLE001 - leaving the network anyway
                self._zc.unregister_service(self._info)
            self._zc.close()
            self._zc = None
        if self.child is not None and self.child.poll() is None:
            self.child.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.child.wait(5)
            if self.child.poll() is None:
                self.child.kill()
                self.child.wait()


def local_address(toward: str = "224.0.0.251") -> str:
    """The address this machine is reached at on the local network (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((toward, 5353))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def _interfaces(addr: str) -> Any:
    import zeroconf  # third-party, as above

    # STRATA_MDNS_INTERFACE: one interface address to announce and browse on (tests: loopback).
    only = os.environ.get("STRATA_MDNS_INTERFACE")
    return [only] if only else zeroconf.InterfaceChoice.All


# -- rank 0's side ----------------------------------------------------------------------------
def browse(seconds: float = 2.0) -> list[Peer]:
    """The waiters mDNS finds within `seconds` (each asked for its TXT facts)."""
    import zeroconf  # third-party; only browsing needs it

    found: dict[str, Peer] = {}
    zc = zeroconf.Zeroconf(interfaces=_interfaces(local_address()))

    class _Listener(zeroconf.ServiceListener):
        def add_service(self, z: Any, kind: str, name: str) -> None:
            info = z.get_service_info(kind, name, timeout=int(seconds * 1000))
            if info is None or not info.parsed_addresses():
                return
            props = {k.decode(): (v or b"").decode() for k, v in info.properties.items()}
            address = f"{info.parsed_addresses()[0]}:{info.port}"
            found[address] = Peer.from_facts(address, props)

        def update_service(self, z: Any, kind: str, name: str) -> None:
            self.add_service(z, kind, name)

        def remove_service(self, z: Any, kind: str, name: str) -> None:
            pass

    try:
        browser = zeroconf.ServiceBrowser(zc, SERVICE, _Listener())
        time.sleep(seconds)  # mDNS answers arrive over this window; there is no "done"
        browser.cancel()
    finally:
        zc.close()
    return sorted(found.values(), key=lambda p: p.address)


def start_invited(model: str | Path, waiters: Sequence[str], library: Library | None = None,
                  kv: KVSettings | None = None, host: str | None = None,
                  timeout: float = JOIN_TIMEOUT_S, key: str | None = None) -> Cluster:
    """Rank 0 here, one rank on each waiter ("host:port"): a port reserved on each, each
    invited with the hostfile, then `start`. `host`: this machine's address as the others
    reach it (default: the local network's, or loopback when every waiter is on it). `key`:
    the server's key, proved to waiters and ranks off loopback (default $STRATA_API_KEY)."""
    if not waiters:
        raise ClusterError("no Macs to run across: find or type at least one")
    hosts_of = [_split(w)[0] for w in waiters]
    local = all(h in ("127.0.0.1", "localhost") for h in hosts_of)
    me = host or ("127.0.0.1" if local else local_address(hosts_of[0]))
    mine, control = free_ports(2, me)
    hosts = [f"{me}:{mine}"]
    for w, h in zip(waiters, hosts_of, strict=True):
        hosts.append(f"{h}:{ask(w, {'op': 'reserve'}, key=key)['port']}")
    for rank, w in enumerate(waiters, start=1):
        ask(w, {"op": "invite", "hosts": hosts, "rank": rank, "control": f"{me}:{control}"},
            key=key)
    return start(model, hosts, library, timeout=timeout, control=f"{me}:{control}", kv=kv,
                 key=key)


def preflight(model: str | Path, peers: Sequence[Peer], library: Library | None = None,
              context: int | None = None) -> tuple[Fit, ClusterFit | None]:
    """Will `model` fit this Mac, and across this Mac and `peers` (None: no peers)? From the
    library's manifest and config only (nothing loads); the split is the one `start` would
    choose, pipeline layers shared by each Mac's available memory."""
    manifest = (library or Library()).get(str(model))
    folder = Path(manifest["path"])
    config = read_config(folder)
    profile = compute_profile()
    weights = WeightSizes(quant_params=int(manifest.get("params") or 0),
                          quant_bytes=int(manifest.get("bytes") or 0))
    one = estimate(config, weights, profile, chosen_context(config, folder, context))
    if not peers:
        return one, None
    available = [("this Mac", one.available_bytes)] + [
        (p.host or p.address, p.available_bytes) for p in peers]
    plan = choose_split(config, len(available), os.environ.get(SPLIT_ENV) or None,
                        shares=[float(a) for _, a in available])
    return one, cluster_fit(one, config, available, plan.mode, plan.layers)
