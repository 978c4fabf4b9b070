"""Hugging Face folders, which transformers, vLLM and TGI load and serve: read for convert (config.json, the
weights, the tokenizer files) and written by export.

Learned-position models are GPT-2 (plain multi-head attention only; gpt2.py); rotary models of GPT-2's block are
Starcoder2 (starcoder2.py); Llama-family ones are Llama, Qwen2 or Mistral (llama.py). The tokenizer goes out as
vocab.json + merges.txt, derived from the tiktoken ranks, so that Hugging Face's byte-level BPE encodes every text to
the same ids.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import tiktoken

from ..engine.config import GPTConfig
from ..errors import CheckpointError, InputError, ManasError, TokenizerError, first_line
from ..files import claim_folder, refuse_inputs, refuse_special, temporary_name
from . import gemma, gpt2, llama, phi3, starcoder2
from .importing import TIED_HEAD, check_tied_head, load_pickled_weights
from .tokenizer import (
    DIGITS_PAT_STR,
    END_OF_TEXT,
    GPT2_PAT_STR,
    MAX_TOKENIZER_FILE_BYTES,
    bytes_to_unicode,
    merge_parts,
    ordinary_ranks,
    read_tokenizer_text,
    spec_from_hf_files,
    spec_from_tokenizer_json,
)

if TYPE_CHECKING:
    import torch

    from .tensor_files import TensorFile

# What convert reads from a Hugging Face folder.
HF_CONFIG, HF_SAFETENSORS, HF_PICKLE = "config.json", "model.safetensors", "pytorch_model.bin"
HF_INDEX = "model.safetensors.index.json"  # sharded weights: which model-*.safetensors holds each tensor
HF_VOCAB, HF_MERGES, HF_TOKENIZER = "vocab.json", "merges.txt", "tokenizer.json"
HF_FOLDER = "Hugging Face {} folder"  # formatted with the architecture read
HF_WEIGHTS = "Hugging Face {} weights"
# Patterns that split text as Hugging Face's GPT-2 pre-tokenizer does: manas' own, and the equivalent possessive
# form that tiktoken's named gpt2 and r50k_base encodings use.
GPT2_SPLIT_PATTERNS = (
    GPT2_PAT_STR,
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""",
)

# Splits a tokenizer.json states exactly (tokenizer.split_pattern's inverse): SmolLM2's digits, Qwen2's regex.

WRITTEN_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
)

# Files an earlier export into the same folder may have left that Hugging Face would read instead of ours.
SHADOWING_FILES = (
    "tokenizer.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "model.safetensors.index.json",
)


@dataclass
class Exported:
    out: Path
    files: list[str]
    config: GPTConfig
    architecture: str  # "GPT-2" or "Starcoder2"


# --- reading -----------------------------------------------------------------------------------------------------


def config_from_hf(values: object, source: Path) -> GPTConfig:
    """A Hugging Face config.json's values as a manas config, by its model_type: GPT-2, Starcoder2, Llama, Qwen2 or
    Mistral."""
    if not isinstance(values, dict):
        raise CheckpointError(f"{source}: not a JSON object")
    readers = {gpt2.MODEL_TYPE: gpt2.config_from_hf, starcoder2.MODEL_TYPE: starcoder2.config_from_hf}
    readers |= dict.fromkeys(llama.ARCHITECTURES, llama.config_from_hf)
    readers |= {gemma.MODEL_TYPE: gemma.config_from_hf, phi3.MODEL_TYPE: phi3.config_from_hf}
    readers |= {gemma.MULTIMODAL_TYPE: gemma.config_from_multimodal}
    if values.get("model_type") not in readers:
        raise CheckpointError(
            f"{source}: model_type is {values.get('model_type')!r}; convert reads {', '.join(map(repr, readers))}"
        )
    return readers[values["model_type"]](values, source)


