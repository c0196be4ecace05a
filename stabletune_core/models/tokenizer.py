"""The CLIP BPE tokenizer of openai/clip-vit-large-patch14, built offline.

Stable Diffusion 1.x uses OpenAI's CLIP tokenizer. We never download it: the
vocabulary and merges are the ones open_clip ships in
``bpe_simple_vocab_16e6.txt.gz``, laid out exactly as the Hugging Face files
(49408 tokens: 256 byte tokens, their ``</w>`` forms, the 48894 merges, then
``<|startoftext|>`` and ``<|endoftext|>``).
"""
from __future__ import annotations

import gzip
import json
from functools import lru_cache
from pathlib import Path

from ..atomic import write_text_atomic

BOS = "<|startoftext|>"
EOS = "<|endoftext|>"
VOCAB_SIZE = 49408
N_MERGES = 49152 - 256 - 2  # 48894, as open_clip and transformers both slice
MODEL_MAX_LENGTH = 77

TOKENIZER_CONFIG = {
    "add_prefix_space": False,
    "bos_token": BOS,
    "clean_up_tokenization_spaces": True,
    "do_lower_case": True,
    "eos_token": EOS,
    "errors": "replace",
    "model_max_length": MODEL_MAX_LENGTH,
    "pad_token": EOS,  # SD1's choice (SD2 pads with "!")
    "tokenizer_class": "CLIPTokenizer",
    "unk_token": EOS,
}
SPECIAL_TOKENS_MAP = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS, "unk_token": EOS}


def bpe_path() -> Path:
    """Where open_clip keeps its bundled BPE file."""
    try:
        from open_clip.tokenizer import default_bpe

        return Path(default_bpe())
    except Exception:  # pragma: no cover - fall back to the package folder
        import open_clip

        return Path(open_clip.__file__).parent / "bpe_simple_vocab_16e6.txt.gz"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> printable unicode map (same order as both libraries)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(2**8):
        if b not in bs:
            bs.append(b)
            cs.append(2**8 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


@lru_cache(maxsize=1)
def clip_vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    """(vocab token -> id, merge lines "a b") exactly as openai/clip-vit-large-patch14."""
    lines = gzip.open(bpe_path()).read().decode("utf-8").split("\n")
    merges = lines[1 : N_MERGES + 1]
    byte_tokens = list(bytes_to_unicode().values())
    tokens = byte_tokens + [t + "</w>" for t in byte_tokens]
    tokens += ["".join(m.split()) for m in merges]
    tokens += [BOS, EOS]
    if len(tokens) != VOCAB_SIZE:
        raise RuntimeError(f"open_clip's BPE file gave {len(tokens)} tokens, expected {VOCAB_SIZE}.")
    return {t: i for i, t in enumerate(tokens)}, merges


#: SD 2.x's OpenCLIP tokenizer and SDXL's tokenizer_2 use the same BPE vocabulary but pad with "!" (id 0),
#: as open_clip does; SD1 and SDXL's first tokenizer pad with <|endoftext|>.
OPEN_CLIP_PAD = "!"


def write_clip_tokenizer_files(out_dir: Path, *, pad_token: str = EOS) -> Path:
    """Write vocab.json, merges.txt, tokenizer_config.json and special_tokens_map.json into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab, merges = clip_vocab_and_merges()
    files = {
        "vocab.json": json.dumps(vocab, ensure_ascii=False),
        "merges.txt": "#version: 0.2\n" + "\n".join(merges) + "\n",
        "tokenizer_config.json": json.dumps({**TOKENIZER_CONFIG, "pad_token": pad_token}, indent=2),
        "special_tokens_map.json": json.dumps({**SPECIAL_TOKENS_MAP, "pad_token": pad_token}, indent=2),
    }
    for name, text in files.items():
        write_text_atomic(out_dir / name, text)
    return out_dir


def default_cache_dir() -> Path:
    from ..cache import cache_root

    return cache_root() / "tokenizers" / "clip-vit-large-patch14"


def build_clip_tokenizer(out_dir: Path | None = None):
    """A transformers CLIPTokenizer identical to openai/clip-vit-large-patch14's, built offline.

    The files are written to ``out_dir`` (default: a per-user cache folder) and
    loaded from there, so the same folder can also serve as a pipeline's
    ``tokenizer/`` subfolder.
    """
    from transformers import CLIPTokenizer

    out_dir = Path(out_dir) if out_dir is not None else default_cache_dir()
    if not ((out_dir / "vocab.json").is_file() and (out_dir / "merges.txt").is_file()) or out_dir != default_cache_dir():
        write_clip_tokenizer_files(out_dir)
    tok = CLIPTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    tok.model_max_length = MODEL_MAX_LENGTH
    return tok


def expand_multi_vector(tokenizer, prompts: list[str]) -> list[str]:
    """Prompts with each multi-vector token written out: "<p1>" -> "<p1> <p1>_1 <p1>_2" when the tokenizer has
    the added tokens <p1>_1, <p1>_2 (diffusers' convention for textual-inversion tokens of several vectors, which
    its pipelines apply the same way in `maybe_convert_prompt`). Unchanged for a tokenizer without such tokens."""
    added = set(getattr(tokenizer, "added_tokens_encoder", {}))
    multi = [t for t in added if f"{t}_1" in added]
    if not multi:
        return list(prompts)
    expansions = {}
    for token in multi:
        pieces, i = [token], 1
        while f"{token}_{i}" in added:
            pieces.append(f"{token}_{i}")
            i += 1
        expansions[token] = " ".join(pieces)
    out = []
    for prompt in prompts:
        for token, expanded in expansions.items():
            if token in prompt:
                prompt = prompt.replace(token, expanded)
        out.append(prompt)
    return out
