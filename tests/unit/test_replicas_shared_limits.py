"""The tenants' limits across the replicas of `serve --replicas N` (server/replicas/shared_limits.py
and the supervisor's use of it): a private redis-server (the real Debian binary) unless
auth.redis_url is set, and a clear refusal without one."""

from __future__ import annotations

def replicas_settings(tmp_path, **auth: object):  # type: ignore[no-untyped-def]
    from server.settings import AuthSettings, EngineProfile, ServerSettings, Settings

    keys = tmp_path / "keys.yaml"
    keys.write_text("keys: []\n")
    return Settings(engine=EngineProfile(device="cpu", kv_cache_memory_bytes=1, served_model_name="fake"),
                    server=ServerSettings(state_dir=str(tmp_path / "state"), port=18000),
                    auth=AuthSettings(keys_file=keys, **auth))


def test_replicas_with_a_keys_file_share_a_private_redis(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from server.replicas.supervisor import Supervisor

    sup = Supervisor(replicas_settings(tmp_path), [], 2)
    try:
        assert sup.redis is not None
        assert {r.env["LLM_GATEWAY_AUTH__REDIS_URL"] for r in sup.replicas} == {sup.redis.url}
        assert sup.redis.url.startswith("unix://") and sup.redis.url.endswith("/redis.sock")
    finally:
        sup.metrics.stop()


def test_replicas_with_redis_url_keep_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from server.replicas.supervisor import Supervisor

    sup = Supervisor(replicas_settings(tmp_path, redis_url="redis://127.0.0.1:6379/0"), [], 2)
    try:
        assert sup.redis is None and all("LLM_GATEWAY_AUTH__REDIS_URL" not in r.env or
                                         r.env["LLM_GATEWAY_AUTH__REDIS_URL"] == "redis://127.0.0.1:6379/0"
                                         for r in sup.replicas)
    finally:
        sup.metrics.stop()


def test_without_redis_server_the_replicas_refuse_to_start(tmp_path, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    from server.replicas import shared_limits, supervisor

    monkeypatch.setattr(shared_limits, "redis_binary", lambda: None)
    sup = supervisor.Supervisor(replicas_settings(tmp_path), [], 2)
    try:
        assert sup._start_redis() is False
        assert "apt install redis-server" in caplog.text and "auth.redis_url" in caplog.text
    finally:
        sup.metrics.stop()


def test_the_private_redis_runs_on_a_short_socket_path_and_stops(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from server.replicas.shared_limits import PrivateRedis, redis_binary

    assert redis_binary(), "redis-server is missing: .ci/run installs the Debian package `redis-server`"
    deep = tmp_path / ("d" * 60) / ("e" * 60)  # past what a Unix socket path may hold
    redis = PrivateRedis(deep)
    redis.start()
    try:
        assert redis.alive() and len(str(redis.socket_path)) <= 100 and redis.socket_path.exists()
        import redis as redis_py

        client = redis_py.Redis.from_url(redis.url)
        assert client.ping() and client.set("k", "v") and client.get("k") == b"v"
        client.close()
    finally:
        redis.stop()
    assert not redis.alive() and not redis.socket_path.exists() and not redis.socket_dir.exists()