def read_hf_config(path: Path) -> GPTConfig:
    """A config.json read and checked, its errors naming it, before any weights are loaded."""
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path} does not exist") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: not a readable JSON config ({first_line(exc)})") from None
    return config_from_hf(values, path)


def folder_tensors(folder: Path, config: GPTConfig) -> TensorFile:
    """A folder's weights: model.safetensors, its shards by the index, or (GPT-2 only) pytorch_model.bin read
    without running code; of a multimodal Gemma 3, its language model's alone."""
    from .tensor_files import LoadedTensors, RenamedTensors, SafetensorsTensors

    if (folder / HF_SAFETENSORS).is_file() or (folder / HF_INDEX).is_file():
        tensors = (
            SafetensorsTensors([folder / HF_SAFETENSORS])
            if (folder / HF_SAFETENSORS).is_file()
            else SafetensorsTensors.sharded(folder / HF_INDEX)
        )
        if _model_type(folder / HF_CONFIG) == gemma.MULTIMODAL_TYPE:
            return RenamedTensors(tensors, gemma.language_model_names(tensors.names, folder))
        return tensors
    if not config.is_gpt2_family:
        raise InputError(
            f"{folder} holds no model.safetensors or {HF_INDEX}: Llama-family weights import from "
            "safetensors only (a pickle is never read)"
        )
    if (folder / HF_PICKLE).is_file():
        return LoadedTensors.of(load_pickled_weights(folder / HF_PICKLE), folder / HF_PICKLE)
    raise InputError(f"{folder} holds neither model.safetensors, {HF_INDEX} nor pytorch_model.bin")


def hf_kind(template: str, config: GPTConfig) -> str:
    """The source's kind: a Llama-family model came from a Llama, Qwen2 or Mistral folder, another rope model from a
    Starcoder2 one."""
    kind = (
        "Llama-family" if not config.is_gpt2_family else "Starcoder2" if config.position_encoding == "rope" else "GPT-2"
    )
    return template.format(kind)


def hf_to_manas(state: dict[str, torch.Tensor], source: Path, config: GPTConfig) -> dict[str, torch.Tensor]:
    """Some of a Hugging Face model's tensors (a layer's, or those outside the layers) under manas' names."""
    if gemma.is_gemma(config):
        return gemma.state_to_manas(state, config, source)
    if phi3.is_fused(state):
        return phi3.state_to_manas(state, config, source)
    if not config.is_gpt2_family:
        return llama.state_to_manas(state, config, source)
    if config.position_encoding == "rope":
        weights = {name: tensor for name, tensor in state.items() if name != TIED_HEAD}
        renamed = starcoder2.state_to_manas(weights, config, source)
        check_tied_head(state.get(TIED_HEAD), renamed.get("token_embedding.weight"), source)
        return renamed
    return gpt2.gpt2_state_to_manas(state, conv1d=True, source=source)


def folder_tokenizer(src: Path) -> tuple[str, dict] | None:
    """A Hugging Face folder's own GPT-2 tokenizer files, when they split text as GPT-2 does: vocab.json and
    merges.txt of a GPT-2 model, or of any without a tokenizer.json (whose own pre-tokenizer could split otherwise,
    as Starcoder2's does); else a tokenizer.json alone (transformers 5 saves no other), which says how it splits.
    None to fall back to --tokenizer-file or tiktoken's cache."""
    vocab, merges, combined = src / HF_VOCAB, src / HF_MERGES, src / HF_TOKENIZER
    if not src.is_dir():
        return None
    if vocab.is_file() and merges.is_file():
        if combined.is_file() and _model_type(src / HF_CONFIG) != "gpt2":
            return None
        texts = read_tokenizer_text(vocab, src), read_tokenizer_text(merges, src)
        spec = spec_from_hf_files(*texts, src, added_tokens(src))
        return f"GPT-2's BPE from {src}'s vocab.json and merges.txt (embedded)", spec
    if (src / "tokenizer.model").is_file() and (not combined.is_file() or _sentencepiece_style(combined)):
        from .sentencepiece import spec_from_model_file

        return f"the SentencePiece BPE of {src}'s tokenizer.model (embedded)", spec_from_model_file(
            src / "tokenizer.model"
        )
    if combined.is_file():
        spec = spec_from_tokenizer_json(read_tokenizer_text(combined, src), src)
        if spec["kind"] == "spm":  # Hugging Face's rendering of a SentencePiece BPE: its ends are <s> and </s>
            return f"the SentencePiece BPE from {src}'s tokenizer.json (embedded)", spec
        spec = with_bos(with_end_of_text(spec, src), combined, src)
        return f"the byte-level BPE from {src}'s tokenizer.json (embedded)", spec
    return None


