"""SentencePiece's BPE (Llama 2's, TinyLlama's, Mistral's tokenizer) as llama.cpp runs it: the text with a space
before it and every space written as "▁", split into characters, then the adjacent pair whose joined text is a
piece of the highest score merged, again and again; a character no piece spells becomes its UTF-8 bytes' <0xXX>
pieces (byte fallback). Its ids are sentencepiece's and llama.cpp's.

SentencePieceEncoding offers what manas asks of a tiktoken.Encoding (encode, decode, the special tokens), so every
command runs a model whose checkpoint embeds such a tokenizer ({"kind": "spm", …}: FORMAT.md)."""

from __future__ import annotations

import heapq
import math
import re
from pathlib import Path

from ..errors import MissingDependencyError, TokenizerError, first_line

SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp's (and sentencepiece's) types
MAX_PIECES = 1 << 20
MAX_MODEL_FILE_BYTES = 64 * 2**20  # Llama 2's tokenizer.model is 0.5 MB
BPE_MODEL = 2  # sentencepiece's model types: 1 unigram, 2 BPE, 3 word, 4 char


class SentencePieceEncoding:
    """A SentencePiece BPE vocabulary: pieces with their scores and types (ids are positions)."""

    name = "manas-spm"
    normalization = None
    skipped_from = None
    _pat_str = None  # no split pattern: the exports, which need one, refuse this tokenizer by name

    def __init__(
        self, pieces: list[str], scores: list[float], types: list[int], add_space_prefix: bool, end_of_text: str,
        bos: str | None,
    ) -> None:  # fmt: skip
        self.pieces, self.scores, self.types, self.add_space_prefix = pieces, scores, types, add_space_prefix
        self.end_of_text, self.bos = end_of_text, bos
        self.ids = {piece: i for i, piece in enumerate(pieces) if types[i] in (NORMAL, USER_DEFINED, UNKNOWN, BYTE)}
        self.byte_ids = {int(piece[3:5], 16): i for i, piece in enumerate(pieces) if types[i] == BYTE}
        self._special_tokens = {piece: i for i, piece in enumerate(pieces) if types[i] in (CONTROL, UNUSED)}
        self.special_tokens_set = set(self._special_tokens)
        special_ids = set(self._special_tokens.values())
        self._mergeable_ranks = {piece.encode(): i for i, piece in enumerate(pieces) if i not in special_ids}
        self.max_token_value = len(pieces) - 1
        self.n_vocab = len(pieces)
        user_defined = sorted((p for i, p in enumerate(pieces) if types[i] == USER_DEFINED), key=len, reverse=True)
        self._user_split = re.compile("(" + "|".join(map(re.escape, user_defined)) + ")") if user_defined else None
        self._special_split = (
            re.compile("(" + "|".join(map(re.escape, sorted(self._special_tokens, key=len, reverse=True))) + ")")
            if self._special_tokens
            else None
        )

    # ---- encoding ----

    def encode_ordinary(self, text: str) -> list[int]:
        return self._encode_raw(text, after_special=True)

    def encode(self, text: str, allowed_special: object = "all") -> list[int]:
        """The text's ids, special-token text (<s>, </s>) as those tokens; after one, the next text gets the space
        prefix again, as llama.cpp gives it."""
        if self._special_split is None:
            return self.encode_ordinary(text)
        ids, after_special = [], True
        for i, fragment in enumerate(self._special_split.split(text)):
            if i % 2:
                ids.append(self._special_tokens[fragment])
                after_special = True
            elif fragment:
                ids += self._encode_raw(fragment, after_special)
                after_special = False
        return ids

    def _encode_raw(self, text: str, after_special: bool) -> list[int]:
        """Text between special tokens: normalized (the space prefix, "▁"), its user-defined pieces ([INST] in
        Mistral's) taken whole, the rest merged."""
        if not text:
            return []
        text = ((" " if self.add_space_prefix and after_special else "") + text).replace(" ", SPACE)
        ids = []
        for i, fragment in enumerate(self._user_split.split(text) if self._user_split else [text]):
            if i % 2:
                ids.append(self.ids[fragment])
            elif fragment:
                ids += [
                    token
                    for symbol in merged_symbols(fragment, self.ids, self.scores)
                    for token in self._spelled(symbol)
                ]
        return ids

    def _spelled(self, symbol: str) -> list[int]:
        """A merged symbol's id, or (a character no piece spells) its UTF-8 bytes' pieces."""
        if (token := self.ids.get(symbol)) is not None:
            return [token]
        unknown = self.ids.get("<unk>", 0)
        return [self.byte_ids.get(byte, unknown) for byte in symbol.encode("utf-8")]

    def encode_single_token(self, piece: str | bytes) -> int:
        if isinstance(piece, bytes):
            if len(piece) == 1 and piece[0] in self.byte_ids:  # every byte is spelled (by its <0xXX> piece)
                return self.byte_ids[piece[0]]
            piece = piece.decode("utf-8", "replace")
        if piece in self._special_tokens:
            return self._special_tokens[piece]
        return self.ids[piece]

    # ---- decoding ----

    def decode_single_token_bytes(self, token: int) -> bytes:
        """What the token writes: a piece's text with "▁" as a space, a byte piece's byte, nothing for a control
        token (</s> ends a text; it is not part of it)."""
        kind = self.types[token]
        if kind == BYTE:
            return bytes([int(self.pieces[token][3:5], 16)])
        if kind in (CONTROL, UNUSED):
            return b""
        return self.pieces[token].replace(SPACE, " ").encode("utf-8")

    def decode_bytes(self, tokens: list[int]) -> bytes:
        return b"".join(self.decode_single_token_bytes(token) for token in tokens)

    def decode(self, tokens: list[int], errors: str = "replace") -> str:
        return self.decode_bytes(tokens).decode("utf-8", errors)

    def token_byte_values(self) -> list[bytes]:
        return [self.decode_single_token_bytes(i) for i in range(len(self.pieces))]


