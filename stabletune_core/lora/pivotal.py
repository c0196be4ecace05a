"""Pivotal tuning: new tokens whose text embeddings train together with the LoRA.

Each new token (config/tokens.py: "<p1>=red") is added to the family's tokenizer(s) with its extra vectors
(`<p1>_1`, ...: diffusers' multi-vector convention, which its pipelines and `expand_multi_vector` expand in
prompts), and each text encoder's token embedding is wrapped (`NewTokenEmbedding`): the original table stays
as it was, bitwise frozen, and only a small table of new rows, initialised from the init word's embedding, is a
trainable parameter. SDXL gets rows in both encoders (clip_l and clip_g). `PivotalTokens` hands the rows to the
optimizer, the checkpoint and the export (`bundle_emb.*` inside the LoRA file, and an embedding file of its own).

Whether a token is new and an init word one token is checked on the tokenizers alone (`pivotal_problems`),
before the model loads; FLUX.2 Klein (no CLIP token embeddings) is refused there too.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..config.tokens import PivotalToken, parse_tokens
from ..runs.layout import LORA_SUFFIX, embeddings_name, forge_name

#: Keys of a checkpoint's adapter.safetensors that hold the new rows, one per text encoder: "pivotal.te0", ...
CHECKPOINT_PREFIX = "pivotal"
#: A1111's names of SDXL's two encoders in an embedding (modules/textual_inversion, sd_hijack_clip).
SDXL_ENCODER_KEYS = ("clip_l", "clip_g")


# ---- checks before the model loads ---------------------------------------------------------------------------
def token_problems(tokens: list[PivotalToken], vectors: int, tokenizers: list[Any]) -> list[str]:
    """One sentence per token (or extra vector) that is not new and per init word that is not one token, read with
    the first tokenizer (SDXL's two share CLIP's vocabulary)."""
    problems: list[str] = []
    for tok in tokenizers[:1]:  # one sentence per problem, not one per tokenizer
        vocab = tok.get_vocab()
        for t in tokens:
            for piece in t.pieces(vectors):
                ids = tok(piece, add_special_tokens=False).input_ids
                if piece in vocab or len(ids) == 1:
                    problems.append(f"pivotal_tokens: '{piece}' is already a token of the model's vocabulary, so "
                                    f"training it would change what it means everywhere; choose a new word such "
                                    f"as <{piece.strip('<>')}1>.")
            ids = tok(t.init_word, add_special_tokens=False).input_ids
            if len(ids) != 1:
                pieces = tok.convert_ids_to_tokens(ids)
                problems.append(f"pivotal_tokens: the init word '{t.init_word}' of {t.token} is {len(ids)} tokens "
                                f"({' '.join(p.replace('</w>', '') for p in pieces)}), not one; choose a word the "
                                "tokenizer knows whole, such as red or dog.")
    return problems


def tokenizer_folders(config: Any, family: Any) -> list[Path] | None:
    """Where the family's tokenizers of `config`'s model are, without loading the model; None for a hub id
    (then `add_pivotal_tokens` checks after the load)."""
    model = Path(config.pretrained_model_name_or_path).expanduser()
    if model.is_dir():
        base = model
    elif model.is_file():
        base = Path(config.model_config_dir) if config.model_config_dir else family.single_file_config_dir(model)
    else:
        return None
    return [base / part for part in family.tokenizer_parts]


def pivotal_problems(config: Any, family: Any) -> list[str]:
    """The pivotal-tuning refusals a run must hear before its model loads (empty when pivotal_tokens is), for
    a config of the SD `family` (a models.base.ModelFamily; config/families.py refuses pivotal_tokens on the
    others)."""
    if not config.pivotal_tokens:
        return []
    folders = tokenizer_folders(config, family)
    if folders is None:
        return []
    from transformers import CLIPTokenizer

    try:
        tokenizers = [CLIPTokenizer.from_pretrained(str(f), local_files_only=True) for f in folders[:1]]
    except (OSError, ValueError):
        return []  # the model load says what is wrong with the model
    return token_problems(parse_tokens(config.pivotal_tokens), config.num_vectors_per_token, tokenizers)


# ---- the trained rows --------------------------------------------------------------------------------------
class NewTokenEmbedding(torch.nn.Module):
    """A token embedding with rows added at its end: ids below `first_new` read the original table (frozen, and
    never copied or resized), ids from `first_new` on read `new_rows`, the only trained tensor."""

    def __init__(self, base: torch.nn.Embedding, new_rows: torch.Tensor) -> None:
        super().__init__()
        self.base = base
        self.first_new = base.num_embeddings
        self.new_rows = torch.nn.Parameter(new_rows)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table (what code that reads `.weight` of an input embedding expects); not used to train."""
        return torch.cat([self.base.weight, self.new_rows.to(self.base.weight.dtype)])

    @property
    def num_embeddings(self) -> int:
        return self.first_new + self.new_rows.shape[0]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        is_new = input_ids >= self.first_new
        out = self.base(input_ids.clamp(max=self.first_new - 1))
        rows = self.new_rows[(input_ids - self.first_new).clamp(min=0)].to(out.dtype)
        return torch.where(is_new[..., None], rows, out)


