"""Chat templates: turn a list of messages into the prompt text a model was trained on.

A GGUF model carries its Hugging Face chat template (Jinja) in `tokenizer.chat_template`. We
render it the way transformers does: `trim_blocks` and `lstrip_blocks` on, the `loopcontrols`
extension, a `tojson` filter that keeps non-ASCII text (`ensure_ascii=False`), the globals
`raise_exception(message)` and `strftime_now(format)`, and the variables `messages`,
`add_generation_prompt`, `bos_token`, `eos_token` and `tools` (None unless given), plus any
extra keyword arguments (e.g. `enable_thinking`).

Templates come from strangers' files, so they run in Jinja's ImmutableSandboxedEnvironment,
made stricter: touching an unsafe attribute (`''.__class__`, `cycler.__init__.__globals__`)
raises instead of quietly rendering as empty. Every failure (syntax error, sandbox refusal,
`raise_exception`, a Python error inside the template) becomes a MinillmError that names the
template and says what failed.

Plain format, for models without a template (base models such as gemma-3-270m): each message
becomes one line "<Role>: <content>\\n", the role title-cased ("System", "User", "Assistant");
with add_generation_prompt the prompt ends in "Assistant:" (no trailing space: words start with
their space in these vocabularies, so the model writes it). A notice about this goes to stderr.
"""
from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from .errors import MinillmError

MODEL_TEMPLATE_NAME = "the model's chat template (tokenizer.chat_template)"


class _TemplateRaised(Exception):
    """raise_exception() was called by the template."""


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """A sandbox where reaching for an unsafe attribute is an error, not an empty string."""

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise SecurityError(f"access to attribute {attribute!r} of a "
                            f"{type(obj).__name__!r} object is not allowed")


class _GenerationBlock(Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` and renders the body."""

    tags = {"generation"}

    def parse(self, parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str = "") -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _make_environment() -> jinja2.Environment:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=["jinja2.ext.loopcontrols", _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENVIRONMENT = _make_environment()


class ChatTemplate:
    """A compiled chat template (or the plain format when `source` is None)."""

    def __init__(self, source: str | None, name: str = MODEL_TEMPLATE_NAME,
                 bos_token: str = "", eos_token: str = "", strip_bos: bool = False):
        """strip_bos: drop a leading bos_token from the result, because the tokenizer will add
        BOS itself (what llama.cpp does, so the prompt does not start with two)."""
        self.source = source
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.strip_bos = strip_bos
        self._template = None if source is None else self._compile(source)
        self._notice_given = False

    @classmethod
    def from_file(cls, path: str | Path, **kwargs) -> "ChatTemplate":
        """An override template read from a file."""
        try:
            source = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise MinillmError(f"cannot read chat template file {str(path)!r}: {exc}") from None
        return cls(source, name=f"chat template file {str(path)!r}", **kwargs)

    @classmethod
    def for_model(cls, tokenizer, override_path: str | Path | None = None) -> "ChatTemplate":
        """The template for a model: the override file if given, else the model's own (or the
        plain format). bos/eos texts come from the tokenizer."""
        kwargs = dict(bos_token=_token_text(tokenizer, tokenizer.bos_id),
                      eos_token=_token_text(tokenizer, tokenizer.eos_id),
                      strip_bos=tokenizer.add_bos)
        if override_path is not None:
            return cls.from_file(override_path, **kwargs)
        return cls(tokenizer.chat_template, **kwargs)

    @property
    def is_plain(self) -> bool:
        return self._template is None

    def _compile(self, source: str):
        try:
            return _ENVIRONMENT.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise MinillmError(f"{self.name} has a syntax error on line {exc.lineno}: "
                               f"{exc.message}") from None
        except Exception as exc:  # noqa: BLE001 - untrusted input, report every failure
            raise MinillmError(f"{self.name} cannot be compiled: {exc}") from None

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: list | None = None, **extra: Any) -> str:
        """The prompt text for `messages` (a list of {"role", "content"} dicts)."""
        messages = _checked_messages(messages)
        if self._template is None:
            self._give_plain_notice()
            return render_plain(messages, add_generation_prompt)
        context = dict(extra, messages=messages, add_generation_prompt=add_generation_prompt,
                       bos_token=self.bos_token, eos_token=self.eos_token, tools=tools)
        text = self._run(context)
        if self.strip_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return text

    def _run(self, context: dict[str, Any]) -> str:
        try:
            return self._template.render(**context)
        except SecurityError as exc:
            raise MinillmError(f"{self.name} was stopped by the sandbox: {exc}") from None
        except _TemplateRaised as exc:
            raise MinillmError(f"{self.name} refused the messages: {exc}") from None
        except jinja2.TemplateError as exc:
            raise MinillmError(f"{self.name} failed: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - untrusted input, report every failure
            raise MinillmError(f"{self.name} failed: {type(exc).__name__}: {exc}") from None

    def _give_plain_notice(self) -> None:
        if not self._notice_given:
            print("notice: the model has no chat template; using the plain "
                  "'User: ...' / 'Assistant:' format", file=sys.stderr)
            self._notice_given = True


def apply_chat_template(template_source: str | None, messages: Sequence[Mapping[str, Any]],
                        add_generation_prompt: bool = True, bos_token: str = "",
                        eos_token: str = "", tools: list | None = None,
                        name: str = MODEL_TEMPLATE_NAME, **extra: Any) -> str:
    """Render `messages` with a template source (None: the plain format)."""
    template = ChatTemplate(template_source, name=name, bos_token=bos_token, eos_token=eos_token)
    return template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                           **extra)


def render_plain(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
    """The plain format described in the module docstring."""
    lines = [f"{str(m['role']).title()}: {_content_text(m.get('content'))}\n" for m in messages]
    if add_generation_prompt:
        lines.append("Assistant:")
    return "".join(lines)


def _content_text(content: Any) -> str:
    """Message content as text; a list of parts keeps the text of its "text" parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return str(content)


def _checked_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise MinillmError("messages must be a list of {'role': ..., 'content': ...} objects")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise MinillmError(f"message {i} must be an object with a string 'role'")
        checked.append(dict(message))
    return checked


def _token_text(tokenizer, token_id: int | None) -> str:
    return "" if token_id is None else tokenizer.token_text(token_id)
