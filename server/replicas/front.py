"""The shipped nginx site (nginx/llm-gateway.conf and its snippet) rendered for a front door that is
not /etc/nginx: given upstream ports, listen address, snippet path and log directory. Everything else
stays as shipped, and each line that changes must be found exactly where expected, so a change to the
shipped file cannot slip past unnoticed (the e2e tests render the site with the same code)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

NGINX_DIR = Path(__file__).resolve().parents[2] / "nginx"
SITE = NGINX_DIR / "llm-gateway.conf"
SNIPPET = NGINX_DIR / "llm-gateway-proxy.conf"
SNIPPET_INSTALL_PATH = "/etc/nginx/snippets/llm-gateway-proxy.conf"
SNIPPET_INCLUDE = f"include {SNIPPET_INSTALL_PATH};"


class SiteTemplateError(RuntimeError):
    """The shipped site no longer has a line the rendering replaces."""


def replace_exactly(text: str, old: str, new: str, count: int, what: str) -> str:
    found = text.count(old)
    if found != count:
        raise SiteTemplateError(f"{what}: expected {count} x {old!r} in the shipped file, found {found}")
    return text.replace(old, new)


def nginx_binary() -> str | None:
    return shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


# The replicas' own front (`serve --replicas`) counts no failure: see render_site's `count_failures`.
NO_FAILURE_COUNT = "max_fails=0"


def upstream_lines(upstreams: list[int], params: str, fill_first: int = 0) -> list[str]:
    """One `server` line per port, each with `params` (the shipped line's: max_fails, fail_timeout).
    With `fill_first` > 0 (server.replicas_fill_first) and two or more ports, the first port takes
    requests until it has `fill_first` open (`max_conns`, counted across nginx's workers in the
    upstream's zone), and only then do the others (`backup`: nginx uses them while every primary
    server is full or failing; least_conn among them). A request the first one fails (refused, 502,
    503) goes on to the others as with least_conn (proxy_next_upstream)."""
    fill = fill_first > 0 and len(upstreams) > 1
    lines = []
    for i, port in enumerate(upstreams):
        extra = (f" max_conns={fill_first}" if i == 0 else " backup") if fill else ""
        lines.append(f"    server 127.0.0.1:{port} {params}{extra};")
    return lines


def render_site(*, upstreams: list[int], listen: str, snippet: Path, log_dir: Path, text: str | None = None,
                client_limits: bool = True, fill_first: int = 0, count_failures: bool = True) -> str:
    """llm-gateway.conf with one upstream `server` line per port (`upstream_lines`: the shipped line's
    parameters, and fill-first if asked), `listen <listen>` instead of port 80 (no IPv6 line), the
    snippet included from `snippet` and the access log under `log_dir`. `client_limits=False` keys
    the per-client request and connection limits on an empty value, which nginx never counts (a load
    test from one address).

    `count_failures=False` (the replicas' supervisor): `max_fails=0` instead of the shipped passive
    health check. A reloading replica refuses with 503 and nginx resends the request to another
    (proxy_next_upstream); counted as failures, those 503s left the replica out for `fail_timeout`
    after it was back, and a roll's next replica refusing meanwhile left nginx none (502 "no live
    upstreams"). On loopback a dead replica costs each request one refused connection; the
    supervisor restarts it, and a stalled one ends itself."""
    text = SITE.read_text() if text is None else text
    if not client_limits:
        text = replace_exactly(text, "_zone $binary_remote_addr ", "_zone $llm_gateway_no_client_key ", 2,
                               "per-client limit zones")
        text = 'map $remote_addr $llm_gateway_no_client_key {\n    default "";\n}\n' + text
    block = re.search(r"upstream llm_gateway \{.*?\n\}", text, re.S)
    if not block:
        raise SiteTemplateError("no `upstream llm_gateway { ... }` block in nginx/llm-gateway.conf")
    body = block.group(0)
    active = re.findall(r"^    server 127\.0\.0\.1:\d+ (.*);$", body, re.M)
    if len(active) != 1:
        raise SiteTemplateError(f"expected one active upstream server line, found {active}")
    lines = [ln for ln in body.split("\n") if not re.match(r"^    #?server 127\.0\.0\.1:\d+ ", ln)]
    lines[1:1] = upstream_lines(upstreams, active[0] if count_failures else NO_FAILURE_COUNT, fill_first)
    text = text.replace(body, "\n".join(lines))
    text = replace_exactly(text, "    listen 80;\n", f"    listen {listen};\n", 1, "listen")
    text = replace_exactly(text, "    listen [::]:80;\n", "", 1, "listen ipv6")
    text = replace_exactly(text, SNIPPET_INCLUDE, f"include {snippet};", 1, "snippet")
    return replace_exactly(text, "/var/log/nginx/", f"{log_dir}/", 1, "log dir")


READY_PROXIED = """location = /ready {
    proxy_pass http://llm_gateway;
    proxy_read_timeout 10s;
}
"""
READY_FILE = "ready.json"


def ready_from_file(snippet: str, ready_dir: Path) -> str:
    """The snippet with `/ready` answered from `ready_dir/ready.json` instead of one upstream: 200 with
    the file while it exists, else 503 (the snippet's OpenAI-shaped error). Whoever runs the replicas
    keeps the file saying how many of them are ready, so `/ready` tells the remaining capacity and not
    just whichever replica nginx picked."""
    return replace_exactly(snippet, READY_PROXIED, (
        "location = /ready {\n"
        f"    root {ready_dir};\n"
        "    default_type application/json;\n"
        '    add_header Cache-Control "no-store" always;\n'
        f"    try_files /{READY_FILE} =503;\n"
        "}\n"), 1, "/ready location")


METRICS_PROXIED = """    deny all;
    proxy_pass http://llm_gateway;
"""


def metrics_from_view(snippet: str, port: int) -> str:
    """The snippet with `/metrics` (its allow-list kept) proxied to the supervisor's merged view of
    every replica (`metrics_view.MetricsView` on 127.0.0.1:port) instead of one upstream."""
    return replace_exactly(snippet, METRICS_PROXIED, f"    deny all;\n    proxy_pass http://127.0.0.1:{port};\n", 1,
                           "/metrics location")


def write_nginx_conf(prefix: Path, site_files: list[str], ready_dir: Path | None = None,
                     metrics_port: int | None = None) -> Path:
    """A minimal nginx.conf (what Debian's /etc/nginx/nginx.conf provides) under `prefix`, including
    the sites; pid, logs and temp paths under `prefix` too, and the snippet copied there verbatim
    (with `ready_dir`: `/ready` answered from its file, `ready_from_file`; with `metrics_port`:
    `/metrics` from the merged view there, `metrics_from_view`)."""
    prefix.mkdir(parents=True, exist_ok=True)
    snippet = SNIPPET.read_text()
    if ready_dir is not None:
        snippet = ready_from_file(snippet, ready_dir)
    if metrics_port is not None:
        snippet = metrics_from_view(snippet, metrics_port)
    (prefix / "llm-gateway-proxy.conf").write_text(snippet)
    for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (prefix / sub).mkdir(exist_ok=True)
    user = "user root;\n" if os.geteuid() == 0 else ""  # workers must reach a 0700 prefix
    includes = "".join(f"    include {f};\n" for f in site_files)
    conf = prefix / "nginx.conf"
    conf.write_text(
        f"{user}worker_processes auto;\n"
        f"pid {prefix}/nginx.pid;\n"
        f"error_log {prefix}/error.log info;\n"
        "events { worker_connections 4096; }\n"
        "http {\n"
        "    default_type application/octet-stream;\n"
        "    sendfile on;\n"
        "    tcp_nodelay on;\n"
        f"    access_log {prefix}/default-access.log;\n"
        f"    client_body_temp_path {prefix}/client_body;\n"
        f"    proxy_temp_path {prefix}/proxy;\n"
        f"    fastcgi_temp_path {prefix}/fastcgi;\n"
        f"    uwsgi_temp_path {prefix}/uwsgi;\n"
        f"    scgi_temp_path {prefix}/scgi;\n"
        f"{includes}"
        "}\n"
    )
    return conf


def write_front(prefix: Path, *, upstreams: list[int], listen: str, client_limits: bool = True,
                ready_dir: Path | None = None, metrics_port: int | None = None, fill_first: int = 0,
                count_failures: bool = True) -> Path:
    """The whole front door under `prefix`: the site (`render_site`, as `llm-gateway.conf`) over
    `upstreams`, listening on `listen`, and the nginx.conf including it (`write_nginx_conf`)."""
    prefix.mkdir(parents=True, exist_ok=True)
    site = prefix / "llm-gateway.conf"
    site.write_text(render_site(upstreams=upstreams, listen=listen, snippet=prefix / "llm-gateway-proxy.conf",
                                log_dir=prefix, client_limits=client_limits, fill_first=fill_first,
                                count_failures=count_failures))
    return write_nginx_conf(prefix, [str(site)], ready_dir=ready_dir, metrics_port=metrics_port)