def _sentencepiece_style(tokenizer_json: Path) -> bool:
    """Whether a tokenizer.json is the Hugging Face rendering of a SentencePiece model (byte fallback: Llama 2's,
    Mistral's), whose tokenizer.model beside it is read instead."""
    model = _json_object(tokenizer_json).get("model")
    return isinstance(model, dict) and bool(model.get("byte_fallback"))


def with_bos(spec: dict, tokenizer_json: Path, src: Path) -> dict:
    """The spec naming the token every prompt begins with, where the folder's tokenizer adds one: its
    tokenizer.json's post-processor template starting with a special token (Llama 3's), or tokenizer_config.json's
    add_bos_token with its bos_token."""
    processor = _json_object(tokenizer_json).get("post_processor")
    steps = processor.get("processors", [processor]) if isinstance(processor, dict) else []
    for step in steps if isinstance(steps, list) else []:
        single = step.get("single") if isinstance(step, dict) and step.get("type") == "TemplateProcessing" else None
        first = single[0] if isinstance(single, list) and single and isinstance(single[0], dict) else {}
        if isinstance(token := (first.get("SpecialToken") or {}).get("id"), str) and token in spec["special_tokens"]:
            return spec | {"bos": token}
    config = _json_object(src / "tokenizer_config.json")
    token = config.get("bos_token")
    token = token.get("content") if isinstance(token, dict) else token
    if config.get("add_bos_token") is True and isinstance(token, str) and token in spec["special_tokens"]:
        return spec | {"bos": token}
    return spec


def folder_chat_template(src: Path) -> str | None:
    """The chat template a folder declares: chat_template.jinja (transformers 5), else tokenizer_config.json's
    chat_template (a string, or a list of named ones: "default"); None for a base model without one."""
    path = src / "chat_template.jinja"
    if path.is_file():
        template = read_tokenizer_text(path, src)
    else:
        template = _json_object(src / "tokenizer_config.json").get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
    if not isinstance(template, str) or not template.strip():
        return None
    return checked_template(template, src)


def checked_template(template: str, source: Path) -> str:
    """A model's chat template, refused (naming `source`) where it is over the size any template needs or, with
    jinja2 installed, does not parse: a template stored would fail every chat later."""
    from ..chat_template import MAX_TEMPLATE_CHARS
    from ..errors import MissingDependencyError

    if len(template) > MAX_TEMPLATE_CHARS:
        raise TokenizerError(f"{source}: its chat template is over {MAX_TEMPLATE_CHARS:,} characters")
    from ..chat import check_template

    try:
        check_template(template)
    except MissingDependencyError:  # no jinja2: the template is stored, and checked where it is first used
        pass
    except ManasError as exc:
        raise TokenizerError(f"{source}: its chat template cannot be used: {exc}") from None
    return template


def with_end_of_text(spec: dict, src: Path) -> dict:
    """The spec naming the token that ends a text, where the folder says it is another than <|endoftext|>:
    generation_config.json's eos_token_id (the first of a list), else tokenizer_config.json's eos_token."""
    eos = _json_object(src / "generation_config.json").get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    by_id = {token_id: text for text, token_id in spec["special_tokens"].items()}
    text = by_id.get(eos) if type(eos) is int else None
    if text is None:
        configured = _json_object(src / "tokenizer_config.json").get("eos_token")
        text = configured.get("content") if isinstance(configured, dict) else configured
    if text in spec["special_tokens"] and text != END_OF_TEXT:
        return spec | {"end_of_text": text}
    return spec


