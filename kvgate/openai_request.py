"""OpenAI request bodies to what kvgate routes on: pure, shared by the gateway and the engine.

The routing key (DESIGN.md section 2) is raw bytes, never tokens:

* completions: the prompt as UTF-8 (a list of prompts routes on the first; a prompt given as
  token ids has no byte key and routes on load alone);
* chat: the messages rendered by the model's chat template when one is configured
  (:class:`ChatTemplate`, Jinja as in ``tokenizer_config.json``), else by the canonical rendering
  below, which kvgate's engine uses too, so gateway and engine agree byte for byte.

Canonical chat rendering (UTF-8)::

    [<|tools|>\\n{tools as sorted-key compact JSON}\\n]      only when the request has tools
    <|{role}|>\\n{text}\\n                                   one per message
    <|assistant|>\\n                                        the generation prompt

where ``text`` is a string content as is; a list of parts joined with no separator (a text part
as its text, an image part as ``<image:{url}>``, any other part as its sorted-key JSON); an
assistant message's ``tool_calls`` appended as sorted-key JSON. A message with a ``name`` renders
its role as ``{role}:{name}``.

Invalid bodies raise :class:`RequestError`, which carries the HTTP status and the OpenAI-style
``param`` so the caller can answer with a JSON error instead of failing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson

from kvgate.slo import Slo, SloError, parse_slo

SESSION_HEADER = "x-kvgate-session"
REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID = 128
MAX_CONTENT_PARTS = 10_000  # content parts in one chat request
KV_TRANSFER_PARAM = "kv_transfer_params"  # vLLM's field of a disaggregated request
_REQUEST_ID = re.compile(rf"[!-~]{{1,{MAX_REQUEST_ID}}}")
Endpoint = Literal["completions", "chat"]


class RequestError(ValueError):
    """A request kvgate cannot serve; maps to an OpenAI-style JSON error with ``status``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type_

    def to_body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True, slots=True)
class TraceHint:
    """Token counts a replayed trace states (body field ``kvgate``), used instead of estimates."""

    input_tokens: int | None = None
    output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """What the gateway routes on and the engine schedules by; the body itself is untouched."""

    endpoint: Endpoint
    model: str
    key: bytes
    stream: bool
    include_usage: bool
    max_tokens: int | None
    slo: Slo
    slo_stated: bool
    session: str | None
    hint: TraceHint


def client_request_id(value: str | None) -> str | None:
    """The client's ``x-request-id`` if it is a sane token (1 to 128 printable ASCII
    characters, no space), else None: the caller makes its own. An id goes into engines'
    events, output text, logs and answer headers; an odd byte in it (a header is any bytes)
    must cost nothing there, so it is replaced rather than carried."""
    if value is None or _REQUEST_ID.fullmatch(value) is None:
        return None
    return value


def _dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError as exc:  # (orjson writes at most 254 levels; it reads 1,024)
        raise RequestError(f"a value nested too deeply: {exc}") from None


def _part_bytes(part: Any) -> bytes:
    if isinstance(part, Mapping):
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            return part["text"].encode()
        if kind == "image_url":
            img = part.get("image_url")
            url = img.get("url") if isinstance(img, Mapping) else img
            if isinstance(url, str):
                return b"<image:" + url.encode() + b">"
    if isinstance(part, str):
        return part.encode()
    return _dumps(part)


def canonical_chat_bytes(messages: list, tools: list | None = None) -> bytes:
    """The canonical rendering described in the module docstring."""
    out: list[bytes] = []
    if tools:
        out.append(b"<|tools|>\n" + _dumps(tools) + b"\n")
    for msg in messages:
        role = str(msg.get("role", ""))
        name = msg.get("name")
        if isinstance(name, str) and name:
            role = f"{role}:{name}"
        content = msg.get("content")
        if content is None:
            text = b""
        elif isinstance(content, str):
            text = content.encode()
        elif isinstance(content, list):
            text = b"".join(_part_bytes(p) for p in content)
        else:
            text = _dumps(content)
        if msg.get("tool_calls"):
            text += _dumps(msg["tool_calls"])
        out.append(b"<|" + role.encode() + b"|>\n" + text + b"\n")
    out.append(b"<|assistant|>\n")
    return b"".join(out)


class ChatTemplate:
    """A model's Jinja chat template, rendered as Hugging Face and vLLM render it."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise RequestError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda v, indent=None: orjson.dumps(v).decode()
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"invalid chat template: {exc}") from exc
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ChatTemplate:
        """Load ``chat_template.jinja`` or ``tokenizer_config.json``'s template from a model."""
        folder = Path(path)
        cfg: dict = {}
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.exists():
            cfg = orjson.loads(cfg_path.read_bytes())
        source = None
        if (folder / "chat_template.jinja").exists():
            source = (folder / "chat_template.jinja").read_text()
        elif isinstance(cfg.get("chat_template"), str):
            source = cfg["chat_template"]
        if source is None:
            raise ValueError(f"{folder}: no chat_template.jinja or tokenizer_config chat_template")

        def token(name: str) -> str:
            t = cfg.get(name) or ""
            return t.get("content", "") if isinstance(t, Mapping) else str(t)

        return cls(source, bos_token=token("bos_token"), eos_token=token("eos_token"))

    @classmethod
    def from_path(cls, path: str | Path) -> ChatTemplate:
        """A model folder, or a bare ``.jinja`` file."""
        p = Path(path)
        if p.is_dir():
            return cls.from_model_dir(p)
        return cls(p.read_text())

    def render(self, messages: list, tools: list | None = None) -> str:
        """The prompt text the engine will prefill, with the generation prompt appended."""
        import jinja2

        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except RequestError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, AttributeError) as exc:
            raise RequestError(f"chat template failed on these messages: {exc}") from exc


