"""Chat rows as training tokens: a conversation rendered with its tokenizer's chat template, and a loss mask.

A row is `{"messages": [{"role": ..., "content": ...}, ...]}` (the OpenAI / HF format) or
`{"prompt": ..., "completion": ...}`, each a string (a user turn, an assistant turn) or a list of
messages. The template is Jinja, rendered as transformers renders it (a sandbox with its options,
filters and globals, the tokenizer's special tokens as variables), and the text is encoded without
adding special tokens, so the ids equal `AutoTokenizer.apply_chat_template(..., tokenize=True)`.

The mask marks the tokens the loss trains on (`data.loss_on`):
- `all`: every token;
- `assistant`: the assistant turns. A template with `{% generation %}` blocks marks them itself (as
  transformers' `return_assistant_tokens_mask` reads them); otherwise turn `i` is the text that
  rendering `messages[:i + 1]` adds to `messages[:i]` rendered with the generation prompt: its
  content and end-of-turn tokens, not the header that a prompt for it would already hold;
- `last_assistant`: the last assistant turn only.
A token is marked when its characters overlap a marked span.
"""

from __future__ import annotations

import contextvars
import json
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from podtrain.models.hf_read import read_json_object

ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_spans: contextvars.ContextVar[tuple[list, list] | None] = contextvars.ContextVar("generation_spans", default=None)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body and records where it lands."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

    def _track(self, caller):
        text = caller()
        tracking = _spans.get()
        if tracking is not None:  # the text rendered so far is the chunks yielded before this block
            chunks, spans = tracking
            start = sum(map(len, chunks))
            spans.append((start, start + len(text)))
        return text


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals |= {"raise_exception": _raise, "strftime_now": lambda fmt: datetime.now().strftime(fmt)}
    return env


class ChatTemplate:
    """A compiled chat template and the special tokens it sees as variables."""

    def __init__(self, source: str, special_tokens: dict[str, str], *, origin: str):
        self.source, self.origin = source, origin
        self.special_tokens = special_tokens
        self.tracks_generation = re.search(r"\{%-?\s*generation\s*-?%\}", source) is not None
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{origin}: not a valid Jinja chat template (line {e.lineno}: {e.message})") from None

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        return self._template.render(**self._variables(messages, add_generation_prompt))

    def render_tracked(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The text and the character spans of its `{% generation %}` blocks."""
        chunks, spans = [], []
        token = _spans.set((chunks, spans))
        try:
            for chunk in self._template.generate(**self._variables(messages, False)):
                chunks.append(chunk)
        finally:
            _spans.reset(token)
        return "".join(chunks), spans

    def _variables(self, messages: list[dict], add_generation_prompt: bool) -> dict:
        return dict(messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                    **self.special_tokens)


def load_chat_template(tokenizer: str, template_file: str | None) -> ChatTemplate:
    """The template of `data.chat_template` (a Jinja file) or else of the `data.tokenizer` directory
    (`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`), with the special tokens
    that tokenizer_config.json names.

    Raises:
        ValueError: naming the key, when there is no template or it is not valid Jinja.
    """
    directory = None if tokenizer == "byte" else (Path(tokenizer) if Path(tokenizer).is_dir()
                                                 else Path(tokenizer).parent)
    settings = _tokenizer_settings(directory)
    special = {key: _token_text(settings[key]) for key in _SPECIAL_TOKENS if _token_text(settings.get(key))}
    if template_file is not None:
        path = Path(template_file)
        if not path.is_file():
            raise ValueError(f"data.chat_template={template_file!r}: expected a Jinja template file, "
                             "found no such file")
        return ChatTemplate(path.read_text(encoding="utf-8"), special, origin=f"data.chat_template={template_file!r}")
    if directory is not None and (directory / "chat_template.jinja").is_file():
        path = directory / "chat_template.jinja"
        return ChatTemplate(path.read_text(encoding="utf-8"), special, origin=str(path))
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if not isinstance(template, str):
        where = "the byte tokenizer" if directory is None else f"{directory}'s tokenizer_config.json"
        raise ValueError(f"data.chat_template: data.source='chat' needs a chat template and "
                         f"data.tokenizer={tokenizer!r} has none in {where}; give one with data.chat_template=<file>")
    return ChatTemplate(template, special, origin=f"{directory / 'tokenizer_config.json'} chat_template")


def _tokenizer_settings(directory: Path | None) -> dict:
    path = None if directory is None else directory / "tokenizer_config.json"
    return read_json_object(path) if path is not None and path.is_file() else {}


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def conversation(row) -> list[dict]:
    """The messages of a chat row (`messages`, or `prompt` and `completion`); ValueError if it has none."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object with 'messages', or 'prompt' and 'completion', "
                         f"found {type(row).__name__}")
    if "messages" in row:
        messages = _messages(row["messages"], "messages")
    elif "prompt" in row and "completion" in row:
        messages = _messages(row["prompt"], "prompt", role="user") + _messages(row["completion"], "completion",
                                                                                role="assistant")
    else:
        raise ValueError(f"expected 'messages', or 'prompt' and 'completion', found keys {sorted(row)}")
    if not messages:
        raise ValueError("expected at least one message, found none")
    return messages


