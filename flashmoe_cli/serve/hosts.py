"""Which `Host` a request may name: the address the server was bound to, unless `--allow-host`.

A web page can make a browser send requests to 127.0.0.1 by giving its own name an address there
(DNS rebinding); the browser then treats the server's replies as the page's own, and the page reads
them. Such a request names the page's host, not this server's, so a Host that is not one of the
server's names is refused (HTTP 421). Bound to one address, the names are that address (and, for a
loopback address, `localhost` and the other loopback spellings); bound to every interface
(0.0.0.0, ::), any IP address and `localhost`: a name there (a LAN hostname, a domain) has to be
given with `--allow-host NAME` (repeatable; `*` turns the check off). A request with no Host
(HTTP/1.0, a hand-written client) is no browser's and passes.
"""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
ANY = ("0.0.0.0", "::", "")


class HostCheck:
    def __init__(self, bound: str, allowed: tuple[str, ...] = ()):
        self.off = "*" in allowed
        self.bound = bound.strip("[]").lower()
        self.names = {self.bound} | {a.strip("[]").lower() for a in allowed}
        self.any_ip = self.bound in ANY
        if self.any_ip or _loopback(self.bound):
            self.names |= LOOPBACK_NAMES

    def problem(self, host: str | None) -> str | None:
        """Why a request with this Host header is refused, or None."""
        if self.off or host is None:
            return None
        name = _name(host)
        if name in self.names or (self.any_ip and _is_ip(name)) or (_loopback(name) and _loopback(self.bound)):
            return None
        shown = host[:100].encode("ascii", "backslashreplace").decode("ascii")
        return (
            f"Host {shown!r} is not this server's address ({self.bound or 'any'}): a web page reaching it "
            f"under another name is refused (start the server with --allow-host {name[:100] or 'NAME'} if "
            "that name is really its own)"
        )


def _name(host: str) -> str:
    """The host part of a Host header, without the port, lowercase ('[::1]:8080' -> '::1')."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        return host.split(":", 1)[0]
    return host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _loopback(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
