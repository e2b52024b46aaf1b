"""Before horovodrun's elastic driver starts: run the discovery script once, and choose the interface.

Without ``--network-interface`` horovodrun's elastic driver waits for a *second* host to find the
interfaces hosts share, for its whole elastic timeout (600 s by default) and silently: on one
host with several slots (one node, several GPUs) nothing ever started. The interface is known
whenever the discovery script lists one host: loopback when that host is this machine, else
the one this machine's route to it uses. Mistakes in the script's output (nothing listed, a
bad line, fewer slots than ``--min-np``) are refused here, in one line, instead of waited on.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import subprocess
from pathlib import Path

from ..errors import ConfigError
from .vocabulary import HOST_SLOTS

__all__ = ["DEFAULT_ELASTIC_TIMEOUT", "discover", "is_this_machine", "route_interface", "elastic_interface"]

# How long horovodrun's elastic driver may wait for --min-np slots before it gives up with an
# error (its own default, 600 s, looks like a hang). Documented in docs/elastic.md.
DEFAULT_ELASTIC_TIMEOUT = 120


def discover(script: str, timeout: float = 30.0) -> dict[str, int]:
    """host -> slots, as horovodrun will read them from ``script`` (one ``host[:slots]`` a line)."""
    path = Path(script)
    if not path.is_file():
        raise ConfigError(f"--host-discovery-script {script} does not exist", "give the path of an executable script")
    try:
        proc = subprocess.run([str(path.resolve())], capture_output=True, text=True, timeout=timeout)
    except PermissionError:
        raise ConfigError(f"--host-discovery-script {script} is not executable", f"chmod +x {script}") from None
    except OSError as exc:
        raise ConfigError(f"--host-discovery-script {script} cannot run: {exc.strerror}",
                          "give it a #! line and make it executable") from None
    except subprocess.TimeoutExpired:
        raise ConfigError(f"--host-discovery-script {script} did not finish within {timeout:.0f} s",
                          "horovodrun runs it every second: it must answer at once") from None
    if proc.returncode != 0:
        detail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise ConfigError(f"--host-discovery-script {script} failed: {detail}", "run it by hand to see why")
    hosts: dict[str, int] = {}
    for line in proc.stdout.split():
        m = HOST_SLOTS.match(line)
        if not m or (m.group(2) is not None and int(m.group(2)) < 1):
            raise ConfigError(f"--host-discovery-script {script} printed {line!r}, not host:slots",
                              "print one host:slots per line, e.g. node1:4")
        hosts[m.group(1)] = int(m.group(2) or 1)
    return hosts


def is_this_machine(host: str) -> bool:
    """Whether ``host`` names this machine (a local address binds; a remote one does not)."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    if ipaddress.ip_address(address).is_loopback:
        return True
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return False
    return True


def route_interface(host: str) -> str | None:
    """The interface this machine reaches ``host`` through (``ip route get``), or None."""
    try:
        address = socket.gethostbyname(host)
        out = subprocess.run(["ip", "-o", "route", "get", address], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"\bdev (\S+)", out)
    return m.group(1) if m else None


def elastic_interface(hosts: dict[str, int], min_np: int, script: str, iface: str | None) -> str | None:
    """Check the discovered slots against ``min_np``; the interface horovodrun must be given.

    ``iface`` (--iface) wins. With one host listed: loopback if it is this machine, else its
    route's interface. With several, None: horovodrun finds the interfaces they share.
    """
    slots = sum(hosts.values())
    if not hosts:
        raise ConfigError(f"--host-discovery-script {script} lists no host",
                          "it must print at least --min-np slots before the job starts")
    if slots < min_np:
        listed = ", ".join(f"{h}:{n}" for h, n in hosts.items())
        raise ConfigError(f"--host-discovery-script {script} lists {slots} slot(s) ({listed}), but --min-np {min_np} "
                          "needs that many to start", "lower --min-np or list more slots")
    if iface:
        return iface
    if len(hosts) == 1:
        (host,) = hosts
        return "lo" if is_this_machine(host) else route_interface(host)
    return None
