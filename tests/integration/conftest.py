"""The integration tests' session: vLLM's own server, which the differential tests compare with,
starts as soon as the first integration test does, so its start (tens of seconds on 2 cores)
overlaps the tests before the first differential one instead of adding to them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import launch_vllm_reference, stop_vllm_reference


@pytest.fixture(scope="session", autouse=True)
def vllm_reference_ahead(request: pytest.FixtureRequest, model_dir: Path,
                         tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    wanted = any("vllm_reference" in item.fixturenames for item in request.session.items)
    if wanted and not os.environ.get("LLM_GATEWAY_TEST_VLLM_URL"):
        launch_vllm_reference(model_dir, tmp_path_factory)
    yield
    stop_vllm_reference()  # in case no test waited for it (all of them deselected or failed early)