def added_tokens(src: Path) -> frozenset[str]:
    """The added (special) tokens a folder lists beside vocab.json: added_tokens.json's, and tokenizer_config.json's
    added_tokens_decoder. Both are optional; one that cannot be read lists none."""
    listed = set(_json_object(src / "added_tokens.json"))
    decoder = _json_object(src / "tokenizer_config.json").get("added_tokens_decoder")
    if isinstance(decoder, dict):
        listed.update(entry.get("content") for entry in decoder.values() if isinstance(entry, dict))
    return frozenset(token for token in listed if isinstance(token, str))


def _json_object(path: Path) -> dict:
    """An optional JSON file's object: {} when it is missing, unreadable, too large or not an object."""
    try:
        if path.stat().st_size > MAX_TOKENIZER_FILE_BYTES:
            return {}
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _model_type(config: Path) -> object:
    return _json_object(config).get("model_type")  # None for a bad config: read_hf_config names what is wrong


# --- the model ------------------------------------------------------------------------------------------------------


def hf_twin(
    config: GPTConfig, dtype: torch.dtype, end_of_text: int | None, source: Path
) -> tuple[str, dict, Callable[[GPTConfig, dict[str, torch.Tensor]], dict[str, torch.Tensor]]]:
    """(architecture, config.json, the tensors' renaming) of the Hugging Face twin: Llama, Qwen2, Qwen3 or SmolLM3
    for the Llama family, Gemma 3, Phi-3, Starcoder2 for another rope model, else GPT-2."""
    if config.attention_scalar is not None and not gemma.is_gemma(config):
        raise CheckpointError(f"{source}: attention_scalar is Gemma 3's query_pre_attn_scalar; no other family "
                              "Hugging Face runs has it")  # fmt: skip
    if gemma.is_gemma(config):
        gemma.check_exportable(config, source)
        return "Gemma 3", gemma.hf_config(config, dtype, end_of_text), gemma.hf_tensors
    if phi3.is_phi3(config):
        phi3.check_exportable(config, source)
        return "Phi-3", phi3.hf_config(config, dtype, end_of_text), phi3.hf_tensors
    if not config.is_gpt2_family:
        llama.check_exportable(config, source)
        name = llama.NAMES[llama.model_type_of(config)]
        return name, llama.hf_config(config, dtype, end_of_text), llama.hf_tensors
    if config.position_encoding == "rope":
        starcoder2.check_exportable(config, source)
        return "Starcoder2", starcoder2.hf_config(config, dtype, end_of_text), starcoder2.hf_tensors
    gpt2.check_exportable(config, source)
    return "GPT-2", gpt2.hf_config(config, dtype, end_of_text), gpt2.hf_tensors


# --- tokenizer -----------------------------------------------------------------------------------------------------


def hf_merges(
    ranks: dict[bytes, int], pat_str: str, source: Path, patterns: tuple[str, ...] = GPT2_SPLIT_PATTERNS
) -> list[tuple[bytes, bytes]]:
    """The merge that builds each multi-byte token, in rank order: Hugging Face applies merges by their position in
    merges.txt, tiktoken by the rank of what they build, so this order makes the two agree."""
    multi_byte = sorted((rank, token) for token, rank in ranks.items() if len(token) > 1)
    if multi_byte and pat_str not in patterns:
        raise CheckpointError(
            f"{source}: the tokenizer splits text with its own pattern, but Hugging Face's GPT-2 tokenizer always "
            "splits with GPT-2's, so it would encode differently; only GPT-2-pattern BPE tokenizers export"
        )
    merges = []
    for rank, token in multi_byte:
        parts = merge_parts(ranks, token, rank)
        if len(parts) != 2 or not all(part in ranks for part in parts):
            raise CheckpointError(
                f"{source}: token {token!r} (id {rank}) is not the merge of two earlier tokens, so Hugging Face's "
                "byte-level BPE cannot represent this tokenizer"
            )
        merges.append((parts[0], parts[1]))
    return merges


