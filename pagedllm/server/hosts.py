"""Which Host headers the server answers (against DNS rebinding).

A web page can make a browser send requests to a name its attacker controls and then point that
name at 127.0.0.1: the browser treats the answers as the page's own, so a key-less server on
loopback is readable by any site its user visits. The request still says the attacker's name in
its Host header: a loopback server answers only Host names that mean loopback (localhost,
127.0.0.1, [::1], any port) unless told others (--allowed-hosts). A server bound to another
address accepts any Host unless given a list, and so does one on a unix socket (--uds), which no
browser can reach: its clients name whatever host they like (vLLM's test client names the socket
file, `http://vllm.sock/`).
"""

from __future__ import annotations

import ipaddress

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
ANY_HOST = "*"


def allowed_hosts_for(bind_host: str, given: list[str] | None,
                      unix_socket: bool = False) -> tuple[str, ...] | None:
    """The Host names to accept (lowercase, without ports); None: any. unix_socket: the server
    listens on a unix socket (bind_host unused)."""
    if given is not None:
        names = tuple(_without_port(name.strip().lower()) for name in given if name.strip())
        return None if ANY_HOST in names else names
    return LOOPBACK_HOSTS if _is_loopback(bind_host) and not unix_socket else None


def host_allowed(host_header: str | None, allowed: tuple[str, ...]) -> bool:
    """Whether a request's Host header (None: it had none) names an allowed host."""
    if host_header is None:
        return False
    return _without_port(host_header.strip().lower()) in allowed


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _without_port(host: str) -> str:
    """'example.com:8000' -> 'example.com'; '[::1]:8000' -> '[::1]'; '::1' -> '[::1]'."""
    if host.startswith("["):
        return host[:host.index("]") + 1] if "]" in host else host
    if host.count(":") > 1:  # a bare IPv6 address
        return f"[{host}]"
    return host.split(":", 1)[0]
