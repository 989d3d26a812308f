"""Chat-template rendering: OpenAI-style messages -> one prompt string (pure: no I/O, no clock).

Renders the Hugging-Face-style jinja2 template a GGUF carries as ``tokenizer.chat_template`` the way
``transformers`` does: an immutable sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``,
the ``loopcontrols`` extension, a ``{% generation %}`` block that renders its body, a ``raise_exception``
global and a ``tojson`` filter that does not HTML-escape. Without a template it falls back to ChatML.

Rules:
- Every failure of a template (syntax, undefined names, ``raise_exception``, errors while rendering)
  becomes a ``TokenizerError`` with code ``"chat_template_error"``; malformed messages are a
  ``RequestError`` (the caller's fault, not the model's).
- Message content is a string, None (rendered as ""), or a list of ``{"type": "text", "text": ...}``
  parts, which are joined with newlines (as llama.cpp and vLLM do) before the template sees them.
- No clock: ``strftime_now`` is not defined unless the caller passes it in ``extra_context``, so
  templates fall back to their built-in date.
- ``CHATML_TEMPLATE`` renders exactly the fallback, so a model writer can store it in a GGUF.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from swarm.errors import RequestError, TokenizerError

__all__ = ["CHATML_TEMPLATE", "render_chat"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _TemplateRaised(Exception):
    """What ``raise_exception`` inside a template raises."""


def _raise_exception(message: str) -> NoReturn:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: plain json.dumps, unlike jinja2's HTML-escaping built-in.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(
            f"chat template has a syntax error at line {exc.lineno}: {exc.message}",
            code="chat_template_error",
        ) from exc


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts: list[str] = []
        for part in content:
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise RequestError(
                    f"messages[{index}].content: only text parts are supported, got {kind!r}",
                    code="unsupported_content",
                    param=f"messages[{index}].content",
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise RequestError(
        f"messages[{index}].content must be a string or a list of text parts, got {type(content).__name__}",
        param=f"messages[{index}].content",
    )


def _normalise(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise RequestError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(f"messages[{i}].role must be a non-empty string", param=f"messages[{i}].role")
        norm = dict(msg)
        norm["content"] = _content_text(msg.get("content"), i)
        out.append(norm)
    return out


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: Sequence[Mapping[str, Any]] | None = None,
    extra_context: Mapping[str, Any] | None = None,
) -> str:
    """Render ``messages`` with ``template`` (a GGUF's ``tokenizer.chat_template``) or ChatML if None.

    ``tools`` and ``extra_context`` (e.g. ``{"enable_thinking": False}``) are passed to the template
    as variables, as ``transformers.apply_chat_template`` does with its keyword arguments.
    """
    norm = _normalise(messages)
    compiled = _compile(CHATML_TEMPLATE if template is None else template)
    context: dict[str, Any] = dict(extra_context or {})
    context.update(
        messages=norm,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        tools=None if tools is None else [dict(t) for t in tools],
    )
    try:
        return compiled.render(**context)
    except _TemplateRaised as exc:
        raise TokenizerError(f"chat template raised: {exc}", code="chat_template_error") from exc
    except Exception as exc:  # anything a template expression can raise (TypeError on str + None, ...)
        raise TokenizerError(
            f"chat template failed: {type(exc).__name__}: {exc}", code="chat_template_error"
        ) from exc