@dataclass
class ByteLevelBPE:
    """A tiktoken encoding as byte-level BPE files spell it, each byte by its printable alias (bytes_to_unicode)."""

    tokens: dict[str, int]  # ordinary tokens → id
    special: dict[str, int]  # special tokens (<|endoftext|>) → id
    merges: list[str]  # "left right", in the order they apply


def byte_level_bpe(
    encoding: tiktoken.Encoding, source: Path, patterns: tuple[str, ...] = GPT2_SPLIT_PATTERNS
) -> ByteLevelBPE:
    """The encoding's tokens and merges, for a tokenizer whose split pattern the target runs (`patterns`)."""
    if encoding._pat_str is None:
        raise CheckpointError(
            f"{source}: its tokenizer is SentencePiece (Llama 2's kind), which manas does not export yet: byte-level "
            "BPEs only"
        )
    # tiktoken keeps the ranks, pattern and special tokens of an Encoding only in these attributes.
    ranks = ordinary_ranks(encoding)
    alias = bytes_to_unicode()

    def show(token: bytes) -> str:
        return "".join(alias[byte] for byte in token)

    merges = [f"{show(left)} {show(right)}" for left, right in hf_merges(ranks, encoding._pat_str, source, patterns)]
    tokens = {show(token): rank for token, rank in ranks.items()}
    for text, token_id in encoding._special_tokens.items():
        if text in tokens:  # one string for two ids: vocab.json would keep one, GGUF would list it twice
            raise CheckpointError(
                f"{source}: the special token {text!r} (id {token_id}) is spelled like ordinary token {tokens[text]} "
                "in byte-level BPE's alphabet, so the exported tokenizer could not tell them apart: rename it"
            )
    return ByteLevelBPE(tokens, dict(encoding._special_tokens), merges)


def tokenizer_files(encoding: tiktoken.Encoding, block_size: int, source: Path) -> dict[str, str]:
    """vocab.json, merges.txt and tokenizer_config.json for Hugging Face's GPT2Tokenizer; a tokenizer that splits
    otherwise (SmolLM2's digits, Qwen2's regex), normalizes or begins prompts with a BOS, as a tokenizer.json."""
    json_only = getattr(encoding, "normalization", None) or getattr(encoding, "bos", None)
    # a split but GPT-2's matters only to merges (a character vocabulary has none): GPT2Tokenizer's files do then
    merged = any(len(token) > 1 for token in ordinary_ranks(encoding))
    if (encoding._pat_str not in GPT2_SPLIT_PATTERNS and merged) or json_only:
        return tokenizer_json_files(encoding, block_size, source)
    bpe = byte_level_bpe(encoding, source)
    vocab = bpe.tokens | bpe.special
    end_of_text = END_OF_TEXT if END_OF_TEXT in bpe.special else None
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "model_max_length": block_size,
        "add_prefix_space": False,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,  # tiktoken's decode returns the text as it was
        "errors": "replace",
        # Named explicitly: left out, GPT2Tokenizer would invent <|endoftext|> as a new token.
        "bos_token": end_of_text,
        "eos_token": end_of_text,
        "unk_token": end_of_text,
    }
    return {
        # json.dumps' defaults, as OpenAI wrote GPT-2's encoder.json: GPT-2's export is then that file, byte for byte
        "vocab.json": json.dumps(dict(sorted(vocab.items(), key=lambda kv: kv[1]))),
        "merges.txt": "#version: 0.2\n" + "".join(f"{merge}\n" for merge in bpe.merges),
        "tokenizer_config.json": json_text(config),
    }


