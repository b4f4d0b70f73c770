"""bench/structured_vocab.py: a random model's tokenizer that llguidance reads and JSON can be spelled in, with
benchmark prompt words still one token each."""
import json
import random
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import structured_vocab  # noqa: E402
from gateway.structured.constraint import Constraint  # noqa: E402
from gateway.structured.grammar import Grammars, allows  # noqa: E402

VOCAB_SIZE, BOS, EOS = 16_384, 16_000, (16_001, 16_009)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}


def _tokenizer():
    return structured_vocab.build_tokenizer(VOCAB_SIZE, BOS, EOS)


def test_every_id_has_a_token_and_the_specials_keep_their_ids():
    tok = _tokenizer()
    assert tok.get_vocab_size() == VOCAB_SIZE
    assert len({tok.id_to_token(i) for i in range(VOCAB_SIZE)}) == VOCAB_SIZE
    assert all(tok.id_to_token(i) == f"<|special_{i}|>" for i in (BOS, *EOS))


def test_prompt_words_stay_one_token_each_and_text_round_trips():
    tok = _tokenizer()
    words = "user w0 w5 w123 w10000 assistant "
    ids = tok.encode(words).ids
    assert len(ids) == 7 and [tok.id_to_token(i) for i in ids[1:5]] == ["Ġw0", "Ġw5", "Ġw123", "Ġw10000"]
    text = '{"name": "a b\\n", "age": -12}'
    assert tok.decode(tok.encode(text).ids) == text  # nothing lost (llguidance tokenizes forced text with it)


def test_a_random_walk_under_a_schema_mask_writes_valid_json():
    """What a random-weight model does under the gateway's masks: any allowed token, until only EOS is."""
    tok = _tokenizer()
    grammars = Grammars(tok, VOCAB_SIZE, EOS)
    compiled = grammars.compile_sync(Constraint.json_schema(SCHEMA, "response_format"))
    rng, ends = random.Random(0), 0
    for _ in range(5):
        matcher, out = compiled.new_matcher(), []
        for _ in range(400):
            mask = grammars.mask_of(matcher)
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
            token = int(rng.choice(allowed))
            if token in EOS:
                break
            assert allows(mask, token) and matcher.consume_token(token), matcher.get_error()
            out.append(token)
        else:
            continue
        doc = json.loads(tok.decode(out))
        assert set(doc) == {"name", "age", "ok"} and len(doc["name"]) <= 12
        ends += 1
    assert ends >= 1


def test_write_for_preset_fills_the_folder_the_backend_reads(tmp_path):
    from gpu_backend.models.presets import preset_config
    from gpu_backend.models.random_tokenizer import ensure_random_tokenizer

    folder = structured_vocab.write_for_preset("smollm2-135m", tmp_path)
    assert ensure_random_tokenizer(preset_config("smollm2-135m"), tmp_path) == folder  # not rewritten
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config[structured_vocab.MARKER] and "chat_template" in config
    assert "Ġw42" in (folder / "tokenizer.json").read_text()
