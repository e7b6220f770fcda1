"""The shipped nginx site (nginx/) in front of real gateways: Debian's nginx binary, started on
loopback ports by the test (see conftest.start_nginx for what is templated), the real vLLM CPU
engine behind it.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import SERVED_NAME, ServerProcess, free_port, wait_for
from tests.e2e.conftest import (
    SITE,
    SNIPPET_INCLUDE,
    Nginx,
    NotifiedGateway,
    nginx_test,
    port_of,
    start_nginx,
    write_wrapper,
)

STREAM_PROMPT = "Write a long story about a lighthouse keeper and her dog."
TTFC_MARGIN_S = 0.050  # proxied median time-to-first-chunk may exceed direct by at most this
TTFC_PAIRS = 7


def completion(base_url: str, prompt: str = "The capital of France is", max_tokens: int = 4,
               headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(base_url + "/v1/completions", json=body, headers=headers, timeout=120)


@dataclass
class StreamTiming:
    ttfc: float  # request sent -> first `data:` bytes
    total: float  # request sent -> last bytes
    reads: int  # socket reads that returned data
    text: str
    headers: httpx.Headers

    @property
    def first_to_last(self) -> float:
        return self.total - self.ttfc


def timed_stream(client: httpx.Client, base_url: str, max_tokens: int = 64) -> StreamTiming:
    body = {"model": SERVED_NAME, "prompt": STREAM_PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    first = last = None
    reads = 0
    raw = b""
    with client.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        headers = resp.headers
        for chunk in resp.iter_raw():
            now = time.perf_counter()
            if first is None and b"data:" in chunk:
                first = now
            last = now
            reads += 1
            raw += chunk
    assert first is not None and last is not None
    events = [line[len("data: "):] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e).get("choices"))
    return StreamTiming(first - t0, last - t0, reads, text, headers)


def first_chunk_time(client: httpx.Client, base_url: str, max_tokens: int = 64) -> float:
    """Seconds from sending a streamed request to its first `data:` bytes; then hang up (the
    gateway aborts the rest of the generation)."""
    body = {"model": SERVED_NAME, "prompt": STREAM_PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    with client.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for chunk in resp.iter_raw():
            if b"data:" in chunk:
                return time.perf_counter() - t0
    raise AssertionError("the stream ended without a data event")


def requests_served(server: ServerProcess, route: str = "/v1/completions") -> float:
    """gateway_requests_total{route=route,status="200"} from the instance's own /metrics."""
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("gateway_requests_total{") and f'route="{route}"' in line and 'status="200"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_each_served(servers: list[ServerProcess], before: list[float], timeout: float = 60) -> None:
    """Until each instance behind nginx has answered a request more than `before` counted: a
    fresh engine's first steps beside another engine's can take seconds on 2 loaded cores, so a
    fixed sleep does not make sure that both serve."""
    def each_served() -> bool:
        return all(requests_served(s) > n for s, n in zip(servers, before))

    assert wait_for(each_served, timeout, interval=0.2), "not every instance served within the timeout"


# ------------------------------------------------------------------------------------------------


def test_nginx_t_accepts_the_shipped_site(tmp_path: Path) -> None:
    """`nginx -t` on llm-gateway.conf as shipped (listen 80, /var/log/nginx, keepalive upstream...);
    only the snippet's include path points into the checkout instead of /etc/nginx/snippets/."""
    site = SITE.read_text()
    assert site.count(SNIPPET_INCLUDE) == 1
    (tmp_path / "llm-gateway.conf").write_text(site.replace(SNIPPET_INCLUDE, f"include {tmp_path}/llm-gateway-proxy.conf;"))
    conf = write_wrapper(tmp_path, [str(tmp_path / "llm-gateway.conf")])
    result = nginx_test(tmp_path, conf)
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr
    assert "[warn]" not in result.stderr and "[emerg]" not in result.stderr, result.stderr