def merged_symbols(text: str, ids: dict[str, int], scores: list[float]) -> list[str]:
    """The text's characters, merged pair by pair: always the adjacent pair whose joined text is a piece of the
    highest score (the leftmost of equals), as sentencepiece and llama.cpp merge."""
    symbols: list[str | None] = list(text)
    previous = list(range(-1, len(symbols) - 1))
    following = list(range(1, len(symbols) + 1))
    queue: list[tuple[float, int, int, str]] = []  # (−score, left, right, joined): the best pair first

    def offer(left: int, right: int) -> None:
        if left < 0 or right >= len(symbols):
            return
        joined = symbols[left] + symbols[right]
        if (token := ids.get(joined)) is not None:
            heapq.heappush(queue, (-scores[token], left, right, joined))

    for i in range(1, len(symbols)):
        offer(i - 1, i)
    while queue:
        _, left, right, joined = heapq.heappop(queue)
        if symbols[left] is None or symbols[right] is None or symbols[left] + symbols[right] != joined:
            continue  # one side was merged since this pair was offered
        symbols[left], symbols[right] = joined, None
        following[left] = following[right]
        if following[right] < len(symbols):
            previous[following[right]] = left
        offer(previous[left], left)
        offer(left, following[left])
    return [symbol for symbol in symbols if symbol is not None]


