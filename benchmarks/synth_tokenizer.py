#!/usr/bin/env python3
"""A synthetic tokenizer for the dummy-weight Gemma 4 E2B benchmark model (issue 9, parts 2-3).

`benchmarks/models/gemma-4-e2b-text/` holds only the model config: enough for vLLM with
`load_format=dummy` and `skip_tokenizer_init=True`, which is what the offline engine benchmark
(profiles.py) used. The gateway cannot run that way: `VllmEngine.start` asks AsyncLLM for its
tokenizer, which vLLM refuses under `skip_tokenizer_init` ("Tokenizer not available"), and the
gateway decodes every output to text. `vllm serve` likewise streams text. So the HTTP benchmarks
give the model a tokenizer that:

- covers all 262,144 ids (Gemma's vocabulary): 0-3 are `<pad>`, `<eos>`, `<bos>`, `<unk>`
  (Gemma's pad/eos/bos ids), 4-259 the 256 byte-level symbols, then every 2-character and as many
  3-character strings of printable ASCII as fit, and last Gemma 4's turn/channel/tool-call special
  tokens (vLLM's gemma4 tool and reasoning parsers need them);
- makes `<pad>` (id 0) an ordinary token that decodes to the text `<pad>`, unlike Gemma's own
  tokenizer: with dummy weights, greedy decoding writes id 0 on every step (benchmarks/dummy_outputs.py,
  H200, 2026-12-03). As a special token it decoded to nothing, so every benchmark stream carried
  no text and vLLM's incremental detokenizer re-decoded its whole window per token (33.9x the cost
  per step). As text it costs what a real model's tokens cost, and the streams carry 5 characters a token;
- has a cut-down Gemma 4 chat template with tools, so chat and tool-calling requests render;
- is a `tokenizers` BPE (no merges) with a **byte-level decoder**, so vLLM uses its fast
  incremental detokenizer (a word-level synthetic tokenizer made detokenization the bottleneck:
  ../shared/gpu/README.md), and random ids decode to valid UTF-8 (except the 128 high-byte ids).

Prompts are still token ids (exact lengths); the tokenizer serves detokenization of outputs.

    python3 benchmarks/synth_tokenizer.py /tmp/gemma-4-e2b-synth   # config + tokenizer there
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG_DIR = HERE / "models" / "gemma-4-e2b-text"
PAD = "<pad>"  # id 0, Gemma's pad id; an ordinary token here (see the docstring)
SPECIALS = ["<eos>", "<bos>", "<unk>"]  # ids 1, 2, 3 as in Gemma's config
# Gemma 4's turn, reasoning-channel and tool-call tokens, which vLLM's gemma4 tool and reasoning
# parsers look up in the vocabulary (their ids here are the last of the vocabulary, not Gemma's).
GEMMA4_SPECIALS = ["<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|tool>", "<tool|>",
                   "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>']
# Gemma 4's prompt shape, cut down: turns, tool declarations, the model's calls and the tool
# results in its own syntax (`call:name{...}`), so chat and tool requests render on the GPU.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|turn>system\n{% for t in tools %}<|tool>declaration:{{ t.function.name }}"
    "{{ t.function | tojson }}<tool|>{% endfor %}<turn|>\n{% endif %}"
    "{% for m in messages %}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{% for c in m.tool_calls or [] %}<|tool_call>call:{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}<tool_call|>{% endfor %}"
    "{% if m.role == 'tool' %}<|tool_response>{{ m.content }}<tool_response|>"
    "{% else %}{{ m.content or '' }}{% endif %}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def synthetic_vocab(size: int) -> dict[str, int]:
    from tokenizers import pre_tokenizers

    vocab: dict[str, int] = {PAD: 0}
    for tok in SPECIALS:
        vocab[tok] = len(vocab)
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    printable = [chr(c) for c in range(33, 127)]  # byte-level maps these bytes to themselves
    room = size - len(GEMMA4_SPECIALS)
    for n in (2, 3, 4):
        for combo in itertools.product(printable, repeat=n):
            if len(vocab) >= room:
                break
            vocab["".join(combo)] = len(vocab)
    for tok in GEMMA4_SPECIALS:
        vocab[tok] = len(vocab)
    return vocab


def build(out_dir: Path, config_dir: Path = CONFIG_DIR, vocab_size: int | None = None) -> Path:
    """Copy the model config into out_dir and write tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (config_dir / name).is_file() and config_dir.resolve() != out_dir.resolve():
            shutil.copy(config_dir / name, out_dir / name)
    size = vocab_size or int(json.loads((config_dir / "config.json").read_text())["vocab_size"])
    vocab = synthetic_vocab(size)
    assert len(vocab) == size, (len(vocab), size)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS + GEMMA4_SPECIALS)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        # no pad_token: transformers would register `<pad>` as a special token again
        "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>",
        "model_max_length": 131072, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }, indent=1))
    (out_dir / "special_tokens_map.json").write_text(json.dumps({
        "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>",
    }, indent=1))
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--config-dir", type=Path, default=CONFIG_DIR)
    a = ap.parse_args()
    print(build(a.out_dir, a.config_dir))


if __name__ == "__main__":
    main()
