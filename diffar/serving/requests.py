"""From an HTTP body to an engine `Request`, and from a finished request to the response's parts. What a
body's options mean is the generation method's business (`GenerationMethod.settings`); this module only
checks what belongs to the API: the model's name, the method, the prompt's room, best_of, pins."""

from __future__ import annotations

from diffar.errors import DiffarError
from diffar.generation import GenerationMethod, OptionError, Options
from diffar.serving.engine import Request, pieces
from diffar.serving.protocol import METHODS, ChatCompletionRequest, CompletionRequest, GenerationFields, error_body
from diffar.tokenizer import Tokenizer


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        self.status, self.body, self.headers = status, error_body(message, type_, code, param), headers


def options(body: GenerationFields) -> Options:
    return Options(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, steps=body.steps,
                   guidance_scale=body.guidance_scale, preset=body.preset, tau=body.tau, tau_min=body.tau_min,
                   best_of=body.best_of, domain=body.domain)


def is_chat_model(method: GenerationMethod) -> bool:
    """Whether the model answers chat requests through its own chat template (an imported chat model)."""
    return method.tokenizer.chat_template is not None and method.task == "continuation"


def prompt_ids(body: GenerationFields, method: GenerationMethod) -> list[int]:
    """The ids a body's model reads: a completion's prompt as text; a chat's messages rendered by the model's
    chat template, or, for a model without one, the text `ChatCompletionRequest.prompt_text` makes of them."""
    if isinstance(body, CompletionRequest):
        text, field = body.prompt, "prompt"
    elif not is_chat_model(method):
        text, field = body.prompt_text(method.task), "messages"
    else:
        return chat_ids(body, method)
    if not text.strip():
        raise APIError(400, "empty prompt", param=field)
    return method.prompt(text)


def chat_ids(body: ChatCompletionRequest, method: GenerationMethod) -> list[int]:
    """A chat's messages through the model's chat template, up to where the assistant's answer begins."""
    if not any(m.text.strip() for m in body.messages):
        raise APIError(400, "empty prompt", param="messages")
    if any(m.role == "tool" for m in body.messages):
        raise APIError(400, "role 'tool' is not supported: this server runs no tools", param="messages")
    try:  # OpenAI's "developer" role is its newer name for the system role
        return method.tokenizer.encode_chat([{"role": "system" if m.role == "developer" else m.role,
                                              "content": m.text} for m in body.messages])
    except DiffarError as e:  # the template refuses the conversation (roles must alternate, ...)
        raise APIError(400, str(e), param="messages") from None


def build_request(body: GenerationFields, method: GenerationMethod, model_id: str) -> Request:
    """The engine request for a body, or an APIError (4xx) saying what is wrong."""
    if body.model not in (None, model_id):
        raise APIError(404, f"model {body.model!r} does not exist; this server has {model_id!r}",
                       code="model_not_found", param="model")
    if body.method is not None and body.method not in METHODS:
        raise APIError(400, f"unknown method {body.method!r}; choose one of {', '.join(METHODS)}", param="method")
    if body.method not in (None, method.name):
        raise APIError(400, f"method {body.method!r} is not served here (serving: {method.name})", param="method")
    prompt_field = "prompt" if isinstance(body, CompletionRequest) else "messages"
    if body.best_of > 1 and "best_of" not in method.options:
        raise APIError(400, f"best_of > 1 applies to method dd2; this server decodes with {method.name}",
                       param="best_of")
    if body.domain is not None and "domain" not in method.options:
        raise APIError(400, f"domain applies to method refusion; this server decodes with {method.name}",
                       param="domain")
    if body.best_of > 1 and body.stream:
        raise APIError(400, "best_of > 1 cannot be streamed: one sample is kept once every sample is done",
                       param="best_of")
    try:
        sampling = method.settings(options(body))
    except OptionError as e:
        raise APIError(400, str(e), param=e.option) from None
    except DiffarError as e:
        raise APIError(400, str(e)) from None
    ids = prompt_ids(body, method)
    room = method.room(ids, sampling)
    if room <= 0:
        raise APIError(400, f"the prompt ({len(ids)} tokens) is too long for this model",
                       code="context_length_exceeded", param=prompt_field)
    max_tokens = body.token_budget or min(256, room)
    if max_tokens > room:
        raise APIError(400, f"max_tokens ({max_tokens}) exceeds the {room} new tokens this prompt leaves room for",
                       code="context_length_exceeded", param="max_tokens")
    return Request(ids, max_tokens, sampling, stop=body.stop_list(), seed=body.seed,
                   fixed=pins(body.fixed_tokens or {}, max_tokens, method.tokenizer), stream=body.stream)


def pins(fixed: dict[int, int | str], max_tokens: int, tokenizer: Tokenizer) -> dict[int, int]:
    """A body's `fixed_tokens` (position -> a token id, or text that may span tokens) as position -> token."""
    out: dict[int, int] = {}
    for pos, value in sorted(fixed.items()):
        ids = tokenizer.encode(value) if isinstance(value, str) else [value]
        if not ids or any(not 0 <= t < tokenizer.vocab_size for t in ids):
            raise APIError(400, f"fixed_tokens[{pos}] is not a token id or non-empty text", param="fixed_tokens")
        if pos < 0 or pos + len(ids) > max_tokens:
            raise APIError(400, f"fixed_tokens[{pos}] lies outside the {max_tokens} tokens generated",
                           param="fixed_tokens")
        if any(pos + j in out for j in range(len(ids))):
            raise APIError(400, f"fixed_tokens[{pos}] overlaps an earlier pin", param="fixed_tokens")
        out.update({pos + j: t for j, t in enumerate(ids)})
    return out


def choice(text: str, finish: str | None, chat: bool, stream: bool, first: bool = False) -> dict:
    """One `choices` entry in OpenAI's shape: a chat delta or message, or a completion's text."""
    if chat and stream:
        delta = {"content": text} | ({"role": "assistant"} if first else {})
        return {"index": 0, "delta": delta, "finish_reason": finish}
    if chat:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
    return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}


def summary(req: Request, method: GenerationMethod, latency: float) -> dict:
    """diffar's extension of a response: speed, the forward passes its batch took, and the tokens one by one
    (for pinning), each with who wrote it (`origins`: decoding/result.py)."""
    return {"method": method.name, "latency_ms": round(1000 * latency, 1),
            "tokens_per_s": round(len(req.tokens) / latency, 1) if latency > 0 else None,
            "passes": req.passes,
            "token_ids": req.tokens, "tokens": pieces(req.tokens, method.tokenizer), "origins": req.origins,
            "fixed_positions": sorted(req.fixed)}