def _messages(value, key: str, role: str | None = None) -> list[dict]:
    if role is not None and isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list):
        kind = "a string or a list of messages" if role else "a list of messages"
        raise ValueError(f"'{key}' should be {kind}, found {type(value).__name__}")
    for k, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"'{key}'[{k}] should be an object with a string 'role', found {message!r:.80}")
        if message["role"] not in ROLES:
            raise ValueError(f"'{key}'[{k}]: expected a role among {list(ROLES)}, found {message['role']!r}")
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise ValueError(f"'{key}'[{k}] ({message['role']}): expected string 'content', "
                             f"found {type(content).__name__}")
    return [{name: item for name, item in message.items() if item is not None} for message in value]


def render(messages: list[dict], template: ChatTemplate, tokenizer, loss_on: str) -> tuple[np.ndarray, np.ndarray]:
    """(int32 ids, bool mask) of a conversation; ValueError when the template fails on it."""
    try:
        if loss_on == "all" or not template.tracks_generation:
            text = template.render(messages)
            spans = [(0, len(text))] if loss_on == "all" else _turn_spans(messages, template, text)
        else:
            text, spans = template.render_tracked(messages)
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template ({template.origin}) failed: {e}") from None
    if loss_on == "last_assistant":
        spans = spans[-1:]
    ids, offsets = tokenizer.encode_with_offsets(text)
    return ids, _mask(offsets, spans)


def chat_row(corpus: Sequence, i: int, template: ChatTemplate, tokenizer, loss_on: str
             ) -> tuple[np.ndarray, np.ndarray]:
    """(ids, loss mask) of chat row `i` of the corpus; ValueError naming the row's file and place."""
    try:
        return render(conversation(corpus[i]), template, tokenizer, loss_on)
    except ValueError as e:
        raise ValueError(f"{corpus.where(i)}: {e}") from None


def _turn_spans(messages: list[dict], template: ChatTemplate, text: str) -> list[tuple[int, int]]:
    """The character spans of the assistant turns, each what the turn adds to the prompt for it."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = template.render(messages[:i], add_generation_prompt=True)
        through = template.render(messages[: i + 1])
        if not (through.startswith(prompt) and text.startswith(through)):
            raise ValueError(
                f"the chat template ({template.origin}) does not render the conversation up to message {i} "
                "as the start of the whole, so its assistant turns cannot be found; use a template with "
                "{% generation %} blocks (data.chat_template) or data.loss_on=all")
        if len(through) > len(prompt):
            spans.append((len(prompt), len(through)))
    return spans


def _mask(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Tokens whose (start, end) character offsets overlap one of the spans."""
    mask = np.zeros(len(offsets), bool)
    for start, end in spans:
        mask |= (offsets[:, 1] > start) & (offsets[:, 0] < end)
    return mask
