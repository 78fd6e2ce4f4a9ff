"""SentencePiece tokenizers from GGUF files (`tokenizer.ggml.model` "llama": Llama 2, Mistral, Gemma, ...).

The files are made here: a small BPE model trained with the `sentencepiece` package (byte fallback on),
written as llama.cpp's converter writes one (pieces, scores, token types, the HF folder's added tokens,
the special ids and flags). The tokenizer imported from the file must give llama.cpp's ids for the
file: SentencePiece's own on each stretch of text between the tokens matched whole, with the space
prefix before every stretch (llama_cpp_ids). transformers' own GGUF tokenizer for the same file gives
those ids too, except for Llama-style files, where it puts the prefix only at the start of the text and
not before a space: there its ids are checked on the texts where the two rules agree, and the ones where
they do not are pinned (tests/checkpoint/test_llama_cpp_vocab_vectors.py holds a real Llama 2 file to
llama.cpp's vectors, which are the ids of Llama 2's own tokenizer).
"""

import dataclasses
import io
import json
import random
import re
import sys
import types

import gguf
import numpy as np
import pytest
import sentencepiece
import transformers
from transformers.tokenization_utils_base import generate_merges

from orca_jax.checkpoint.gguf_import import GGUFImportError, gguf_tokenizer
from orca_jax.checkpoint.gguf_reader import GGUFReader
from orca_jax.checkpoint.store import load_model
from orca_jax.cli import main
from orca_jax.config import load_model_preset
from orca_jax.model.decoder import init_decoder
from orca_jax.tokenizer import CONFIG_FILE, merges_from_vocab

from .test_import import llama_tensors
from .test_store import params_of

WORDS = ("the quick brown fox jumps over a lazy dog while the café serves naïve crème brûlée to people "
         "at half past seven on the 17th of May 2024 numbers like 123456 and 3.14159 are split into digits "
         "über straße façade señor œuvre déjà vu").split()
# Not in the training text, so only byte fallback can spell them: CJK, an emoji, a math letter.
RARE = "你好 🦙 𝔘"
TEXTS = [
    "the quick brown fox",
    "Crème brûlée at the café, déjà vu!",
    "May 17 2024: 123456 and 3.14159 and 0987",
    "spaces   in  runs     here",
    "lines\nand\n\nnewlines\r\n\ttabs\there",
    f"rare {RARE} characters",
    RARE,
    "trailing spaces   ",
    "  leading spaces",  # SentencePiece's (and llama.cpp's) space prefix before the first space too
    "",
]

# Each flag set as llama.cpp's converter writes it for that family, with the HF folder's added tokens
# (tokenizer_config.json's added_tokens_decoder: content -> special).
LLAMA = dict(arch="llama", trainer=dict(), add_space_prefix=True,
             added={"<tool_call>": True, "<tool>": False}, padded_vocab=408,
             special=dict(bos=1, eos=2, unk=0),
             chat_template="{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] "
                           "{{ m['content'] }} [/INST]{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}"
                           "{% endfor %}")
GEMMA = dict(arch="gemma3", add_space_prefix=False, padded_vocab=None,
             trainer=dict(add_dummy_prefix=False, pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
                          eos_piece="<eos>", bos_piece="<bos>",
                          user_defined_symbols=["<start_of_turn>", "<end_of_turn>", "▁▁", "▁▁▁▁"]),
             added={"<start_of_turn>": True, "<end_of_turn>": True, "▁▁": False, "▁▁▁▁": False},
             special=dict(bos=2, eos=1, unk=3, pad=0),
             chat_template="{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                           "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                           "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# Phi-3's files are Llama's kind; transformers puts the space prefix as llama.cpp does there.
PHI3 = dict(LLAMA, arch="phi3")
STYLES = {"llama": LLAMA, "gemma": GEMMA}
STYLE_TEXTS = {"llama": ["[INST] hi <tool> there [/INST] ok</s> then<tool_call>{}", "a <unk> b"],
               # a literal "▁▁" is the whitespace-run piece too (transformers spells those tokens so)
               "gemma": ["<start_of_turn>user\nhi    there<end_of_turn>", "x  y    z <pad><eos>", "a▁▁b"]}
MESSAGES = [{"role": "user", "content": "the fox"}, {"role": "assistant", "content": "jumps"},
            {"role": "user", "content": "over 42 dogs"}]


def train_sentencepiece(**options) -> sentencepiece.SentencePieceProcessor:
    """BPE with byte fallback, like Llama's and Gemma's models: no normalization, spaces kept, digits
    split, every character of the text in the vocabulary."""
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) for _ in range(300)]  # 14 KB
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=400, byte_fallback=True,
        character_coverage=1.0, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, num_threads=1, minloglevel=2, **options)
    return sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())


