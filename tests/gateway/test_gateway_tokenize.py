"""Chat templates (jinja2, Hugging Face conventions) and tokenization off the event loop."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from gateway.request.tokenize import ChatTemplate, TemplateError, TokenizerService

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


def test_chat_template_renders_chatml(model_dir):
    service = TokenizerService(model_dir)
    text = service.render_chat(MESSAGES)
    assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert not service.render_chat(MESSAGES, add_generation_prompt=False).endswith("assistant\n")


def test_chat_encoding_keeps_special_tokens_whole(model_dir):
    service = TokenizerService(model_dir)
    ids = service.encode_chat_sync(MESSAGES)
    im_start = service.tokenizer.token_to_id("<|im_start|>")
    assert ids[0] == im_start and ids.count(im_start) == 3


def test_template_sees_special_tokens_and_raise_exception():
    source = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
              "{{ raise_exception('no tools here') }}{% endif %}{{ m['content'] | tojson }}{% endfor %}{{ eos_token }}")
    tmpl = ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"})
    assert tmpl.render([{"role": "user", "content": "é"}]) == '<s>"é"</s>'
    with pytest.raises(TemplateError, match="no tools here"):
        tmpl.render([{"role": "tool", "content": "x"}])


def test_template_sandbox_blocks_attribute_escape():
    tmpl = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(TemplateError):
        tmpl.render(MESSAGES)


def test_named_templates_and_missing_template(tmp_path, byte_tokenizer):
    byte_tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert TokenizerService(tmp_path).render_chat(MESSAGES) == "D"
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TemplateError, match="no chat template"):
        TokenizerService(tmp_path).render_chat(MESSAGES)


def test_encoding_runs_off_the_event_loop(model_dir):
    service = TokenizerService(model_dir)
    seen = []
    original = service.encode_chat_sync

    def spy(messages, *options):
        seen.append(threading.current_thread() is threading.main_thread())
        return original(messages, *options)

    service.encode_chat_sync = spy
    ids = asyncio.run(service.encode_chat(MESSAGES))
    assert ids == original(MESSAGES) and seen == [False]
    assert asyncio.run(service.encode_prompt("hello world")) == service.encode("hello world")