def spec_from_model_file(path: Path) -> dict:
    """A sentencepiece tokenizer.model (Llama 2's, Mistral's) as an embedded spec: a BPE model's pieces, scores and
    types, read with the sentencepiece package's own description of the file (the `sentencepiece` extra)."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:
        raise MissingDependencyError(
            'reading a tokenizer.model needs sentencepiece: pip install "manas-cli[sentencepiece]"'
        ) from None
    if not path.is_file():
        raise TokenizerError(f"no tokenizer {path}: no such file")
    if path.stat().st_size > MAX_MODEL_FILE_BYTES:
        raise TokenizerError(f"{path} is over {MAX_MODEL_FILE_BYTES // 2**20} MiB: not a tokenizer.model")
    model = sentencepiece_model_pb2.ModelProto()
    try:
        model.ParseFromString(path.read_bytes())
    except Exception as exc:  # protobuf's DecodeError, an unreadable file
        raise TokenizerError(f"{path} is not a sentencepiece model manas can read: {first_line(exc)}") from None
    if model.trainer_spec.model_type != BPE_MODEL:
        raise TokenizerError(f"{path}: a sentencepiece model of type {model.trainer_spec.model_type}, not BPE (2)")
    if model.normalizer_spec.name not in ("identity", ""):
        raise TokenizerError(f"{path}: its normalization {model.normalizer_spec.name!r} is not one manas runs")
    pieces = [piece.piece for piece in model.pieces]
    spec = {
        "kind": "spm",
        "pieces": pieces,
        "scores": [piece.score for piece in model.pieces],
        "types": [piece.type for piece in model.pieces],
        "add_space_prefix": model.normalizer_spec.add_dummy_prefix,
    }
    ends = {"end_of_text": model.trainer_spec.eos_id, "bos": model.trainer_spec.bos_id}
    return spec | {key: pieces[i] for key, i in ends.items() if 0 <= i < len(pieces)}


def spec_from_tokenizer_json(values: dict, source: str | Path) -> dict:
    """Hugging Face's rendering of a SentencePiece BPE (Llama 2's, TinyLlama's, Mistral's tokenizer.json: byte
    fallback, spaces as "▁", a space before the text) as an embedded spec. Its merges are sentencepiece's pieces
    in the order of their scores, so each piece scores minus the rank of its first merge: the best-scoring join
    is then the earliest merge, as Hugging Face's BPE applies them. Added tokens marked special are control
    tokens (<s>, </s>), the others user-defined pieces taken whole."""
    model = values["model"]
    vocab, merges, added = model.get("vocab"), model.get("merges") or [], values.get("added_tokens") or []
    if not isinstance(vocab, dict) or not all(type(i) is int for i in vocab.values()) or not isinstance(merges, list):
        raise TokenizerError(f"{source}: tokenizer.json's model.vocab must map pieces to ids, model.merges be a list")
    if not isinstance(added, list) or not all(
        isinstance(t, dict) and type(t.get("id")) is int and isinstance(t.get("content"), str) for t in added
    ):
        raise TokenizerError(
            f"{source}: tokenizer.json's added_tokens must be objects with a 'content' and an integer 'id'"
        )
    by_id = vocab | {t.get("content"): t["id"] for t in added}
    if sorted(by_id.values()) != list(range(len(by_id))) or len(by_id) > MAX_PIECES:
        raise TokenizerError(f"{source}: tokenizer.json's pieces must have the ids 0 to n-1, each once")
    pieces = sorted(by_id, key=by_id.__getitem__)
    first_merge: dict[str, int] = {}
    for rank, merge in enumerate(merges):
        left, right = merge if isinstance(merge, list) and len(merge) == 2 else (str(merge).split(" ", 1) + [""])[:2]
        first_merge.setdefault(f"{left}{right}", rank)
    specials = {t.get("content"): t.get("special") is True for t in added}
    unknown = model.get("unk_token")

    def kind(piece: str) -> int:
        if piece in specials:
            return CONTROL if specials[piece] else USER_DEFINED
        return BYTE if re.fullmatch(r"<0x[0-9A-F]{2}>", piece) else UNKNOWN if piece == unknown else NORMAL

    spec = {
        "kind": "spm",
        "pieces": pieces,
        "scores": [-float(first_merge.get(piece, len(merges))) for piece in pieces],
        "types": [kind(piece) for piece in pieces],
        "add_space_prefix": _adds_space_prefix(values),
    }
    ends = {"end_of_text": "</s>", "bos": "<s>"}
    return spec | {key: piece for key, piece in ends.items() if specials.get(piece)}


def _adds_space_prefix(values: dict) -> bool:
    """Whether the text gets a "▁" before it: a Metaspace pre-tokenizer that prepends (transformers' newer
    rendering), or a Prepend normalizer (its older one)."""
    steps = [values.get("pre_tokenizer"), values.get("normalizer")]
    flat = []
    for step in (step for step in steps if isinstance(step, dict)):
        inner = step.get("pretokenizers", step.get("normalizers", [step]))
        flat += inner if isinstance(inner, list) else []
    return any(
        isinstance(step, dict)
        and (
            (step.get("type") == "Metaspace" and step.get("prepend_scheme", "always") != "never"
             and step.get("add_prefix_space", True) is not False)
            or (step.get("type") == "Prepend" and step.get("prepend") == SPACE)
        )
        for step in flat
    )  # fmt: skip


def check_spm(spec: dict) -> None:
    """What an embedded SentencePiece spec must hold: pieces, scores and types of one length, each typed."""
    pieces, scores, types = spec.get("pieces"), spec.get("scores"), spec.get("types")
    if not (isinstance(pieces, list) and isinstance(scores, list) and isinstance(types, list)):
        raise TokenizerError("the embedded SentencePiece tokenizer lacks its pieces, scores or types")
    if not 0 < len(pieces) == len(scores) == len(types) <= MAX_PIECES:
        raise TokenizerError("the embedded SentencePiece tokenizer's pieces, scores and types differ in length")
    if not all(isinstance(p, str) and p for p in pieces) or len(set(pieces)) != len(pieces):
        raise TokenizerError("the embedded SentencePiece tokenizer's pieces must be distinct non-empty strings")
    if not all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) for s in scores):
        raise TokenizerError("the embedded SentencePiece tokenizer's scores must be finite numbers")
    if not all(type(t) is int and NORMAL <= t <= BYTE for t in types):
        raise TokenizerError("the embedded SentencePiece tokenizer's types must be 1 to 6 (sentencepiece's)")
    if any(t == BYTE and not re.fullmatch(r"<0x[0-9A-F]{2}>", p) for p, t in zip(pieces, types)):
        raise TokenizerError("a byte piece of the embedded SentencePiece tokenizer is not spelled <0xXX>")


def build_spm(spec: dict) -> SentencePieceEncoding:
    check_spm(spec)
    specials = {p for p, t in zip(spec["pieces"], spec["types"]) if t in (CONTROL, UNUSED)}
    ends = {key: spec.get(key) for key in ("end_of_text", "bos")}
    for key, value in ends.items():
        if value is not None and value not in specials:
            raise TokenizerError(f"the embedded SentencePiece tokenizer's {key} {value!r} is not a control token")
    if ends["end_of_text"] is None:
        raise TokenizerError("the embedded SentencePiece tokenizer names no end_of_text")
    return SentencePieceEncoding(
        spec["pieces"], [float(s) for s in spec["scores"]], spec["types"], spec.get("add_space_prefix", True) is True,
        ends["end_of_text"], ends["bos"],
    )  # fmt: skip