class PivotalTokens:
    """The new tokens of a run, their rows in each text encoder, and what the loop does with them."""

    def __init__(self, tokens: list[PivotalToken], vectors: int, embeddings: list[NewTokenEmbedding]) -> None:
        self.tokens, self.vectors, self.embeddings = tokens, vectors, embeddings

    def parameters(self) -> list[torch.nn.Parameter]:
        return [e.new_rows for e in self.embeddings]

    @property
    def training(self) -> bool:
        return any(p.requires_grad for p in self.parameters())

    def set_training(self, on: bool) -> None:
        """Frozen rows get no gradient at all, so every optimizer leaves them bitwise as they are."""
        for p in self.parameters():
            p.requires_grad_(on)
            if not on:
                p.grad = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the rows as a checkpoint's adapter keeps them: {"pivotal.te0": [tokens x vectors, dim], ...}."""
        return {f"{CHECKPOINT_PREFIX}.te{i}": p.detach().float().cpu().clone() for i, p in enumerate(self.parameters())}

    def load_state_dict(self, adapter: dict[str, torch.Tensor]) -> None:
        """Put `state_dict`'s rows back from a checkpoint's adapter dict (its other keys are the LoRA's)."""
        for i, p in enumerate(self.parameters()):
            key = f"{CHECKPOINT_PREFIX}.te{i}"
            if key not in adapter:
                raise ValueError(f"The checkpoint holds no embeddings of the new tokens ({key}); it was trained "
                                 "without pivotal_tokens.")
            if adapter[key].shape != p.shape:
                raise ValueError(f"The checkpoint's new-token embeddings are {tuple(adapter[key].shape)}, this run's "
                                 f"{tuple(p.shape)}; resume with the run's own pivotal_tokens.")
            with torch.no_grad():
                p.copy_(adapter[key].to(p.device, p.dtype))

    def vectors_by_token(self) -> dict[str, list[torch.Tensor]]:
        """{token: [its vectors [vectors, dim] per text encoder]} in fp32 on the CPU, for the export."""
        out: dict[str, list[torch.Tensor]] = {}
        for n, t in enumerate(self.tokens):
            rows = slice(n * self.vectors, (n + 1) * self.vectors)
            out[t.token] = [p.detach().float().cpu()[rows].contiguous() for p in self.parameters()]
        return out


def clip_text_model(encoder: torch.nn.Module) -> torch.nn.Module:
    """The module that holds CLIP's `embeddings.token_embedding` and its `eos_token_id` (the encoder itself in
    transformers 5's CLIPTextModel, its `text_model` in the model with projection)."""
    for module in encoder.modules():
        if hasattr(getattr(module, "embeddings", None), "token_embedding"):
            return module
    raise ValueError(f"{type(encoder).__name__} has no CLIP token embedding to add tokens to.")


def add_pivotal_tokens(bundle: Any, config: Any) -> PivotalTokens | None:
    """Add the config's new tokens to the bundle's tokenizers and text encoders (rows in fp32, initialised from
    each init word's row); None when pivotal_tokens is empty. Raises ValueError with the sentence(s) for tokens
    the loaded tokenizer refuses (a hub model, not checked before the load)."""
    if not config.pivotal_tokens:
        return None
    tokens = parse_tokens(config.pivotal_tokens)
    vectors = config.num_vectors_per_token
    problems = token_problems(tokens, vectors, bundle.tokenizers)
    if problems:
        from ..config import ConfigError

        raise ConfigError(problems)
    pieces = [piece for t in tokens for piece in t.pieces(vectors)]
    embeddings = []
    for tok, encoder in zip(bundle.tokenizers, bundle.text_encoders):
        table = encoder.get_input_embeddings()
        init_ids = [tok(t.init_word, add_special_tokens=False).input_ids[0] for t in tokens for _ in range(vectors)]
        first = len(tok)
        if first != table.num_embeddings:
            from ..config import ConfigError

            raise ConfigError([f"The tokenizer has {first} tokens but its text encoder {table.num_embeddings} "
                             "embeddings; pivotal tuning needs a model whose tokenizer and text encoder agree."])
        tok.add_tokens(pieces)
        ids = tok.convert_tokens_to_ids(pieces)
        if ids != list(range(first, first + len(pieces))):
            raise ValueError(f"The tokenizer gave the new tokens the ids {ids}, not the ones after its vocabulary.")
        rows = table.weight.detach()[init_ids].float().clone()
        wrapped = NewTokenEmbedding(table, rows)
        text_model = clip_text_model(encoder)
        text_model.embeddings.token_embedding = wrapped
        # transformers pools CLIP's output at the argmax of the ids when a config says eos_token_id 2 (configs
        # older than its fix, SDXL's among them): a new token's id would win; the real end token's id pools right.
        if getattr(text_model, "eos_token_id", None) == 2:
            text_model.eos_token_id = tok.eos_token_id
        embeddings.append(wrapped)
    return PivotalTokens(tokens, vectors, embeddings)


