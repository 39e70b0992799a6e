"""The OpenAI API as this server speaks it: request bodies (pydantic), the fields refused or ignored,
the limits a request is checked against, and errors in OpenAI's shape.

Errors use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`:

    400  malformed JSON; max_tokens < 1 or above serve.max_tokens_limit; prompt + max_tokens beyond
         the context (code context_length_exceeded); empty prompt; n != 1; a batch of prompts; more than
         4 stop strings or an empty one; stream_options without stream; a field
         that would change the output and is not served (tools, logprobs, response_format, ...: code
         unsupported_parameter) or that no API here has (code unknown_parameter)
    404  a model other than the served one (code model_not_found); unknown routes
    422  well-formed JSON of the wrong shape (a missing field, a wrong type, temperature out of [0, 2])
    429  serve.max_queue requests already waiting (code queue_full, with Retry-After)
    503  shutting down (code shutting_down, with Retry-After): every request that arrives while the server
         drains, and in-flight ones aborted by a second Ctrl-C
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

RETRY_AFTER_S = 5  # the Retry-After of a 503: time for a restart, or for a balancer to pick another replica
RETRY_AFTER_BUSY_S = 1  # of a 429: the queue moves within a round or two


@dataclass(frozen=True)
class ApiLimits:
    model_name: str
    vocab_size: int  # prompt token ids must be below it
    max_seq_len: int  # KV slots per sequence: prompt + max_tokens + draft tokens must fit
    draft_tokens: int  # k: the verify of the last round writes k slots past the last token
    default_max_tokens: int
    max_tokens_limit: int
    default_temperature: float


# ------------------------------------------------------------------------------------------ protocol
class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


# Request fields beyond the ones modelled below: those that change nothing here are ignored, those
# that would change the output are refused (400 unsupported_parameter), any other is a typo or another
# API's field (400 unknown_parameter). Penalties of 0 are the default and change nothing.
IGNORED_FIELDS = {"user", "metadata", "store", "service_tier"}
UNSUPPORTED_FIELDS = {
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "response_format",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "best_of",
    "echo",
    "suffix",
    "presence_penalty",
    "frequency_penalty",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
}


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingRequest(_Body):
    model_config = ConfigDict(extra="allow")  # kept, to be refused or ignored by name (`extra_field_error`)
    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = Field(None, ge=-(2**63), le=2**64 - 1)  # what a torch generator takes
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens (fixed-length benchmarks)
    speculative: bool = True  # ours: false keeps no draft token (the output of the server without a draft)


class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[str], list[int]]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer"]
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: Optional[str] = None,
        code: Optional[str] = None,
        type_: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = (
            {"Retry-After": str(RETRY_AFTER_S if self.status == 503 else RETRY_AFTER_BUSY_S)}
            if self.status in (429, 503)
            else None
        )
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def shutting_down_error() -> ApiError:
    return ApiError(
        503,
        "the server is shutting down; retry on another replica or later",
        code="shutting_down",
        type_="server_error",
    )


def extra_field_error(extra: dict) -> Optional[ApiError]:
    """The 400 for the first request field this server does not serve (see IGNORED_FIELDS), or None."""
    for name, value in extra.items():
        if name in IGNORED_FIELDS or (name in ("presence_penalty", "frequency_penalty") and value in (0, None)):
            continue
        if name in UNSUPPORTED_FIELDS:
            return ApiError(
                400, f"{name}: not supported by this server (plain text generation)", name, "unsupported_parameter"
            )
        return ApiError(400, f"{name}: unknown parameter", name, "unknown_parameter")
    return None
