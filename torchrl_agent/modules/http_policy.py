"""An OpenAI-compatible HTTP endpoint as a rollout engine, for prompt-only baselines.

Only the standard library is used (``urllib.request`` + ``json``). One POST per prompt, up to
``max_concurrency`` in flight, each with a timeout and retries (connection errors, timeouts,
HTTP 408/429/5xx; other HTTP errors fail at once with the server's message).

Token ids:

- the prompt's ids are always the local tokenisation (:meth:`LLMPolicy.encode`) of the prompt text;
- the response's ids are the server's when it returns them (vLLM's ``return_token_ids``, sent by
  default through ``extra_body``, or ``token_id:N`` token strings from ``return_tokens_as_token_ids``);
  otherwise the local tokenisation of the returned text, which may differ from what the server
  sampled: the server's log-probs are kept when the two lengths agree, else they are NaN.

With ``api="chat"`` the prompt text is sent as one user message to ``/v1/chat/completions``: the
server applies its own chat template, so ``prompt_ids`` (local) are not what the model saw. Use
``api="completions"`` (the default) when the prompt already holds the chat template.

Images (a VLM's prompt-only baseline, ``images=True``, ``api="chat"`` only): the policy also reads
``pixels``; each prompt goes as one user message whose content is a list: the text before the
prompt's last ``<image>``, the frame as OpenAI image content (``{"type": "image_url", "image_url":
{"url": "data:image/png;base64,..."}}``, the uint8 frame as a PNG), the text after it. The server's
processor expands the image; ``prompt_ids`` stay the local tokenisation of the text.

API key: ``api_key`` is sent as ``Authorization: Bearer KEY`` (``torchrl-agent eval`` reads it
from the environment variable ``eval.api_key_env``, ``OPENAI_API_KEY`` by default, so it is never
in a config, a log or a file). A URL that carries credentials (``user:key@host`` or a query
parameter such as ``?api_key=``) is refused, with a message that does not repeat them: errors name
the URL, and a key inside it would be printed.

Bad replies: a body that is not UTF-8 is decoded with replacement characters, the reply's text is
cleaned to valid UTF-8 (lone surrogates become ``?``) before it is tokenised, and anything that is
not a completion (not JSON, no ``choices`` list, a non-string ``text``) is an
:class:`HTTPPolicyError` naming the URL and what was wrong. With ``on_error="truncate"`` such a
failure (after the retries) costs only its prompt: the generation comes back empty and flagged
``prompt_too_long`` (the collector ends that episode truncated), and the message is kept in
:attr:`HTTPPolicy.errors`.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import logging
import math
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from torchrl_agent.envs.base import IMAGE_PLACEHOLDER, clean_text
from torchrl_agent.modules.policy import Generation, LLMPolicy

__all__ = ["HTTPPolicy", "HTTPPolicyError", "VLLM_EXTRA_BODY", "image_content", "redact_credentials",
           "url_credentials"]

#: vLLM's extra request fields: response token ids, no BOS added to the prompt, no top-k.
VLLM_EXTRA_BODY = {"return_token_ids": True, "add_special_tokens": False, "top_k": 0}

_RETRY_STATUS = {408, 429, 500, 502, 503, 504}
_TOO_LONG_MARKERS = ("maximum context length", "context length", "too long", "prompt_too_long")

logger = logging.getLogger(__name__)


_SECRET_PARAMS = ("key", "token", "secret", "password", "auth", "sig")


def url_credentials(url: str) -> str | None:
    """Where ``url`` carries credentials (``"user:password@"``, ``"the query parameter 'api_key'"``),
    without their values; ``None`` when it carries none."""
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    if parts.username is not None or parts.password is not None:
        return "user:password@"
    for name, _ in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        if any(s in name.lower() for s in _SECRET_PARAMS):
            return f"the query parameter {name!r}"
    return None


_USERINFO = re.compile(r"(\w+://)[^/\s@]+@")
_SECRET_QUERY = re.compile(r"([?&][^=&\s]*(?:" + "|".join(_SECRET_PARAMS) + r")[^=&\s]*=)[^&\s'\"]+", re.IGNORECASE)


def redact_credentials(text: str) -> str:
    """``text`` with the credentials of every URL in it (``user:key@``, ``?api_key=...``) replaced
    by ``***``: for messages that quote what a user typed (a config parser's error)."""
    return _SECRET_QUERY.sub(r"\1***", _USERINFO.sub(r"\1***@", text))


def image_content(frame) -> dict:
    """OpenAI image content of a uint8 ``[H, W, 3]`` frame: a ``data:`` URL of its PNG."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(frame.numpy() if hasattr(frame, "numpy") else frame).save(buffer, format="PNG")
    return {"type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()}}


class HTTPPolicyError(RuntimeError):
    """The endpoint failed (after retries) or answered something that is not a completion."""


class HTTPPolicy(LLMPolicy):
    """Samples from an OpenAI-compatible server (``/v1/completions`` or ``/v1/chat/completions``).

    Args:
        base_url: the server root, e.g. ``http://127.0.0.1:8000`` (``/v1`` is appended when absent).
        tokenizer: the served model's tokenizer (prompt ids, and response ids when the server
            gives none).
        model: the ``model`` field of each request.
        api: ``"completions"`` (text prompt) or ``"chat"`` (the prompt as one user message).
        max_new_tokens, temperature, max_prompt_tokens: see :class:`LLMPolicy`. Prompts longer
            than ``max_prompt_tokens`` are not sent; a server's "context length" 400 error also
            marks the prompt ``prompt_too_long``.
        seed: request ``k`` (counted over the policy's life, reset by :meth:`set_seed`) sends
            ``seed + k``; ``None`` sends no seed.
        request_seeds: send the collector's ``request_seed`` of each step instead (a function of
            the collector's seed, the trajectory and the step, not of the order of requests): with
            a server that samples a seeded request independently of its batch (vLLM), sharded
            collectors (:class:`~torchrl_agent.collectors.RayStepCollector`) then get the
            single-process rows.
        timeout: seconds per HTTP attempt.
        retries: attempts after the first one, with ``backoff * 2**i`` seconds between them.
        max_concurrency: requests in flight at once.
        api_key: sent as ``Authorization: Bearer``; never logged (a URL holding a key is refused).
        extra_body: more request fields (default :data:`VLLM_EXTRA_BODY`; pass ``{}`` for servers
            that reject unknown fields).
        on_error: ``"raise"`` (default: :class:`HTTPPolicyError`) or ``"truncate"``: a failed
            request costs only its prompt (empty generation flagged ``prompt_too_long``), its
            message goes to :attr:`errors`.
        images: also read ``pixels`` ``[b, H, W, 3]`` and send each prompt's frame as image
            content in place of its last ``<image>`` (see the module notes; ``api="chat"``).
    """

    def __init__(self, base_url: str, tokenizer, *, model: str = "default", api: str = "completions",
                 seed: int | None = 0, timeout: float = 60.0, retries: int = 3, backoff: float = 0.5,
                 max_concurrency: int = 8, api_key: str | None = None, extra_body: dict | None = None,
                 on_error: str = "raise", request_seeds: bool = False, images: bool = False, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.accepts_request_seeds = request_seeds
        if images and api != "chat":
            raise ValueError("images=True sends the frames as chat image content: it needs api='chat'")
        self.images = images
        if images:
            self.in_keys = [*LLMPolicy.in_keys, "pixels"]
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        where = url_credentials(base_url)
        if where is not None:  # the URL is named in every error: it must hold no secret (not repeated here)
            raise ValueError(f"base_url carries credentials ({where}): pass the key as api_key (sent as "
                             "Authorization: Bearer), not in the URL")
        if api not in ("completions", "chat"):
            raise ValueError(f"api must be 'completions' or 'chat', got {api!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if on_error not in ("raise", "truncate"):
            raise ValueError(f"on_error must be 'raise' or 'truncate', got {on_error!r}")
        self.on_error = on_error
        self.errors: list[str] = []  # messages of the requests that failed (on_error="truncate")
        base = base_url.rstrip("/")
        base = base if base.endswith("/v1") else base + "/v1"
        self.url = base + ("/completions" if api == "completions" else "/chat/completions")
        self.model = model
        self.api = api
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.max_concurrency = max_concurrency
        self.api_key = api_key
        self.extra_body = dict(VLLM_EXTRA_BODY if extra_body is None else extra_body)
        self.set_seed(seed)

    def set_seed(self, seed: int | None) -> None:
        """Restart the per-request seed sequence at ``seed`` (``None``: no seed sent)."""
        if seed is not None and not isinstance(seed, int):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        self.seed = seed
        self._requests = 0

    def _generate_inputs(self, tensordict) -> dict:
        return {"images": tensordict.get("pixels")} if self.images else {}

    def generate(self, prompts: list[str], seeds: list[int] | None = None, images=None) -> list[Generation]:
        """One completion per prompt; ``seeds`` (one per prompt), when given, replace ``seed + k``;
        ``images`` (one uint8 ``[H, W, 3]`` frame per prompt) go as image content (``api="chat"``)."""
        if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompts must be a list of str")
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        if images is not None and (self.api != "chat" or len(images) != len(prompts)):
            raise ValueError(f"HTTPPolicy: images go with api='chat', one per prompt ({len(prompts)} prompts, "
                             f"{len(images)} images, api={self.api!r})")
        out = [Generation(ids) for ids in (self.encode(p) for p in prompts)]
        limit = self.max_prompt_tokens
        todo = []
        for i, g in enumerate(out):
            if limit is not None and len(g.prompt_ids) > limit:
                g.prompt_too_long = True
            else:
                if seeds is not None:
                    seed = int(seeds[i])
                else:
                    seed = None if self.seed is None else self.seed + self._requests
                self._requests += 1
                todo.append((i, seed))
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, max(1, len(todo)))) as pool:
            replies = list(pool.map(lambda job: self._request(prompts[job[0]], job[1], out[job[0]],
                                                              None if images is None else images[job[0]]), todo))
        for (i, _), reply in zip(todo, replies):
            if reply is None:
                out[i].prompt_too_long = True
        return out

    def _request(self, prompt: str, seed: int | None, g: Generation, frame=None) -> dict | None:
        """POST one prompt (with its frame) and fill ``g``; ``None`` when nothing was generated (too
        long, or a failure under ``on_error="truncate"``)."""
        try:
            reply = self._post(self._body(prompt, seed, frame))
            if reply is not None:
                self._fill(g, reply)
            return reply
        except HTTPPolicyError as err:
            if self.on_error == "raise":
                raise
            self.errors.append(str(err))
            logger.warning("%s: that episode ends truncated", err)
            g.response_ids, g.log_probs, g.text = [], [], ""
            return None

    def _body(self, prompt: str, seed: int | None, frame=None) -> dict:
        body = {"model": self.model, "max_tokens": self.max_new_tokens, "temperature": self.temperature,
                "top_p": 1.0}
        if self.api == "completions":
            body.update(prompt=prompt, logprobs=1)
        else:
            content = prompt
            if frame is not None:  # the text around the image's place, the frame in it
                head, found, tail = prompt.rpartition(IMAGE_PLACEHOLDER)
                head, tail = (head, tail) if found else (prompt, "")
                content = [*([{"type": "text", "text": head}] if head else []), image_content(frame),
                           *([{"type": "text", "text": tail}] if tail else [])]
            body.update(messages=[{"role": "user", "content": content}], logprobs=True)
        if seed is not None:
            body["seed"] = seed
        body.update(self.extra_body)
        return body

    def _post(self, body: dict) -> dict | None:
        """POST with retries; ``None`` when the server says the prompt is too long."""
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    body = response.read().decode("utf-8", "replace")
                try:
                    return json.loads(body)
                except json.JSONDecodeError:
                    last = f"the reply is not JSON: {body[:200]!r}"
                    continue
            except urllib.error.HTTPError as err:
                message = err.read().decode(errors="replace")[:2000]
                if err.code == 400 and any(m in message.lower() for m in _TOO_LONG_MARKERS):
                    return None
                last = f"HTTP {err.code}: {message}"
                if err.code not in _RETRY_STATUS:
                    break
            except (OSError, http.client.HTTPException) as err:  # URLError, refused, reset, timeout
                timed_out = isinstance(err, TimeoutError) or isinstance(getattr(err, "reason", None), TimeoutError)
                last = f"no answer within {self.timeout} s" if timed_out else f"{type(err).__name__}: {err}"
        raise HTTPPolicyError(f"HTTPPolicy: POST {self.url} failed after {attempt + 1} attempt(s): {last}")

    def _fill(self, g: Generation, reply: dict) -> None:
        """Read one completion into ``g``; :class:`HTTPPolicyError` naming the URL and the defect."""
        try:
            choice = reply["choices"][0]
            logprobs = choice.get("logprobs") or {}
            if self.api == "completions":
                text = choice["text"]
                tokens = logprobs.get("tokens") or []
                log_probs = logprobs.get("token_logprobs") or []
            else:
                text = choice["message"]["content"] or ""
                content = logprobs.get("content") or []
                tokens = [c["token"] for c in content]
                log_probs = [c["logprob"] for c in content]
            if not isinstance(text, str):
                raise TypeError(f"the completion's text is a {type(text).__name__}, not a string")
            text = clean_text(text)  # valid UTF-8 before tokenising (lone surrogates become '?')
            ids = choice.get("token_ids")
            if ids is None and tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
                ids = [int(t.split(":", 1)[1]) for t in tokens]
            from_server = ids is not None
            ids = [int(t) for t in ids] if from_server else self.encode(text)
            log_probs = [float(lp) for lp in log_probs]
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as err:
            raise HTTPPolicyError(f"HTTPPolicy: {self.url} answered no completion ({err!r}): "
                                  f"{clean_text(str(reply))[:500]}") from err
        g.response_ids = ids
        g.log_probs = log_probs if len(log_probs) == len(ids) else [math.nan] * len(ids)
        g.text = self.decode(ids) if from_server else text