def llama_cpp_vocab(sp, added: dict, padded_vocab: int | None):
    """(tokens, scores, types) as convert_hf_to_gguf.py's _create_vocab_sentencepiece makes them: the
    model's pieces; the HF folder's added tokens over them or past them (special ones CONTROL, others
    USER_DEFINED with ▁ written as a real space); ids up to the model's vocab_size as unused [PADi]."""
    size = padded_vocab or sp.vocab_size()
    tokens = [f"[PAD{i}]" for i in range(size)]
    scores = [-10000.0] * size
    kinds = [gguf.TokenType.UNUSED] * size
    for i in range(sp.vocab_size()):
        tokens[i], scores[i] = sp.id_to_piece(i), sp.get_score(i)
        kinds[i] = (gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL if sp.is_control(i)
                    else gguf.TokenType.UNUSED if sp.is_unused(i) else gguf.TokenType.BYTE if sp.is_byte(i)
                    else gguf.TokenType.NORMAL)
    past_the_model = iter(range(sp.vocab_size(), size))
    for content, special in added.items():
        i = sp.piece_to_id(content)
        if i == sp.unk_id():  # not one of the model's pieces: an id of its own
            i = next(past_the_model)
        tokens[i] = content if special else content.replace("▁", " ")
        kinds[i] = gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED
        scores[i] = -1000.0
    return tokens, scores, kinds