def test_tls_example_serves_https_and_redirects(tmp_path: Path, gateway: ServerProcess) -> None:
    """The TLS example with a throw-away certificate: `nginx -t` passes, HTTPS reaches the gateway,
    the plain-HTTP server answers 308 to https://."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=30)
    nginx = start_nginx(tmp_path / "nginx", [port_of(gateway)], tls={"cert": cert, "key": key})
    try:
        https = f"https://127.0.0.1:{nginx.extra_ports['https']}"
        with httpx.Client(verify=str(cert), http2=False) as client:
            models = client.get(https + "/v1/models", timeout=30)
            assert models.status_code == 200, models.text
            assert models.json()["data"][0]["id"] == SERVED_NAME
            assert models.headers["strict-transport-security"].startswith("max-age=")
        redirect = httpx.get(f"http://127.0.0.1:{nginx.extra_ports['redirect']}/v1/models",
                             headers={"Host": "llm.example.com"})
        assert redirect.status_code == 308
        assert redirect.headers["location"] == "https://llm.example.com/v1/models"
    finally:
        nginx.stop()


def test_completion_through_nginx(nginx_single: Nginx, gateway: ServerProcess) -> None:
    direct = completion(gateway.base_url)
    proxied = completion(nginx_single.base_url, headers={"X-Request-ID": "e2e-nginx-1"})
    assert direct.status_code == proxied.status_code == 200, proxied.text
    assert proxied.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
    assert proxied.headers["x-request-id"] == "e2e-nginx-1"  # passed through both ways
    generated = completion(nginx_single.base_url).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated), generated  # nginx's $request_id when none sent
    # Gateway errors pass through in their own OpenAI shape, not nginx's.
    bad = completion(nginx_single.base_url, max_tokens=-1)
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "BadRequestError"
    assert f'rid={generated}' in nginx_single.access_log()


def test_streaming_is_not_buffered_by_nginx(nginx_single: Nginx, gateway: ServerProcess) -> None:
    """Time to first chunk of a 64-token streamed generation, direct vs through nginx (interleaved
    pairs, medians): nginx adds at most 50 ms. Then whole streams: through nginx the chunks arrive
    spread over the generation (not all at the end) and the text is the direct text."""
    with httpx.Client() as client:
        timed_stream(client, gateway.base_url, max_tokens=4)  # warm connections and the prefix cache
        timed_stream(client, nginx_single.base_url, max_tokens=4)
        direct_ttfc, proxied_ttfc = [], []
        for _ in range(TTFC_PAIRS):
            direct_ttfc.append(first_chunk_time(client, gateway.base_url))
            proxied_ttfc.append(first_chunk_time(client, nginx_single.base_url))
        direct = timed_stream(client, gateway.base_url)
        proxied = [timed_stream(client, nginx_single.base_url) for _ in range(2)]
    d_ttfc, p_ttfc = statistics.median(direct_ttfc), statistics.median(proxied_ttfc)
    print(f"\ntime to first chunk (64-token stream), median of {TTFC_PAIRS}: direct {d_ttfc * 1000:.1f} ms, "
          f"through nginx {p_ttfc * 1000:.1f} ms (direct {[round(t * 1000, 1) for t in direct_ttfc]}, "
          f"nginx {[round(t * 1000, 1) for t in proxied_ttfc]}); whole streams through nginx: "
          f"{[round(t.total, 2) for t in proxied]} s, first->last chunk {[round(t.first_to_last, 2) for t in proxied]} s, "
          f"socket reads {[t.reads for t in proxied]} (direct: {direct.total:.2f} s, {direct.reads} reads)")
    assert p_ttfc <= d_ttfc + TTFC_MARGIN_S, (d_ttfc, p_ttfc)
    for stream in proxied:
        assert stream.text == direct.text  # same greedy text, nothing altered
        assert stream.headers["content-type"].startswith("text/event-stream")
        # Not buffered to the end: most of the stream time lies between the first and the last
        # chunk, delivered over many separate reads (one per token, roughly).
        assert stream.first_to_last >= 0.7 * stream.total, (stream.first_to_last, stream.total)
        assert stream.reads >= 16, stream.reads


def responses_stream(client: httpx.Client, base_url: str) -> tuple[list[str], int]:
    """A streamed /v1/responses answer's text deltas and the socket reads they arrived in."""
    body = {"model": SERVED_NAME, "input": "Write a long story about a cat who learns to fly.", "max_output_tokens": 48,
            "temperature": 0, "stream": True}
    reads, raw = 0, b""
    with client.stream("POST", base_url + "/v1/responses", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for chunk in resp.iter_raw():
            reads += 1
            raw += chunk
    events = [json.loads(line[len("data: "):]) for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert events[-1]["type"] == "response.completed", events[-1]
    return [e["delta"] for e in events if e["type"] == "response.output_text.delta"], reads


def test_responses_stream_and_tokenize_through_nginx(nginx_single: Nginx, gateway: ServerProcess) -> None:
    """/v1/responses streams through nginx event by event (many reads, not one at the end; it
    shares the generation location's long timeouts); /tokenize, at the root as in `vllm serve`,
    is proxied too."""
    with httpx.Client() as client:
        direct, _ = responses_stream(client, gateway.base_url)
        proxied, reads = responses_stream(client, nginx_single.base_url)
        assert proxied == direct and len(proxied) >= 24
        assert reads >= len(proxied) // 2, (reads, len(proxied))
        r = client.post(nginx_single.base_url + "/tokenize", json={"prompt": "Hello world"}, timeout=30)
        assert r.status_code == 200 and r.json()["count"] == 2


def test_rate_limit_answers_429_in_openai_shape(nginx_single: Nginx) -> None:
    """60 requests at once from one client address (127.0.0.3): the burst passes, the rest get
    429 with an OpenAI error body and Retry-After; another client (127.0.0.1) is unaffected."""

    async def burst() -> list[httpx.Response]:
        transport = httpx.AsyncHTTPTransport(local_address="127.0.0.3")
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(transport=transport, limits=limits, timeout=30) as client:
            return await asyncio.gather(*(client.get(nginx_single.base_url + "/v1/models") for _ in range(60)))

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(200) >= 21, codes  # burst=20 (+1 for the rate itself)
    assert codes.count(429) >= 10, codes
    limited = next(r for r in responses if r.status_code == 429)
    assert limited.headers["content-type"] == "application/json"
    assert limited.headers["retry-after"] == "1"
    error = limited.json()["error"]
    assert error["type"] == "RateLimitError" and error["code"] == 429
    assert set(error) == {"message", "type", "param", "code"}
    # The limit is per client: 127.0.0.1 still gets through right away.
    assert httpx.get(nginx_single.base_url + "/v1/models").status_code == 200


def test_metrics_only_for_the_allow_list(nginx_single: Nginx) -> None:
    allowed = httpx.get(nginx_single.base_url + "/metrics")
    assert allowed.status_code == 200
    assert "gateway_requests_total" in allowed.text
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2")) as other:
        denied = other.get(nginx_single.base_url + "/metrics")
        assert denied.status_code == 403
        assert denied.json()["error"]["type"] == "PermissionDeniedError"
        # The API itself is open to that client.
        assert other.get(nginx_single.base_url + "/v1/models").status_code == 200


def test_no_instance_reachable_is_a_json_502(tmp_path: Path) -> None:
    nginx = start_nginx(tmp_path, [free_port()])  # nothing listens there
    try:
        resp = completion(nginx.base_url)
        assert resp.status_code == 502
        assert resp.headers["content-type"] == "application/json"
        assert resp.json()["error"] == {"message": "No gateway instance could be reached.",
                                        "type": "BadGatewayError", "param": None, "code": 502}
    finally:
        nginx.stop()


def test_two_instances_share_the_traffic(
    tmp_path: Path, gateway: ServerProcess, notified_gateway: NotifiedGateway
) -> None:
    """Upstream = two real gateways + one dead address (least_conn, passive health checks): every
    POST succeeds exactly once (the dead server's refused connects are retried elsewhere, nothing
    is sent twice) and both live instances serve some of them."""
    second = notified_gateway.server
    assert second.proc.poll() is None
    dead = free_port()
    nginx = start_nginx(tmp_path, [port_of(gateway), second.port, dead])
    try:
        before = (requests_served(gateway), requests_served(second))
        n = 10
        for i in range(n):
            resp = completion(nginx.base_url, prompt=f"Count to {i}:", max_tokens=2)
            assert resp.status_code == 200, resp.text
        after = (requests_served(gateway), requests_served(second))
        got = [a - b for a, b in zip(after, before)]
        assert sum(got) == n, got
        assert got[0] >= 1 and got[1] >= 1, got
        log = nginx.access_log()
        assert f"127.0.0.1:{port_of(gateway)}" in log and f"127.0.0.1:{second.port}" in log
        # The dead server was tried, failed, and the request went on to a live one.
        assert re.search(rf'upstream="127\.0\.0\.1:{dead}, 127\.0\.0\.1:\d+" ustatus="502, 200"', log), log
        assert "connect() failed (111: Connection refused)" in nginx.error_log()
        # `llm-gateway reload` rolls over both instances, one after the other (their profiles
        # are unchanged, so each only re-reads its keys), and nginx still serves afterwards.
        urls = [gateway.base_url, second.base_url]
        rolled = subprocess.run([sys.executable, "-m", "server", "reload", *urls], capture_output=True,
                                text=True, timeout=120)
        assert rolled.returncode == 0, rolled.stdout + rolled.stderr
        rows = re.findall(r"^\[(\d)/2\] (http://\S+?): profile unchanged", rolled.stdout, re.M)
        assert rows == [("1", urls[0]), ("2", urls[1])], rolled.stdout
        assert completion(nginx.base_url, max_tokens=2).status_code == 200
    finally:
        nginx.stop()


@pytest.fixture(scope="module")
def spares(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """The two instances the last tests here take out of service, one stopped (`leaving`) and one
    stalled (`stalling`, a 6 s stall timeout), started together: on 2 cores an engine start is
    mostly CPU-bound imports, so the pair is ready a few seconds sooner than one after the other,
    not in the time of one."""
    from tests.conftest import start_gateway, wait_ready

    tmp = tmp_path_factory.mktemp("spares")
    envs = {"leaving": None, "stalling": {"LLM_GATEWAY_HEALTH__STALL_TIMEOUT_S": "6"}}
    started: dict[str, ServerProcess] = {}
    try:
        for name, env in envs.items():
            (tmp / name).mkdir()
            started[name] = start_gateway(tmp / name, env=env, wait=False)
        for server in started.values():
            wait_ready(server)
        yield started
    finally:
        for server in started.values():
            server.stop()


def test_stopping_one_instance_loses_no_request(tmp_path: Path, gateway: ServerProcess,
                                                spares: dict[str, ServerProcess]) -> None:
    """Two instances behind nginx under concurrent traffic; SIGTERM to one while it has a long
    stream in flight: its stream completes, it exits 0, and every request sent through nginx
    succeeds: the draining instance's 503s (and, once it is gone, refused connections) are retried
    on the other instance by nginx (proxy_next_upstream ... non_idempotent)."""
    import signal
    import threading

    leaving = spares["leaving"]
    nginx = start_nginx(tmp_path / "nginx", [port_of(gateway), leaving.port])
    stop = threading.Event()
    lock = threading.Lock()
    ok: list[str] = []
    failures: list[str] = []

    def client(i: int) -> None:
        # Paced to stay well under the site's 10 requests/s per-client-address limit.
        while not stop.is_set():
            try:
                resp = completion(nginx.base_url, prompt=f"Client {i} counts:", max_tokens=4)
                with lock:
                    (ok if resp.status_code == 200 else failures).append(f"{resp.status_code} {resp.text[:200]}")
            except httpx.HTTPError as exc:
                with lock:
                    failures.append(repr(exc))
            stop.wait(0.6)

    long_stream: dict[str, StreamTiming] = {}

    def stream_on_leaving() -> None:
        with httpx.Client() as c:
            long_stream["t"] = timed_stream(c, leaving.base_url, max_tokens=96)

    clients = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    streamer = threading.Thread(target=stream_on_leaving)
    served = [requests_served(gateway), requests_served(leaving)]
    try:
        for t in clients:
            t.start()
        wait_each_served([gateway, leaving], served)
        streamer.start()
        time.sleep(0.5)  # the stream is generating on the leaving instance
        leaving.proc.send_signal(signal.SIGTERM)
        code = leaving.proc.wait(120)
        time.sleep(3)  # traffic continues against the one instance left
        stop.set()
        for t in clients:
            t.join(120)
        streamer.join(120)
        log = nginx.access_log()
        print(f"\n{len(ok)} requests ok, {len(failures)} failed; leaving instance exited {code}")
        assert failures == [], failures[:5]
        assert code == 0, leaving.log()[-3000:]
        assert long_stream["t"].text  # completed ([DONE] checked by timed_stream)
        assert len(ok) >= 10
        assert f'upstream="127.0.0.1:{leaving.port}"' in log  # it served requests before the stop
        # At least one request reached the leaving instance after SIGTERM and was resent.
        retried = re.findall(rf'upstream="127\.0\.0\.1:{leaving.port}, 127\.0\.0\.1:{port_of(gateway)}" '
                             rf'ustatus="(50[23]), 200"', log)
        assert retried, log[-3000:]
        print(f"retried on the other instance: {len(retried)} ({', '.join(sorted(set(retried)))})")
    finally:
        stop.set()
        nginx.stop()
        leaving.stop()


def test_a_stalled_instance_loses_no_request_after_detection(tmp_path: Path, gateway: ServerProcess,
                                                             spares: dict[str, ServerProcess]) -> None:
    """Two instances behind nginx under paced traffic; the engine core of one is stopped
    (SIGSTOP). Once it reports the stall (/health 503), no client request fails: its 503s, then
    its closed port after it exits 3, go to the other instance (proxy_next_upstream)."""
    import threading

    from tests.conftest import engine_core_processes

    stalling = spares["stalling"]
    cores = engine_core_processes(stalling.proc.pid)
    nginx = start_nginx(tmp_path / "nginx", [port_of(gateway), stalling.port])
    stop = threading.Event()
    lock = threading.Lock()
    outcomes: list[tuple[float, str]] = []  # (sent at, "200" or what failed)

    def client(i: int) -> None:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                resp = completion(nginx.base_url, prompt=f"Client {i} counts:", max_tokens=4)
                outcome = "200" if resp.status_code == 200 else f"{resp.status_code} {resp.text[:200]}"
            except httpx.HTTPError as exc:
                outcome = repr(exc)
            with lock:
                outcomes.append((sent, outcome))
            stop.wait(0.6)  # well under the site's 10 requests/s per client address

    clients = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    served = [requests_served(gateway), requests_served(stalling)]
    try:
        for t in clients:
            t.start()
        wait_each_served([gateway, stalling], served)
        for core in cores:
            core.suspend()
        stopped_at = time.monotonic()
        detected_at = None
        while time.monotonic() - stopped_at < 15 and stalling.proc.poll() is None:
            if httpx.get(stalling.base_url + "/health", timeout=5).status_code == 503:
                detected_at = time.monotonic()
                break
            time.sleep(0.1)
        assert detected_at is not None, "no stall reported"
        code = stalling.proc.wait(60)
        time.sleep(3)  # traffic continues against the one instance left
        stop.set()
        for t in clients:
            t.join(120)
        after = [o for sent, o in outcomes if sent >= detected_at]
        failed = [o for _, o in outcomes if o != "200"]
        print(f"\n{len(outcomes)} requests, {len(failed)} failed ({len(after)} sent after the stall was "
              f"reported {detected_at - stopped_at:.1f} s after SIGSTOP, none may fail); exit {code}")
        assert code == 3, stalling.log()[-3000:]
        assert len(after) >= 10 and all(o == "200" for o in after), after
        log = nginx.access_log()
        assert f'upstream="127.0.0.1:{stalling.port}"' in log  # it served requests before the stall
    finally:
        stop.set()
        for core in cores:
            try:
                core.kill()
            except Exception:
                pass
        nginx.stop()
        stalling.stop()


def messages_stream(client: httpx.Client, base_url: str) -> tuple[list[str], int]:
    """A streamed /v1/messages answer's text deltas and the socket reads they arrived in."""
    body = {"model": SERVED_NAME, "max_tokens": 48, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Write a long story about a cat who learns to fly."}]}
    reads, raw = 0, b""
    with client.stream("POST", base_url + "/v1/messages", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for chunk in resp.iter_raw():
            reads += 1
            raw += chunk
    events = [json.loads(line[len("data: "):]) for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert events[-1]["type"] == "message_stop", events[-1]
    return [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"], reads


def test_messages_stream_and_count_tokens_through_nginx(nginx_single: Nginx, gateway: ServerProcess) -> None:
    """Anthropic's /v1/messages streams through nginx event by event (the generation location);
    count_tokens and an Anthropic-shaped error pass through the /v1/ location."""
    with httpx.Client() as client:
        direct, _ = messages_stream(client, gateway.base_url)
        proxied, reads = messages_stream(client, nginx_single.base_url)
        assert proxied == direct and len(proxied) >= 24
        assert reads >= len(proxied) // 2, (reads, len(proxied))
        body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hello world"}]}
        r = client.post(nginx_single.base_url + "/v1/messages/count_tokens", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["input_tokens"] > 2
        r = client.post(nginx_single.base_url + "/v1/messages", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
