"""The OpenAI-compatible request bodies (plus diffar's own fields) and the error shape.

Only what diffar can honour is accepted: n must be 1, and the diffusion knobs are validated even
while the AR method ignores them, so a client learns about a typo at once.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

METHODS = ("ar", "dd2", "refusion")


class GenerationFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we don't use (user, logprobs...)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)
    seed: int | None = None
    # diffar's own
    method: str = "ar"
    top_k: int = Field(default=0, ge=0)
    steps: int | None = Field(default=None, ge=1)
    guidance_scale: float | None = Field(default=None, ge=0.0)
    preset: Literal["speed", "quality"] | None = None
    # Human-in-the-loop: output position -> a token id to keep, or text to put there (it may span tokens)
    fixed_tokens: dict[int, int | str] | None = None

    def stop_list(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stops if s)


class CompletionRequest(GenerationFields):
    prompt: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)

    def prompt_text(self, task: str) -> str:
        """diffar's models are not chat-tuned: a seq2seq model translates the last user message, a
        continuation model continues the conversation's text."""
        if task == "seq2seq":
            users = [m.content for m in self.messages if m.role == "user"]
            return users[-1] if users else ""
        return "\n".join(m.content for m in self.messages)


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
