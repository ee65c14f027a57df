import pytest

from diffar.errors import DiffarError
from diffar.tokenizer import SPECIAL_TOKENS, Tokenizer, train_tokenizer

TEXTS = [
    "And God said, Let there be light: and there was light.",
    "  leading spaces, trailing tabs\t\t\nand new\nlines  ",
    "Unicode: naïve café — 日本語 🙂 «quotes»",
    "",
    "<sep> looks special but is plain text here",
]


@pytest.mark.parametrize("text", TEXTS)
def test_exact_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens_have_distinct_ids(tokenizer):
    ids = [tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.sep_id, tokenizer.mask_id]
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)


def test_save_load_same_hash(tokenizer, tmp_path):
    tokenizer.save(tmp_path / "t.json")
    again = Tokenizer.load(tmp_path / "t.json")
    assert again.sha256 == tokenizer.sha256
    assert again.encode(TEXTS[0]) == tokenizer.encode(TEXTS[0])


def test_corrupt_file_is_a_clear_error(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DiffarError, match="not a valid tokenizer"):
        Tokenizer.load(tmp_path / "bad.json")
    with pytest.raises(DiffarError, match="cannot read"):
        Tokenizer.load(tmp_path / "missing.json")


def test_vocab_too_small_rejected():
    with pytest.raises(DiffarError, match="vocab_size"):
        train_tokenizer(["abc"], vocab_size=100)


def test_shipped_tokenizer_loads():
    from diffar.commands.flags import DEFAULT_TOKENIZER

    tok = Tokenizer.load(DEFAULT_TOKENIZER)
    assert tok.vocab_size == 8192
    assert tok.decode(tok.encode(TEXTS[2])) == TEXTS[2]


def test_a_models_own_special_tokens_and_chat_template_round_trip(tokenizer, tmp_path):
    """An imported model's tokenizer keeps its specials (some roles absent) in tokenizer_config.json."""
    specials = {"bos": "<bos>", "eos": "<sep>", "pad": "<sep>"}
    imported = Tokenizer(tokenizer.hf, specials, chat_template="{{ messages }}")
    imported.save(tmp_path / "tokenizer.json")
    again = Tokenizer.load(tmp_path / "tokenizer.json")
    assert (again.bos_id, again.eos_id, again.pad_id) == (tokenizer.bos_id, tokenizer.sep_id, tokenizer.sep_id)
    assert again.sep_id is None and again.mask_id is None and again.chat_template == "{{ messages }}"
    assert again.sha256 == tokenizer.sha256
    tokenizer.save(tmp_path / "own.json")
    assert not (tmp_path / "own_config.json").exists()  # diffar's own tokenizer files stay as they were
    with pytest.raises(DiffarError, match="no pad or no end-of-sequence"):
        Tokenizer(tokenizer.hf, {"bos": "<bos>"})
    with pytest.raises(DiffarError, match="lacks special tokens"):
        Tokenizer(tokenizer.hf, {"eos": "<|im_end|>", "pad": "<|im_end|>"})
