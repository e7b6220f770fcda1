#!/usr/bin/env python3
"""Random weights in a model's real checkpoint layout, written as safetensors (issue 15 on the GPU).

Gemma 4 E2B's weights cannot be fetched, and `load_format: dummy` has nothing on disk to reload,
so an in-place weight swap needs files. This writes a checkpoint a model directory can load: the
tensor names and shapes transformers gives the config (built on the meta device, so nothing is
allocated), tied weights left out as `save_pretrained` does, values drawn from a seed (2-D and
larger: normal, std 0.02; 1-D: 1 + normal, std 0.05, so norms and scalars stay near one), bf16,
in shards of at most 4 GiB. The directory gets the config and tokenizer files of `--like`.
Two seeds give two versions of one model: same layout, other values.

    python3 benchmarks/random_weights.py /tmp/w/v1 --like /tmp/gemma-4-e2b-synth --seed 1
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

SHARD_BYTES = 4 << 30


def checkpoint_layout(config_dir: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the model's checkpoint (tied weights left out)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tied = set((getattr(model, "_tied_weights_keys", None) or {})) if config.tie_word_embeddings else set()
    layout = {name: tuple(t.shape) for name, t in model.state_dict().items() if name not in tied}
    # transformers 5.17 leaves out the (unused) k_norm of Gemma 4's KV-shared layers, which vLLM
    # 0.26 still requires from the checkpoint: give every q_norm its k_norm of the same shape.
    for name, shape in list(layout.items()):
        if name.endswith("self_attn.q_norm.weight"):
            layout.setdefault(name.replace("q_norm", "k_norm"), shape)
    return layout


def write(out_dir: Path, like: Path, seed: int, device: str | None = None) -> Path:
    """Write a random checkpoint of `like`'s model into `out_dir`; returns `out_dir`."""
    import torch
    from safetensors.torch import save_file

    t0 = time.monotonic()
    done = out_dir / ".written"  # a second call on the same machine reuses the checkpoint (~50 s on a GPU)
    if done.exists() and done.read_text() == f"{seed}\n":
        print(f"[random-weights] {out_dir}: seed {seed} already written", flush=True)
        return out_dir
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in like.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and out_dir.resolve() != like.resolve():
            shutil.copy(f, out_dir / f.name)
    layout = checkpoint_layout(like)
    generator = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, shape in layout.items():
        if len(shape) >= 2:
            value = torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * 0.02
        else:
            value = 1 + torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * 0.05
        value = value.to(torch.bfloat16).cpu()
        if size + value.numel() * 2 > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.numel() * 2
    index: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out_dir / file, metadata={"format": "pt"})
        index.update({name: file for name in shard})
    total = sum(v.numel() * 2 for s in shards for v in s.values())
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1) + "\n")
    print(f"[random-weights] {out_dir}: {len(layout)} tensors, {total / 2**30:.2f} GiB in {len(shards)} "
          f"shard(s), seed {seed}, {time.monotonic() - t0:.1f}s", flush=True)
    done.write_text(f"{seed}\n")
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--like", type=Path, required=True, help="a model directory: config and tokenizer files")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="where values are drawn (default cuda if present)")
    a = ap.parse_args()
    write(a.out_dir, a.like, a.seed, a.device)


if __name__ == "__main__":
    main()
