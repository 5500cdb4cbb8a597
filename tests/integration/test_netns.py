"""docs/multihost.md for real: its router, prefill engine and decode engine on three "hosts".

Each host is a Linux network namespace with its own address on a private subnet, joined to one
bridge; the test process (the client) reaches them from the root namespace through the bridge's
own address. The page's three `launch/engine.py` commands are read from the page and run as
written under `ip netns exec`, with the test's addresses, secrets file (0600), shared store
directory and workdirs in place of the page's: the router binds its control socket to its host's
address (so it needs the secrets file), each engine binds its KV transfer server to its own
host's address, all three share one file block store by path. Then the page's client example
runs as written, with the client secret only. The test runs twice: on the page's IPv4 layout,
and on IPv6 (ULA) addresses in their place (`tcp://[v6]:port` in URLs).

Checked: the greedy tokens equal the reference model's; KV moves between the engines' hosts on
the DE read path (the DE reads hit blocks from the store and sends them to the PE) as well as the
PE read path, by the bytes each engine counted; a wrong secret is refused and the client secret
cannot stop the router; the admin (engine secret) stops all three with status 0. Needs root on
Linux with iproute2 (skipped otherwise). The namespaces, veth pairs and bridge are deleted and
every process killed (by PID) however the test ends; each process's log is in the test's tmp dir
(`logs/`) and reported on failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import ipaddress
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from dualpath_jax.cluster import Client, link_totals, read_link_reports, write_credentials
from dualpath_jax.configs_loader import load_config
from dualpath_jax.model.generation import reference_rounds
from dualpath_jax.model.layout import kv_bytes_per_token
from dualpath_jax.model.runner import ModelRunner
from dualpath_jax.model.transformer import init_model
from dualpath_jax.rollout import RolloutError, Session
from dualpath_jax.wire import messages
from dualpath_jax.wire.rpc import bracketed, host_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = "configs/cpu_1p1d.py:tiny"
ROUTER_PORT = 5555
WAIT_S = 300.0  # bounds a broken test (cold compiles on a loaded CPU); healthy rounds take < 1 s
HOSTS = ("router", "pe", "de")


# ----------------------------------------------------------------------------- the network


@dataclasses.dataclass(frozen=True)
class Net:
    """Three namespaces on one bridge: `ns[host]` and `ip[host]` for host in HOSTS; `client_ip`
    is the root namespace's address on the bridge (the client's)."""

    ns: dict[str, str]
    ip: dict[str, str]
    client_ip: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _why_not_netns() -> str:
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "needs the `ip` command (iproute2)"
    return ""


def _free_subnet(family: str, salt: int) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """A private subnet that overlaps no address or route on this machine: a /24 of
    10.213.0.0/16, or a /64 of fd00:213::/48; tried from a pid-derived start so that
    concurrent runs pick different ones."""
    v = "-4" if family == "ipv4" else "-6"
    used = []
    for out in (_ip(v, "-o", "addr").stdout, _ip(v, "route").stdout):
        for word in out.split():
            with contextlib.suppress(ValueError):
                used.append(ipaddress.ip_network(word, strict=False))
    for k in range(256):
        n = (salt + k) % 256
        net = ipaddress.ip_network(f"10.213.{n}.0/24" if v == "-4" else f"fd00:213:0:{n:x}::/64")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise RuntimeError(f"no free {family} subnet")


@pytest.fixture(scope="module", params=["ipv4", "ipv6"])
def net(request) -> Iterator[Net]:
    """The three hosts' namespaces on one bridge, IPv4 (the page's example) or IPv6 (ULA)."""
    why = _why_not_netns()
    if why:
        pytest.skip(why)
    pid = os.getpid()
    tag = f"dp{pid}"  # interface names have at most 15 characters
    subnet = _free_subnet(request.param, pid)
    # IPv6: no duplicate address detection, which would keep the addresses unusable a while
    opts = ["nodad"] if subnet.version == 6 else []
    bridge, ns = f"{tag}br", {h: f"{tag}-{h}" for h in HOSTS}
    veths = {h: (f"{tag}h{i}", f"{tag}n{i}") for i, h in enumerate(HOSTS)}
    made_ns: list[str] = []
    made_links: list[str] = []
    try:
        try:
            _ip("netns", "add", ns["router"])
        except subprocess.CalledProcessError as e:
            pytest.skip(f"cannot create a network namespace: {e.stderr.strip()}")
        made_ns.append(ns["router"])
        _ip("link", "add", bridge, "type", "bridge")
        made_links.append(bridge)
        _ip("addr", "add", f"{subnet[1]}/{subnet.prefixlen}", "dev", bridge, *opts)
        _ip("link", "set", bridge, "up")
        ip = {}
        for i, h in enumerate(HOSTS):
            if ns[h] not in made_ns:
                _ip("netns", "add", ns[h])
                made_ns.append(ns[h])
            outer, inner = veths[h]
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            made_links.insert(0, outer)  # deleting one end deletes the pair
            _ip("link", "set", inner, "netns", ns[h])
            _ip("link", "set", outer, "master", bridge, "up")
            ip[h] = str(subnet[i + 2])
            _ip("-n", ns[h], "addr", "add", f"{ip[h]}/{subnet.prefixlen}", "dev", inner, *opts)
            _ip("-n", ns[h], "link", "set", inner, "up")
            _ip("-n", ns[h], "link", "set", "lo", "up")
        built = Net(ns, ip, str(subnet[1]))
        blocked = _unreachable(built)
        if blocked:
            pytest.skip(blocked)
        yield built
    finally:
        leftovers = _delete_network(made_ns, made_links)
    assert not leftovers, f"could not delete {leftovers}"


_LISTEN = (
    "import socket, sys; s = socket.create_server((sys.argv[1], 0), "
    "family=socket.AF_INET6 if ':' in sys.argv[1] else socket.AF_INET); "
    "print(s.getsockname()[1], flush=True); [s.accept()[0].close() for _ in range(3)]"
)
_CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 10)"


def _unreachable(net: Net) -> str:
    """Why TCP from the other namespaces and from here does not reach the router's namespace
    ('' when it does): a firewall on bridged traffic (e.g. br_netfilter with a FORWARD policy of
    DROP) would otherwise show up as engines that never register."""
    router = net.ip["router"]
    listen = ["ip", "netns", "exec", net.ns["router"], sys.executable, "-c", _LISTEN, router]
    listener = subprocess.Popen(listen, stdout=subprocess.PIPE, text=True)
    try:
        port = listener.stdout.readline().strip()
        for h in ("pe", "de"):
            connect = ["ip", "netns", "exec", net.ns[h], sys.executable, "-c", _CONNECT]
            r = subprocess.run([*connect, router, port], capture_output=True, text=True)
            if r.returncode:
                return (
                    f"{h}'s namespace cannot reach {router} through the bridge: {r.stderr[-300:]}"
                )
        try:
            socket.create_connection((router, int(port)), 10).close()
        except OSError as e:
            return f"this namespace cannot reach {router} through the bridge: {e}"
        return ""
    finally:
        listener.kill()
        listener.wait(10)


def _delete_network(namespaces: Sequence[str], links: Sequence[str]) -> list[str]:
    """Kills whatever still runs in `namespaces` (all of it started by this test), deletes the
    links, then the namespaces; returns what is still there."""
    for n in namespaces:
        for pid in _ip("netns", "pids", n, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    for link in links:
        _ip("link", "del", link, check=False)
    for n in namespaces:
        _ip("netns", "del", n, check=False)
    left = [n for n in namespaces if n in _ip("netns", "list").stdout.split()]
    # a namespace's end of a veth pair goes when the kernel has dismantled the namespace
    for _ in range(100):
        present = [link for link in links if _ip("link", "show", link, check=False).returncode == 0]
        if not present:
            break
        time.sleep(0.05)
    return left + present


# ----------------------------------------------------------------------------- the page

DOC = ROOT / "docs" / "multihost.md"
# What the page names, and what this test puts in its place.
DOC_HOSTS = {"A": "router", "B": "pe", "C": "de"}
DOC_IP = {"router": "10.213.0.2", "pe": "10.213.0.3", "de": "10.213.0.4"}
DOC_SECRETS = "/etc/dualpath/secrets.json"
DOC_STORE = "/shared/dualpath/kv"
DOC_WORKDIR = "/var/lib/dualpath"


def doc_commands() -> dict[str, list[str]]:
    """host -> argv of the page's command for it (a `python launch/engine.py` line right after a
    `# host X (...)` comment, shell continuations joined)."""
    text = DOC.read_text().replace("\\\n", " ")
    found = re.findall(r"^# host ([A-Z]) \(.*\n(python launch/engine\.py .*)$", text, flags=re.M)
    commands = {DOC_HOSTS[h]: shlex.split(cmd) for h, cmd in found}
    assert sorted(commands) == sorted(HOSTS) and len(found) == 3, found
    assert all(f"--config={CONFIG}" in argv for argv in commands.values()), commands
    return commands


def doc_client() -> str:
    """The page's client example (the python block that connects to the router)."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    (code,) = [b for b in blocks if f'Client("tcp://{DOC_IP["router"]}:' in b]
    return code


# ----------------------------------------------------------------------------- the processes


class Hosts:
    """The three processes, each started in its host's namespace with the page's command."""

    def __init__(self, net: Net, tmp: pathlib.Path):
        self.net, self.tmp = net, tmp
        self.secrets = tmp / "secrets.json"
        self.creds = write_credentials(self.secrets)  # mode 0600, as on every real host
        self.store = tmp / "store"  # one directory every host sees by path (NFS on real hosts)
        self.address = f"tcp://{host_port(net.ip['router'], ROUTER_PORT)}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        )

    def here(self, text: str) -> str:
        """`text` of the page with this test's addresses and paths."""
        for host, ip in DOC_IP.items():
            here = self.net.ip[host]
            text = text.replace(f"//{ip}:", f"//{bracketed(here)}:").replace(ip, here)
        text = text.replace(DOC_SECRETS, str(self.secrets)).replace(DOC_STORE, str(self.store))
        return text.replace(DOC_WORKDIR, str(self.tmp))

    def start(self, host: str, argv: Sequence[str]) -> None:
        assert argv[:2] == ["python", "launch/engine.py"], argv
        (self.tmp / "logs").mkdir(exist_ok=True)
        with open(self.tmp / "logs" / f"{host}.log", "ab") as log:
            # `ip netns exec` execs the command: the PID is the process's own
            self.procs[host] = subprocess.Popen(
                ["ip", "netns", "exec", self.net.ns[host], sys.executable]
                + [self.here(a) for a in argv[1:]],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def check_alive(self) -> None:
        for host, p in self.procs.items():
            assert p.poll() is None, f"{host} exited with status {p.returncode} (logs below)"

    def start_all(self) -> None:
        commands = doc_commands()
        self.start("router", commands["router"])
        address_file = self.tmp / "router" / "router.address"
        deadline = time.monotonic() + WAIT_S
        while not address_file.exists():
            self.check_alive()
            assert time.monotonic() < deadline, "the router did not start listening"
            time.sleep(0.1)
        assert address_file.read_text().strip() == self.address
        self.start("pe", commands["pe"])
        self.start("de", commands["de"])
        client = Client(self.address, self.creds.client)
        try:
            while sum(e["alive"] for e in client.stats()["engines"].values()) < 2:
                self.check_alive()
                assert time.monotonic() < deadline, "the engines did not register"
                time.sleep(0.2)
        finally:
            client.close()

    def shutdown(self) -> dict[str, int]:
        """The admin's stop (engine secret): the router shuts down, the engines follow. Returns
        each process's exit status."""
        admin = Client(self.address, self.creds.engine)
        try:
            admin.shutdown(timeout_s=WAIT_S)
        finally:
            admin.close()
        for p in self.procs.values():
            p.wait(WAIT_S)
        return {h: p.returncode for h, p in self.procs.items()}

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(30)


@pytest.fixture
def hosts(net, tmp_path, report_logs) -> Iterator[Hosts]:
    """The router and both engines, started; they are killed, by PID, at the end of the test
    whatever happens, and a failing test reports their log tails."""
    report_logs(tmp_path)
    h = Hosts(net, tmp_path)
    try:
        h.start_all()
        yield h
    finally:
        h.kill_all()


# ----------------------------------------------------------------------------- the test

BT = 16  # configs/cpu_1p1d.py's block size


def trajectory(seed: int, rounds: int = 3) -> list[tuple[list[int], int]]:
    """Appends of 2-3 blocks, so every later round hits at least two stored blocks."""
    rs = np.random.RandomState(seed)
    return [(rs.randint(0, 257, int(rs.randint(33, 48))).tolist(), 4) for _ in range(rounds)]


def run_round(client: Client, sessions, appends, hold_pid: int = 0) -> list[messages.RoundResult]:
    """Submits one round of every session back to back. With `hold_pid` (the PE), the PE is
    held (SIGSTOP) until every round waits for it, so one PE fetch assigns them all and the
    scheduler's rule puts the first on the PE read path (a tie: both read queues are empty) and
    the next on the DE's, now the shorter queue."""
    if hold_pid:
        os.kill(hold_pid, signal.SIGSTOP)
    try:
        futs = [s.step_async(*a) for s, a in zip(sessions, appends, strict=True)]
        deadline = time.monotonic() + WAIT_S
        while hold_pid and client.stats()["queued"]["pe_waiting"] < len(futs):
            assert time.monotonic() < deadline, "the rounds never waited for the PE"
            time.sleep(0.02)
    finally:
        if hold_pid:
            os.kill(hold_pid, signal.SIGCONT)
    return [f.result(WAIT_S) for f in futs]


def events(workdir: pathlib.Path) -> list[dict]:
    text = (workdir / "events.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def reported_links(client: Client) -> dict[str, int]:
    """Bytes per link as the engines last reported them to the router (with their fetches)."""
    return {
        name: link["bytes"]
        for e in client.stats()["engines"].values()
        for name, link in ((e.get("links") or {}).get("links") or {}).items()
    }


def test_the_pages_three_hosts_in_network_namespaces(hosts, net):
    cfg = load_config(CONFIG)
    runner = ModelRunner(init_model(cfg.model, seed=cfg.seed))
    block = BT * kv_bytes_per_token(cfg.model)

    # the page's client example, as written (it opens its own client with the client secret)
    out = io.StringIO()
    code = hosts.here(doc_client())
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(DOC), "exec"), {})  # the page's example as written
    printed = out.getvalue().splitlines()
    assert printed[:2] == [
        str(t) for t in reference_rounds(runner, [(list(range(40)), 4), (list(range(40, 60)), 4)])
    ]
    comment = re.search(r"read_path_counts\"\]\)\s*# (.*)", code).group(1)
    assert printed[2] == comment

    # two sessions in lockstep: rounds 1 and 2 read one hit on each side
    trajs = [trajectory(1), trajectory(2)]
    client = Client(hosts.address, hosts.creds.client)
    try:
        sessions = [Session(client, f"lockstep-{k}") for k in range(len(trajs))]
        pe_pid = hosts.procs["pe"].pid
        results = [  # [round][session]
            run_round(client, sessions, [t[i] for t in trajs], pe_pid if i else 0) for i in range(3)
        ]
        assigned = [e for e in events(hosts.tmp / "router") if e["kind"] == "assign"]
        de_blocks = sum(e["de_blocks"] for e in assigned)
        pe_blocks = sum(e["pe_blocks"] for e in assigned)
        # what the engines tell the router: the DE sent every block it read to the PE
        deadline = time.monotonic() + WAIT_S
        while reported_links(client).get("cnic_tx:de1", 0) < de_blocks * block:
            assert time.monotonic() < deadline, reported_links(client)
            time.sleep(0.1)
        stats = client.stats()
        # a wrong secret is refused; the client secret cannot stop the router
        intruder = Client(hosts.address, "0" * 48)
        try:
            with pytest.raises(RolloutError, match="refused this client") as err:
                intruder.stats(timeout_s=WAIT_S)
            assert err.value.kind == "auth"
        finally:
            intruder.close()
        with pytest.raises(RolloutError, match="needs the engine secret") as err:
            client.shutdown(timeout_s=WAIT_S)
        assert err.value.kind == "auth"
    finally:
        client.close()
    codes = hosts.shutdown()  # the engines write their link reports as they stop

    assert [[list(rr[k].tokens) for rr in results] for k in range(len(trajs))] == [
        reference_rounds(runner, t) for t in trajs
    ]
    # each engine's transfer server listens on its own host's address
    engines = {e["role"]: e for e in stats["engines"].values()}
    assert engines["prefill"]["address"].startswith(bracketed(net.ip["pe"]) + ":"), engines
    assert engines["decode"]["address"].startswith(bracketed(net.ip["de"]) + ":"), engines
    assert [r.read_path for r in results[0]] == ["none", "none"]
    assert [sorted(r.read_path for r in rr) for rr in results[1:]] == [["de", "pe"]] * 2
    later = [r for rr in results[1:] for r in rr]
    assert all(r.cached_tokens >= 2 * BT and r.recomputed_blocks == 0 for r in later)
    assert de_blocks > 0 and pe_blocks > 0, assigned
    # The bytes each engine counted on its links (pe0 on node 0, de1 on node 1): on the DE read
    # path the DE's node read its blocks from the store and the DE sent them all to the PE,
    # which received them; on both paths the PE sent the KV it computed to the DE.
    links = link_totals(read_link_reports(hosts.tmp / "pe") + read_link_reports(hosts.tmp / "de"))
    assert links["snic_rx:node1"] == links["cnic_tx:de1"] == de_blocks * block, links
    assert links["cnic_rx:pe0"] == links["cnic_tx:de1"], links
    assert links["snic_rx:node0"] == pe_blocks * block, links
    assert links["cnic_tx:pe0"] == links["cnic_rx:de1"] > 0, links
    assert stats["counters"]["errors"] == 0, stats["counters"]
    assert codes == {"router": 0, "pe": 0, "de": 0}
