"""swarm.text.chat: ChatML fallback, HF-style jinja2 templates, and their errors."""

from __future__ import annotations

from typing import Any

import pytest

from swarm.errors import RequestError, TokenizerError
from swarm.text.chat import CHATML_TEMPLATE, render_chat

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]

CHATML_EXPECTED = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\nHello.<|im_end|>\n"
    "<|im_start|>user\nBye<|im_end|>\n"
)

# Llama-3-style, written the way real templates are: blocks on their own indented lines.
LLAMA3_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
  {% endfor %}
  {% if add_generation_prompt %}
    {{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
  {% endif %}"""


def test_chatml_fallback() -> None:
    assert render_chat(None, MESSAGES) == CHATML_EXPECTED + "<|im_start|>assistant\n"
    assert render_chat(None, MESSAGES, add_generation_prompt=False) == CHATML_EXPECTED


def test_chatml_template_constant_renders_the_fallback() -> None:
    for gen in (True, False):
        expected = render_chat(None, MESSAGES, add_generation_prompt=gen)
        assert render_chat(CHATML_TEMPLATE, MESSAGES, add_generation_prompt=gen) == expected


def test_custom_template_with_trim_and_lstrip_blocks() -> None:
    out = render_chat(LLAMA3_TEMPLATE, MESSAGES[:2], bos_token="<|begin_of_text|>")
    # trim_blocks drops the newline after each block tag, lstrip_blocks the indentation before it;
    # the indentation before {{ ... }} expressions and the newline after them stay, as in transformers.
    assert out == (
        "<|begin_of_text|>\n"
        "    <|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>\n"
        "    <|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>\n"
        "    <|start_header_id|>assistant<|end_header_id|>\n\n\n"
    )


def test_bos_and_eos_tokens_are_variables() -> None:
    tpl = "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    assert render_chat(tpl, MESSAGES[1:3], bos_token="<s>", eos_token="</s>") == "<s>Hi!</s>Hello.</s>"


def test_content_parts_are_joined() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": None},
    ]
    out = render_chat(None, messages, add_generation_prompt=False)
    assert out == "<|im_start|>user\none\ntwo<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"


def test_tojson_does_not_html_escape() -> None:
    tools = [{"type": "function", "function": {"name": "f<&>", "description": "héllo"}}]
    out = render_chat("{{ tools | tojson }}|{{ tools[0] | tojson(indent=1) }}", [], tools=tools)
    assert out.startswith('[{"type": "function", "function": {"name": "f<&>", "description": "héllo"}}]|')
    assert '\n "type": "function",' in out


def test_extra_context_and_generation_block() -> None:
    tpl = (
        "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    )
    assert render_chat(tpl, MESSAGES[1:2]) == "[Hi!]"
    assert render_chat(tpl, MESSAGES[1:2], extra_context={"enable_thinking": False}) == "[Hi!]<think></think>"
    # our variables win over extra_context
    assert render_chat("{{ messages | length }}", MESSAGES, extra_context={"messages": []}) == "4"


def test_loop_controls() -> None:
    tpl = "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.role[0] }}{% endfor %}"
    assert render_chat(tpl, MESSAGES) == "uau"


@pytest.mark.parametrize(
    ("template", "fragment"),
    [
        ("{% for m in messages %}{{ m.content }}", "syntax error at line 1"),
        ("{{ raise_exception('Conversation roles must alternate') }}", "Conversation roles must alternate"),
        ("{{ messages[0]['content'] + 1 }}", "TypeError"),
        ("{{ messages.append(1) }}", "SecurityError"),  # the environment is immutable and sandboxed
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
        ("{{ no_such_function() }}", "UndefinedError"),
        ("{% unknown_tag %}", "syntax error"),
    ],
)
def test_template_errors(template: str, fragment: str) -> None:
    with pytest.raises(TokenizerError) as info:
        render_chat(template, MESSAGES)
    assert info.value.code == "chat_template_error"
    assert fragment in info.value.message


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": 3}],
        [{"content": "no role"}],
        ["not a message"],
    ],
)
def test_malformed_messages_are_request_errors(messages: list[Any]) -> None:
    with pytest.raises(RequestError) as info:
        render_chat(None, messages)
    assert info.value.status == 400
    assert info.value.param is not None and info.value.param.startswith("messages[0]")