# ---- the files --------------------------------------------------------------------------------------------------
def encoder_keys(family: Any) -> list[str]:
    """How A1111 and ComfyUI name each text encoder's vectors in an embedding: one encoder, `string_to_param`'s
    '*' (as A1111's .pt embeddings); SDXL's two, clip_l and clip_g."""
    return list(SDXL_ENCODER_KEYS) if len(family.tokenizer_parts) == 2 else ["*"]


def bundle_tensors(vectors: dict[str, list[torch.Tensor]], family: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors A1111's Lora extension reads as embeddings bundled in a LoRA file (networks.py, load_network):
    `bundle_emb.<token>.string_to_param.*` for one text encoder, `bundle_emb.<token>.clip_l` / `.clip_g` for SDXL."""
    out = {}
    for token, per_encoder in vectors.items():
        for key, tensor in zip(encoder_keys(family), per_encoder):
            name = f"bundle_emb.{token}.string_to_param.*" if key == "*" else f"bundle_emb.{token}.{key}"
            out[name] = tensor.to(dtype).contiguous()
    return out


def embedding_file_tensors(per_encoder: list[torch.Tensor], family: Any, dtype: torch.dtype
                           ) -> dict[str, torch.Tensor]:
    """One token's embedding file as A1111 and ComfyUI read a .safetensors embedding: {"emb_params": vectors}
    (one text encoder; both take the file's only tensor) or {"clip_l", "clip_g"} (SDXL)."""
    keys = encoder_keys(family)
    if keys == ["*"]:
        return {"emb_params": per_encoder[0].to(dtype).contiguous()}
    return {key: tensor.to(dtype).contiguous() for key, tensor in zip(keys, per_encoder)}


#: Characters a file name may not hold on Windows (where many WebUI users are); a token's file drops them.
UNSAFE_FILE_CHARACTERS = '<>:"/\\|?*'


def embedding_file_name(token: str) -> str:
    """The file stem of a token's embedding: the token itself where every OS allows it, else without the
    characters Windows refuses ('<p1>' -> 'p1'). A1111 and ComfyUI name an embedding after its file."""
    stem = "".join(c for c in token if c not in UNSAFE_FILE_CHARACTERS)
    return stem or "embedding"


# ---- how each host loads the words ----------------------------------------------------------------------------------
#: Forge (extensions-builtin/sd_forge_lora/networks.py, load_lora_for_models) refuses a whole LoRA file when more than
#: this many of its keys match no layer ("LoRA version mismatch"); `bundle_emb.*` keys match none, and Forge never
#: reads them as words (its loaded_bundle_embeddings stays empty).
FORGE_UNMATCHED_LIMIT = 12


def forge_refuses_bundle(bundle: dict[str, torch.Tensor]) -> bool:
    """Whether Forge would refuse a LoRA that carries these `bundle_emb.*` tensors (one per word and text encoder:
    SD 1.x/2.x 13 words, SDXL 7)."""
    return len(bundle) > FORGE_UNMATCHED_LIMIT


def word_loading_lines(tokens: list[str], sdxl: bool, lora_name: str, *, forge_file: bool) -> list[str]:
    """How each host loads the run's new words, one console line each (the run's last lines; the README says the
    same). `forge_file`: a NAME_forge.safetensors without the words was written for Forge."""
    words = ", ".join(tokens)
    files = ", ".join(f"{embedding_file_name(t)}.safetensors" for t in tokens)
    stems = ", ".join(embedding_file_name(t) for t in tokens)
    folder = embeddings_name(lora_name)
    forge_lora = f"{forge_name(lora_name) if forge_file else lora_name}{LORA_SUFFIX}"
    lines = [
        f"A1111 1.7+: loading {lora_name}{LORA_SUFFIX} brings {words} (bundled); write them in the prompt as trained.",
        f"Forge: it never reads bundled words: copy {folder}/{files} into its embeddings folder and write {stems} in "
        f"the prompt; load {forge_lora} as the LoRA" + (" (the bundled file has more than "
                                                         f"{FORGE_UNMATCHED_LIMIT} word tensors, which Forge refuses)."
                                                         if forge_file else "."),
        f"ComfyUI: copy {folder}/{files} into models/embeddings and write embedding:{stems.split(', ')[0]} "
        "(one per word) in the prompt.",
    ]
    if sdxl:
        lines.append(f"diffusers (SDXL): per word, state = safetensors.torch.load_file('{folder}/FILE'), then "
                     "pipe.load_textual_inversion(state['clip_l'], token=WORD, text_encoder=pipe.text_encoder, "
                     "tokenizer=pipe.tokenizer) and the same with state['clip_g'], pipe.text_encoder_2, pipe.tokenizer_2.")
    else:
        lines.append(f"diffusers: pipe.load_textual_inversion('{folder}/FILE', token=WORD) per word, and the LoRA "
                     "without its bundle_emb keys (or NAME_diffusers/).")
    return lines
