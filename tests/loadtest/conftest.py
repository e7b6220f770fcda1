"""Fixtures for the load-test tool's tests: a factory of scripted fake OpenAI servers."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.loadtest.fake_server import FakeOpenAIServer, Script

ServerFactory = Callable[[list[Script]], FakeOpenAIServer]


@pytest.fixture
def fake_server() -> Iterator[ServerFactory]:
    started: list[FakeOpenAIServer] = []

    def make(scripts: list[Script]) -> FakeOpenAIServer:
        server = FakeOpenAIServer(scripts).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()
