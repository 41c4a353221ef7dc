"""Token texts and bytes for logprobs (frontend/token_text.py), against the tokenizers'
own decoding: byte-level BPE (the demo's) and a SentencePiece-style tokenizer with byte
fallback built here; a token that holds part of a character is "bytes:\\xNN..." and its
bytes are exact, so the tokens of a text join to it."""

from __future__ import annotations

import pytest

from noria.frontend.token_text import TokenTexts, spell
from noria.protocol.client import Logprob

TEXT = "Unicode: café, naïve 東京 你好 🙂 ✓ Привет, the river"


def _unbytes(text: str) -> bytes:
    """What a client does with a token text: "bytes:\\xNN..." back to its bytes."""
    if text.startswith("bytes:"):
        return bytes(int(h, 16) for h in text[len("bytes:"):].split("\\x")[1:])
    return text.encode()


def test_spelling_of_whole_and_partial_characters():
    assert spell("東".encode()) == "東"
    assert spell(b" \xf0\x9f") == "bytes:\\x20\\xf0\\x9f"
    assert spell(b"\x99") == "bytes:\\x99"
    assert _unbytes(spell(b"\xe6\x9d")) == b"\xe6\x9d"


def test_byte_level_tokens_join_to_the_text(demo_tokenizer):
    tt = TokenTexts(demo_tokenizer)
    assert tt.kind == "byte_level"
    ids = demo_tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    texts = [tt.entry(i)[0] for i in ids]
    data = [bytes(tt.entry(i)[1]) for i in ids]
    assert b"".join(data) == TEXT.encode()
    assert b"".join(_unbytes(t) for t in texts) == TEXT.encode()
    # The demo's small vocabulary splits the emoji into byte pieces: the test sees partial tokens.
    assert any(t.startswith("bytes:") for t in texts)
    # Whole-character tokens are plain text and join as they are.
    assert all(t == d.decode() for t, d in zip(texts, data, strict=True) if not t.startswith("bytes:"))


def test_every_byte_level_token_matches_its_own_decoding(demo_tokenizer):
    tt = TokenTexts(demo_tokenizer)
    for i in range(len(demo_tokenizer)):
        assert tt.bytes_of(i).decode("utf-8", errors="replace") == demo_tokenizer.decode([i]), i
    eot = demo_tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert tt.entry(eot) == ("<|eot_id|>", list(b"<|eot_id|>"))  # a special token is its content


def test_fill_gives_a_logprob_its_texts(demo_tokenizer):
    tt = TokenTexts(demo_tokenizer)
    ids = demo_tokenizer(" the river", add_special_tokens=False)["input_ids"]
    lp = Logprob(token_id=ids[0], logprob=-0.5, top_token_ids=ids, top_logprobs=[-0.5] * len(ids))
    tt.fill(lp)
    assert lp.token == tt.entry(ids[0])[0] and lp.bytes == tt.entry(ids[0])[1]
    assert lp.top_tokens == [tt.entry(i)[0] for i in ids] and lp.top_bytes == [tt.entry(i)[1] for i in ids]
    assert "".join(lp.top_tokens) == " the river"


@pytest.fixture(scope="module")
def pieces_tokenizer():
    """Llama 2's shape: "▁" for spaces, unknown characters as <0xNN> byte pieces."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    vocab += [(f"<0x{b:02X}>", 0.0) for b in range(256)]
    vocab += [(p, -1.0) for p in ("▁the", "▁river", "▁café", "▁", "t", "h", "e", "r", "i", "v", "c", "a", "f", "é")]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_pieces_and_byte_fallback(pieces_tokenizer):
    tt = TokenTexts(pieces_tokenizer)
    assert tt.kind == "pieces"
    text = "the river café 東京 🙂"
    ids = pieces_tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = pieces_tokenizer.convert_ids_to_tokens(ids)
    assert "<0xE6>" in pieces  # 東 went to byte pieces
    data = b"".join(tt.bytes_of(i) for i in ids)
    # The decoder strips the leading space at the start of a text; inside one it is the piece's.
    assert data == b" " + pieces_tokenizer.decode(ids).encode()
    assert data.decode() == " " + text
    texts = [tt.entry(i)[0] for i in ids]
    assert texts[:3] == [" the", " river", " café"]
    assert tt.entry(pieces_tokenizer.convert_tokens_to_ids("<0xE6>")) == ("bytes:\\xe6", [0xE6])