def chat_key(messages: list, tools: list | None, template: ChatTemplate | None) -> bytes:
    """Routing key of a chat request: the template's rendering, else the canonical one."""
    if template is not None:
        return template.render(messages, tools).encode()
    return canonical_chat_bytes(messages, tools)


def completion_key(prompt: Any) -> bytes:
    """Routing key of a completion prompt (see the module docstring)."""
    if isinstance(prompt, str):
        return prompt.encode()
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0].encode()
    return b""


def _opt_int(body: Mapping, name: str, *, minimum: int = 1) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise RequestError(f"'{name}' must be an integer >= {minimum}", param=name)
    return v


def _validate_messages(messages: Any) -> list:
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty array", param="messages")
    parts = 0
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise RequestError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise RequestError(f"messages[{i}].role must be a string", param=f"messages[{i}].role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(
                f"messages[{i}].content must be a string or an array of parts",
                param=f"messages[{i}].content",
            )
        if isinstance(content, list):
            # each part is rendered for the routing key on the event loop: millions of them
            # in a body under the size limit held every other client for a minute
            parts += len(content)
            if parts > MAX_CONTENT_PARTS:
                raise RequestError(
                    f"at most {MAX_CONTENT_PARTS} content parts in a request",
                    param=f"messages[{i}].content",
                )
            for j, part in enumerate(content):
                if not isinstance(part, (str, Mapping)):
                    raise RequestError(
                        f"messages[{i}].content[{j}] must be a content part (an object)",
                        param=f"messages[{i}].content[{j}]",
                    )
    return messages


def _token_ids(value: Any) -> bool:
    """A non-empty array of token ids (integers >= 0; a JSON true is no token id)."""
    return isinstance(value, list) and bool(value) and all(type(t) is int and t >= 0 for t in value)


def _validate_prompt(prompt: Any) -> None:
    ok = isinstance(prompt, str) or (
        isinstance(prompt, list)
        and prompt
        and (
            all(isinstance(p, str) for p in prompt)
            or _token_ids(prompt)
            or all(_token_ids(p) for p in prompt)
        )
    )
    if not ok:
        raise RequestError(
            "'prompt' must be a string, an array of strings, an array of token ids or an array "
            "of non-empty arrays of token ids",
            param="prompt",
        )


def _opt_range(body: Mapping, name: str, low: float, high: float) -> None:
    """A sampling number OpenAI bounds (it answers 400 outside them): absent, null, or a
    finite number within [low, high]."""
    v = body.get(name)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high:
        raise RequestError(f"'{name}' must be a number from {low:g} to {high:g}", param=name)


def _validate_stop(stop: Any) -> None:
    if stop is None or isinstance(stop, str):
        return
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError("'stop' must be a string or an array of strings", param="stop")


def _hint(body: Mapping) -> TraceHint:
    raw = body.get("kvgate")
    if raw is None:
        return TraceHint()
    if not isinstance(raw, Mapping):
        raise RequestError("'kvgate' must be an object", param="kvgate")
    vals = {}
    for name in ("input_tokens", "output_tokens"):
        v = raw.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise RequestError(f"kvgate.{name} must be an integer >= 1", param=f"kvgate.{name}")
        vals[name] = v
    return TraceHint(**vals)


def parse_request(
    endpoint: Endpoint,
    body: Any,
    headers: Mapping[str, str],
    *,
    template: ChatTemplate | None = None,
    default_slo: Slo | None = None,
) -> ParsedRequest:
    """Validate an OpenAI body and derive its routing key and SLO; raises RequestError."""
    if not isinstance(body, Mapping):
        raise RequestError("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("'model' must be a non-empty string", param="model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", param="stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, Mapping):
        raise RequestError("'stream_options' must be an object", param="stream_options")
    include_usage = bool(opts and opts.get("include_usage"))
    n = _opt_int(body, "n")
    if n is not None and n != 1:
        raise RequestError("only n=1 is supported", param="n")
    _opt_range(body, "temperature", 0.0, 2.0)
    _opt_range(body, "top_p", 0.0, 1.0)
    _validate_stop(body.get("stop"))
    if endpoint == "chat":
        messages = _validate_messages(body.get("messages"))
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError("'tools' must be an array", param="tools")
        key = chat_key(messages, tools, template)
        max_tokens = _opt_int(body, "max_completion_tokens") or _opt_int(body, "max_tokens")
    else:
        if "prompt" not in body:
            raise RequestError("'prompt' is required", param="prompt")
        _validate_prompt(body["prompt"])
        key = completion_key(body["prompt"])
        max_tokens = _opt_int(body, "max_tokens")
    try:
        slo, stated = parse_slo(headers, body, default_slo)
    except SloError as exc:
        raise RequestError(str(exc), param=exc.param) from exc
    session = headers.get(SESSION_HEADER)
    if session is None and isinstance(body.get("user"), str) and body["user"]:
        session = body["user"]
    return ParsedRequest(
        endpoint=endpoint,
        model=model,
        key=key,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        slo=slo,
        slo_stated=stated,
        session=session,
        hint=_hint(body),
    )