def tokenizer_json_files(encoding: tiktoken.Encoding, block_size: int, source: Path) -> dict[str, str]:
    """tokenizer.json (and its tokenizer_config.json) for Hugging Face's fast tokenizer: the byte-level BPE, split
    as the encoding's pattern splits (the inverse of tokenizer.split_pattern) and normalized as it normalizes."""
    bpe = byte_level_bpe(encoding, source, (encoding._pat_str,))  # a tokenizer.json splits by any regex
    end_of_text = getattr(encoding, "end_of_text", END_OF_TEXT)
    end_of_text = end_of_text if end_of_text in bpe.special else None
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False}
    if encoding._pat_str in GPT2_SPLIT_PATTERNS:
        splits = [byte_level | {"use_regex": True}]
    elif encoding._pat_str == DIGITS_PAT_STR:
        splits = [{"type": "Digits", "individual_digits": True}, byte_level | {"use_regex": True}]
    else:
        split = {"type": "Split", "pattern": {"Regex": encoding._pat_str}, "behavior": "Isolated", "invert": False}
        splits = [split, byte_level | {"use_regex": False}]
    normalization, bos = getattr(encoding, "normalization", None), getattr(encoding, "bos", None)
    if bos is not None:  # every prompt begins with it, as the folder's own post-processor said
        first, sequence = {"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}
        template = {
            "type": "TemplateProcessing",
            "single": [first, sequence],
            "pair": [first, sequence, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bpe.special[bos]], "tokens": [bos]}},
        }
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False}
            | {"normalized": False, "special": True}
            for text, i in sorted(bpe.special.items(), key=lambda item: item[1])
        ],
        "normalizer": {"type": normalization} if normalization else None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": splits},
        "post_processor": template if bos is not None else byte_level | {"use_regex": False},
        "decoder": byte_level | {"use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            # the special tokens too, as real tokenizers list them: an added token missing from the vocabulary is
            # given a new id past it when the file is read, whatever id it states (SmolLM2's begin at 0)
            "vocab": bpe.tokens | bpe.special,
            "merges": [merge.split(" ") for merge in bpe.merges],
        },
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": block_size,
        "clean_up_tokenization_spaces": False,
        "bos_token": bos,
        "eos_token": end_of_text,
    }
    return {"tokenizer.json": json.dumps(tokenizer, ensure_ascii=False), "tokenizer_config.json": json_text(config)}


def json_text(values: dict) -> str:
    return json.dumps(values, indent=2, ensure_ascii=False) + "\n"


# --- writing ----------------------------------------------------------------------------------------------------------


def check_out_dir(out: Path, force: bool, source: Path) -> None:
    """out is a new or empty folder, or with force one whose files we replace (or remove: SHADOWING_FILES), none of
    them the checkpoint we read or anything but a regular file."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file: name a folder to write the Hugging Face model into")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise InputError(f"{out} is not empty: pass --force to overwrite its Hugging Face files")
    if not out.parent.is_dir():
        raise InputError(f"the folder of --out {out} does not exist")
    for name in (*WRITTEN_FILES, *SHADOWING_FILES):
        refuse_inputs(out / name, (source,))
        refuse_special(out / name)


def write_folder(out: Path, writers: dict[str, Callable[[Path], None]], *, overwrite: bool) -> None:
    """Write every file into a staging folder beside out, then move them in: a new (or empty) folder appears whole
    (one rename, which fails if another writer filled it meanwhile); with overwrite, an existing one has each file
    replaced atomically and no stale file left to shadow ours."""
    staging = out.parent / temporary_name(out.name)
    os.mkdir(staging)  # the umask's mode, as a folder the user made (mkdtemp's 0700 would hide it from a server)
    try:
        for name, write in writers.items():
            write(staging / name)
        if not (overwrite and out.exists()):
            claim_folder(staging, out)
            return
        for name in writers:
            os.replace(staging / name, out / name)
        for name in (*WRITTEN_FILES, *SHADOWING_FILES):
            if name not in writers:  # a tokenizer of the other form, or weights another tool left
                (out / name).unlink(missing_ok=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