def write_sentencepiece_gguf(path, sp, style, *, tokenizer_model="llama", model=None, **flags):
    """A GGUF with the style's tokenizer metadata; with `model` ((config, decoder)), its llama tensors too."""
    tokens, scores, kinds = llama_cpp_vocab(sp, style["added"], style["padded_vocab"])
    writer = gguf.GGUFWriter(str(path), style["arch"])
    if model is not None:
        config, decoder = model
        writer.add_block_count(config.n_layers)
        writer.add_context_length(config.max_position)
        writer.add_embedding_length(config.d_model)
        writer.add_feed_forward_length(config.d_ff)
        writer.add_head_count(config.n_heads)
        writer.add_head_count_kv(config.n_kv_heads)
        writer.add_layer_norm_rms_eps(config.norm_eps)
        for name, array in llama_tensors(config, params_of(decoder), permute_qk=True).items():
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(kinds)
    special = style["special"]
    writer.add_bos_token_id(special["bos"])
    writer.add_eos_token_id(special["eos"])
    writer.add_unk_token_id(special["unk"])
    if "pad" in special:
        writer.add_pad_token_id(special["pad"])
    writer.add_add_bos_token(flags.get("add_bos", True))
    writer.add_add_eos_token(flags.get("add_eos", False))
    writer.add_add_space_prefix(style["add_space_prefix"])
    writer.add_chat_template(style["chat_template"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def spm_files(tmp_path_factory):
    """{name: (path, SentencePiece model)}: Llama-style, Gemma-style, Llama-style with add_eos, Phi-3."""
    folder = tmp_path_factory.mktemp("spm-gguf")
    models = {name: train_sentencepiece(**style["trainer"]) for name, style in STYLES.items()}
    files = {name: (write_sentencepiece_gguf(folder / f"{name}.gguf", models[name], STYLES[name]), models[name])
             for name in STYLES}
    files["llama-eos"] = (write_sentencepiece_gguf(folder / "llama-eos.gguf", models["llama"], LLAMA, add_eos=True),
                          models["llama"])
    files["phi3"] = (write_sentencepiece_gguf(folder / "phi3.gguf", models["llama"], PHI3), models["llama"])
    return files


def transformers_gguf_tokenizer(path):
    """transformers' tokenizer for the file, by its own GGUF loading (from_pretrained(gguf_file=...)).
    Its file reader imports torch (for tensor dtypes) although reading metadata needs none, so that one
    function is given here, reading the same keys with gguf's reader; the rest is transformers' own."""
    reader_module = "transformers.integrations.gguf.reader"

    def read_gguf_metadata(gguf_path, string_arrays=()):
        reader = gguf.GGUFReader(gguf_path)
        metadata = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
        return metadata, tuple(t.name for t in reader.tensors)

    stand_in = types.ModuleType(reader_module)
    stand_in.read_gguf_metadata = read_gguf_metadata
    saved = sys.modules.get(reader_module)
    sys.modules[reader_module] = stand_in
    try:
        arch = gguf.GGUFReader(path).fields["general.architecture"].contents()
        tokenizer_class = transformers.GemmaTokenizer if arch.startswith("gemma") else transformers.LlamaTokenizer
        return tokenizer_class.from_pretrained(str(path.parent), gguf_file=path.name)
    finally:
        if saved is None:
            del sys.modules[reader_module]
        else:
            sys.modules[reader_module] = saved


@pytest.fixture(scope="session")
def tokenizers(spm_files):
    """{name: (ours, transformers')}."""
    return {name: (gguf_tokenizer(GGUFReader(path), path), transformers_gguf_tokenizer(path))
            for name, (path, _) in spm_files.items()}


def stretches(path, text) -> list[tuple[str, bool]]:
    """`text` cut before and after each token llama.cpp matches whole in it (the file's control,
    unknown and user-defined tokens): (part, whether it is such a token), in order."""
    reader = gguf.GGUFReader(path)
    tokens, types = (reader.fields[f"tokenizer.ggml.{key}"].contents() for key in ("tokens", "token_type"))
    whole = [t for t, kind in zip(tokens, types)
             if kind in (gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN, gguf.TokenType.USER_DEFINED)]
    pattern = "|".join(re.escape(token) for token in sorted(whole, key=len, reverse=True))
    # re.split with a group: the text between matches at even places, the matches at odd ones
    return [(part, i % 2 == 1) for i, part in enumerate(re.split(f"({pattern})", text)) if part]


def llama_cpp_ids(path, sp, text, add_special=True) -> list[int]:
    """llama.cpp's ids for `text` with a Llama-style file: each token matched whole is its id, each
    stretch of text between them is SentencePiece's own encoding of it (whose space prefix comes
    before every text it encodes, also before a space), and BOS (and EOS) as the file's flags say."""
    reader = gguf.GGUFReader(path)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    flag = {key: reader.fields[f"tokenizer.ggml.{key}"].contents() for key in ("add_bos_token", "add_eos_token",
                                                                             "bos_token_id", "eos_token_id")}
    vocab = {token: i for i, token in enumerate(tokens)}
    ids = []
    for part, whole in stretches(path, text):
        ids += [vocab[part]] if whole else sp.encode(part)
    bos, eos = (add_special and flag[f"add_{key}_token"] for key in ("bos", "eos"))
    return [flag["bos_token_id"]] * bos + ids + [flag["eos_token_id"]] * eos


@pytest.fixture(scope="session")
def reference(spm_files, tokenizers):
    """{name: ids(text, add_special=True)}, the ids each file must give: llama.cpp's for the Llama-style
    files, transformers' for Gemma's (there the two agree: no space prefix)."""
    ids = {name: (lambda text, add_special=True, path=path, sp=sp: llama_cpp_ids(path, sp, text, add_special))
           for name, (path, sp) in spm_files.items()}
    theirs = tokenizers["gemma"][1]
    ids["gemma"] = lambda text, add_special=True: theirs.encode(text, add_special_tokens=add_special)
    return ids


@pytest.mark.parametrize("name", ["llama", "gemma", "llama-eos", "phi3"])
def test_ids_equal_llama_cpp(tokenizers, reference, name):
    ours, _ = tokenizers[name]
    for text in TEXTS + STYLE_TEXTS["gemma" if name == "gemma" else "llama"]:
        assert ours.encode(text) == reference[name](text), text
        assert ours.encode(text, add_bos=False) == reference[name](text, add_special=False), text


@pytest.mark.parametrize("name", ["llama", "gemma", "llama-eos", "phi3"])
def test_ids_and_text_equal_transformers_except_its_llama_space_prefix(spm_files, tokenizers, name):
    """transformers' GGUF loader gives a Llama-style file (not Phi-3's) the space prefix only at the
    start of the text, and not before a space there (HF's non-legacy Llama rule). We depart from it:
    SentencePiece puts the prefix before every text it encodes, Llama 2 was trained on turns encoded
    one at a time (its own HF tokenizer prepends to every stretch between special tokens too), and
    llama.cpp does the same with the same file. So the ids differ exactly on a text that starts with
    whitespace or goes on after a token matched whole; everywhere else, and in decoding, they agree."""
    path, _ = spm_files[name]
    ours, theirs = tokenizers[name]
    for text in TEXTS + STYLE_TEXTS["gemma" if name == "gemma" else "llama"]:
        ids = ours.encode(text)
        after_a_token = any(not whole for _, whole in stretches(path, text)[1:])
        prefix_rules_differ = name in ("llama", "llama-eos") and (text[:1].isspace() or after_a_token)
        assert (ids == theirs.encode(text)) is not prefix_rules_differ, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text


def test_merges_derived_in_transformers_order(spm_files):
    """Every merge in transformers' order: by score, ties by the longer left piece, the longer right
    one, then the tokens' order."""
    tokens = ["a", "b", "c", "ab", "bc", "abc", "ca", "cab"]
    scores = [0, 0, 0, -1, -1, -2, -3, -2]
    assert merges_from_vocab(tokens, scores) == [("a", "b"), ("b", "c"), ("ab", "c"), ("ca", "b"), ("a", "bc"),
                                                 ("c", "ab"), ("c", "a")]
    for path, _ in spm_files.values():
        reader = gguf.GGUFReader(path)
        tokens = reader.fields["tokenizer.ggml.tokens"].contents()
        scores = reader.fields["tokenizer.ggml.scores"].contents()
        vocab = {token: i for i, token in enumerate(tokens)}
        assert merges_from_vocab(tokens, scores) == generate_merges(vocab, dict(zip(tokens, scores)))


def test_rare_characters_are_spelled_by_bytes_and_come_back(tokenizers):
    for name in STYLES:
        ours, _ = tokenizers[name]
        pieces = [ours.hf.id_to_token(i) for i in ours.encode(RARE, add_bos=False)]
        assert sum(p.startswith("<0x") for p in pieces) == len(RARE.replace(" ", "").encode()), pieces
        assert ours.decode(ours.encode(RARE), skip_special_tokens=True) == RARE


@pytest.mark.parametrize("name", list(STYLES))
def test_ids_equal_sentencepiece(spm_files, tokenizers, name):
    """SentencePiece itself, on the model the file was made from: the same ids (also for a text that
    starts with spaces), and the text back."""
    sp = spm_files[name][1]
    ours, _ = tokenizers[name]
    for text in TEXTS:
        assert ours.encode(text, add_bos=False) == sp.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=True) == text


def test_flags_special_tokens_and_template_come_from_the_file(tokenizers):
    llama, gemma, with_eos = (tokenizers[name][0] for name in ("llama", "gemma", "llama-eos"))
    assert (llama.bos_token_id, llama.eos_token_id, llama.add_bos_token, llama.add_eos_token) == (1, 2, True, False)
    assert (gemma.bos_token_id, gemma.eos_token_id, gemma.add_bos_token) == (2, 1, True)
    assert with_eos.encode("the fox")[-1] == 2 and with_eos.encode("the fox", add_bos=False)[-1] != 2
    assert llama.chat_template == LLAMA["chat_template"] and gemma.chat_template == GEMMA["chat_template"]
    assert (llama.vocab_size, gemma.vocab_size) == (LLAMA["padded_vocab"], 400)  # every id of the file
    # Llama's space prefix before the first word, none in Gemma's: "the" is a word after a space, or not.
    assert llama.hf.id_to_token(llama.encode("the fox")[1]) == "▁the"
    assert gemma.hf.id_to_token(gemma.encode("the fox")[1]) == "the"
    # control tokens whole and skippable, user-defined ones whole and kept
    ids = llama.encode("<tool_call>hi <tool>", add_bos=False)
    assert ids[0] == llama.hf.token_to_id("<tool_call>") and ids[-1] == llama.hf.token_to_id("<tool>")
    assert llama.decode(ids, skip_special_tokens=True).endswith("hi <tool>")
    assert "<tool_call>" in llama.decode(ids) and "<tool_call>" not in llama.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", list(STYLES))
def test_a_chat_template_writing_bos_gives_one_bos(tokenizers, reference, name):
    """The templates write `bos_token` and the files say add_bos_token: one BOS, then the rest of the
    prompt as a text of its own (Llama's first word with its space prefix, as in training)."""
    ours, theirs = tokenizers[name]
    prompt = ours.apply_chat_template(MESSAGES)
    bos_text = theirs.bos_token
    assert prompt.startswith(bos_text)
    ids = ours.encode(prompt)
    assert ids.count(ours.bos_token_id) == 1 and ids[0] == ours.bos_token_id
    assert ids == reference[name](prompt[len(bos_text):])
    assert ours.hf.id_to_token(ids[1]).startswith("▁") == (name == "llama")
    assert ours.encode(prompt, add_bos=False) == reference[name](prompt, add_special=False)


def test_an_unknown_tokenizer_kind_is_refused_naming_it(spm_files, tmp_path, capsys):
    sp = spm_files["llama"][1]
    rwkv = write_sentencepiece_gguf(tmp_path / "rwkv.gguf", sp, LLAMA, tokenizer_model="rwkv")
    with pytest.raises(GGUFImportError, match=r"tokenizer.ggml.model='rwkv' is not supported; "
                                              r"supported: \['gpt2', 'llama'\]"):
        gguf_tokenizer(GGUFReader(rwkv), rwkv)
    config = dataclasses.replace(load_model_preset("tiny"), vocab_size=LLAMA["padded_vocab"])
    bert = write_sentencepiece_gguf(tmp_path / "bert.gguf", sp, LLAMA, tokenizer_model="bert",
                                    model=(config, init_decoder(config, seed=2)))
    assert main(["convert", str(bert), "--name", "bert", "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "tokenizer.ggml.model='bert' is not supported" in error and "['gpt2', 'llama']" in error


def test_convert_a_sentencepiece_gguf_with_a_model(spm_files, tmp_path, capsys):
    """`orca-jax convert file.gguf --name X`: the checkpoint's tokenizer (tokenizer.json and
    tokenizer_config.json) is the file's, and the LLM's chat prompts start with one BOS."""
    from orca_jax import LLM, SamplingParams

    sp = spm_files["llama"][1]
    config = dataclasses.replace(load_model_preset("tiny"), vocab_size=LLAMA["padded_vocab"], bos_token_id=1,
                                 eos_token_id=2)
    path = write_sentencepiece_gguf(tmp_path / "spm.gguf", sp, LLAMA, model=(config, init_decoder(config, seed=3)))
    out = tmp_path / "spm"
    assert main(["convert", str(path), "--name", "spm", "--out", str(out)]) == 0, capsys.readouterr().err
    saved = json.loads((out / CONFIG_FILE).read_text())
    assert (saved["add_bos_token"], saved["add_eos_token"], saved["bos_token_id"]) == (True, False, 1)
    loaded = load_model(out)
    assert loaded.config.vocab_size == LLAMA["padded_vocab"]
    for text in TEXTS + STYLE_TEXTS["llama"]:
        assert loaded.tokenizer.encode(text) == llama_cpp_ids(path, sp, text), text

    llm = LLM(out, max_num_seqs=1, max_num_batched_tokens=64, token_buckets=[64], seq_buckets=[1],
              show_progress=False)
    [output] = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    prompt = loaded.tokenizer.apply_chat_template(MESSAGES)
    assert output.prompt_token_ids == llama_cpp_ids(path, sp, prompt[len("<s>"):])
    assert output.prompt_token_ids.count(1) == 1
