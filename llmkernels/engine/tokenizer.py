"""A tokenizer built from GGUF metadata with the ``tokenizers`` library.

``tokenizer.ggml.model == "gpt2"``: byte-level BPE from ``tokens`` and ``merges``, split first by the pattern that
``tokenizer.ggml.pre`` names (Llama 3, Qwen2, GPT-4o, GPT-2). ``"llama"``: SentencePiece-style BPE with byte fallback, merges
from the token scores when the file has none. Control and user-defined tokens (token types 3 and 4) match whole.
"""
from __future__ import annotations

# The split patterns of the byte-level BPE families (published data of those tokenizers).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (GPT-4o, gpt-oss): letters split at case changes, contractions attached, "/" kept after punctuation
GPT4O_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                 r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_PATTERNS = {"llama-bpe": LLAMA3_PATTERN, "llama3": LLAMA3_PATTERN, "smaug-bpe": LLAMA3_PATTERN,
                "qwen2": QWEN2_PATTERN, "deepseek-r1-qwen": QWEN2_PATTERN, "gpt-4o": GPT4O_PATTERN}
GPT2_PRE = ("gpt-2", "gpt2", "default", "")

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


class TokenizerError(ValueError):
    """GGUF tokenizer metadata that cannot be turned into a tokenizer."""


def _spm_merges(tokens, scores):
    """BPE merges for a SentencePiece vocab: every split of a token into two vocab tokens, best score first."""
    index = {t: i for i, t in enumerate(tokens)}
    merges = []
    for tok, score in zip(tokens, scores):
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in index and right in index:
                merges.append((score, index[left], index[right], left, right))
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    return [(m[3], m[4]) for m in merges]


class Tokenizer:
    """encode(text) -> ids and decode(ids) -> text for a GGUF model's vocabulary."""

    def __init__(self, meta: dict):
        try:
            from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as e:  # pragma: no cover
            raise ImportError("the engine's tokenizer needs the tokenizers package: pip install tokenizers") from e
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if kind is None or not tokens:
            raise TokenizerError("the GGUF file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens)")
        tokens = [str(t) for t in tokens]
        types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
        self.kind = kind
        self.bos_id = meta.get("tokenizer.ggml.bos_token_id")
        self.eos_id = meta.get("tokenizer.ggml.eos_token_id")
        self.vocab_size = len(tokens)
        vocab = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        if kind == "gpt2":
            merges = meta.get("tokenizer.ggml.merges")
            if not merges:
                raise TokenizerError("a gpt2 (byte-level BPE) tokenizer needs tokenizer.ggml.merges")
            merges = [tuple(m.split(" ", 1)) for m in merges]
            tok = HFTokenizer(models.BPE(vocab, merges, ignore_merges=False))
            pre = str(meta.get("tokenizer.ggml.pre", "default"))
            if pre in PRE_PATTERNS:
                tok.pre_tokenizer = pre_tokenizers.Sequence([
                    pre_tokenizers.Split(Regex(PRE_PATTERNS[pre]), behavior="isolated", invert=False),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            elif pre in GPT2_PRE:
                tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
            else:
                raise TokenizerError(f"unsupported pre-tokenizer tokenizer.ggml.pre={pre!r}; supported: "
                                     f"{', '.join(list(PRE_PATTERNS) + list(GPT2_PRE[:3]))}")
            tok.decoder = decoders.ByteLevel()
        elif kind == "llama":
            scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
            merges = meta.get("tokenizer.ggml.merges")
            merges = [tuple(m.split(" ", 1)) for m in merges] if merges else _spm_merges(tokens, scores)
            unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
            tok = HFTokenizer(models.BPE(vocab, merges, unk_token=tokens[unk], fuse_unk=True, byte_fallback=True))
            tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
            tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(" ", 1, 0)])
        else:
            raise TokenizerError(f"unsupported tokenizer.ggml.model {kind!r} (supported: gpt2, llama)")
        special = [tokens[i] for i, ty in enumerate(types) if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
        if special:
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        self._special_ids = {i for i, ty in enumerate(types) if ty in (TOKEN_CONTROL, TOKEN_UNUSED)}
        self._tok = tok
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
        self.chat_template = meta.get("tokenizer.chat_template")
        self._tokens = tokens
        self._special_text = None

    def encode(self, text: str, add_bos: bool | None = None) -> list:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [int(self.bos_id)] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self._tok.decode(ids, skip_special_tokens=False)

    def special_id(self, text: str) -> int | None:
        """The id of the control token spelled ``text`` (such as ``<|end|>``), or None."""
        if self._special_text is None:
            self._special_text = {self._tokens[i]: i for i in sorted(self._special_ids, reverse=True)}
        return self._special_text.get(text)

    def token_text(self, i: int) -> str:
        """The vocabulary entry of id ``i`` as stored (special tokens such as ``<|eos|>`` read as themselves)."""
        return self._tokens[int(i)] if 0 <= int(i) < len(self._tokens) else ""

    def piece(self, i: int) -> str:
        """What token ``i`` decodes to on its own (special tokens included)."""
        return self._tok.decode([int(i)], skip_special_tokens=False)

    def token_bytes(self, i: int) -> bytes:
        """The bytes token ``i`` stands for (part of a UTF-8 character for some byte-level tokens)."""
        t = self.token_text(i)
        if self.kind == "gpt2":
            table = _unicode_to_byte()
            if all(c in table for c in t):
                return bytes(table[c] for c in t)
        elif len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            return bytes([int(t[3:5], 16)])
        else:
            t = t.replace("\u2581", " ")
        return t.encode("utf-8")


def byte_chars() -> list:
    """Byte-level BPE's printable stand-in for each byte 0..255 (GPT-2's table: printable Latin-1 bytes stand for
    themselves, the others for the characters from U+0100 on, in order)."""
    keep = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def _unicode_to_byte() -> dict:
    """The inverse of ``byte_chars``."""
    global _U2B
    if _U2B is None:
        _U2B = {c: b for b, c in enumerate(byte_chars())}
    return _U2B


_U2B = None
