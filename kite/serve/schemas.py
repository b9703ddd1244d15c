"""Request bodies: OpenAI's completion and chat shapes plus KITE's `kite` field."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# OpenAI clients send fields KITE does not use (user, logprobs, ...): ignore them.
_OPEN = ConfigDict(extra="ignore", allow_inf_nan=False)    # NaN and inf: "should be a finite number"
_CLOSED = ConfigDict(extra="forbid", allow_inf_nan=False)


class KiteOptions(BaseModel):
    """`{"state": "<id>"}` answers against a stored state; `{"document": "<text>"}` upcycles the
    document first (stored under a content id, reused when sent again), then answers."""

    model_config = _CLOSED
    state: str | None = None
    document: str | None = Field(None, min_length=1)
    name: str | None = Field(None, max_length=256)  # the document's name, kept in the state

    @model_validator(mode="after")
    def _one(self):
        if (self.state is None) == (self.document is None):
            raise ValueError("give exactly one of kite.state and kite.document")
        return self


class _Generation(BaseModel):
    model_config = _OPEN
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: Literal[1] = 1
    kite: KiteOptions | None = None

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s]


class CompletionRequest(_Generation):
    prompt: str | list[str]

    @property
    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ValueError("prompt: one prompt per request")
        return self.prompt[0]


class TextPart(BaseModel):
    model_config = _OPEN
    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    model_config = _OPEN
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)

    @property
    def query(self) -> str:
        """What YOCO reads the intent of: the last user message."""
        for m in reversed(self.messages):
            if m.role == "user":
                return m.text
        return self.messages[-1].text

    def template_messages(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in self.messages]


class StateUpload(BaseModel):
    model_config = _CLOSED
    document: str = Field(min_length=1)
    id: str | None = None
    name: str | None = Field(None, max_length=256)
    overwrite: bool = False


class ReloadRequest(BaseModel):
    model_config = _CLOSED
    path: str | None = None  # a file inside the rules folder; default: the active file


class SwitchRequest(BaseModel):
    model_config = _CLOSED
    version: str = Field(min_length=1, max_length=64)
