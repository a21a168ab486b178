"""The ``openai`` backend: any OpenAI-compatible chat-completions server.

A server that wants a key (``vllm serve --api-key``, a hosted endpoint) gets it as ``Authorization: Bearer``
from an environment variable (``OPENAI_API_KEY`` unless the config's ``api_key_env`` names another). The key
is never printed, logged or written: the config holds only the variable's name, and an error message that
would quote it (a server echoing the request) has it replaced by ``***``.
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qevolve_cli.errors import QevolveError
from qevolve_cli.react import STOP
from qevolve_cli.rollout.backends.base import Backend, Request, load_tokenizer


class OpenAIBackend(Backend):
    """An OpenAI-compatible chat-completions server (``POST {base_url}/chat/completions``)."""

    name = "openai"

    def __init__(self, base_url: str, model: str, policy: str | Path | None = None, api_key: str | None = None,
                 max_context: int = 0, max_new_tokens: int = 256, timeout_s: float = 120.0,
                 concurrency: int = 16, retries: int = 2, api_key_env: str = "OPENAI_API_KEY"):
        import httpx

        if not base_url:
            raise QevolveError("--base-url: required with --backend openai (e.g. http://127.0.0.1:8000/v1)")
        if not base_url.startswith(("http://", "https://")):
            raise QevolveError(f"--base-url {base_url}: expected an http:// or https:// URL")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.base_url = base_url
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.retries = retries
        self.concurrency = concurrency
        self.api_key_env = api_key_env
        self._key = api_key or ""
        self.tokenizer = None
        if policy is not None and (Path(policy) / "tokenizer_config.json").is_file():
            try:
                self.tokenizer = load_tokenizer(policy, require_chat_template=True)
            except QevolveError:
                self.tokenizer = None
        cfg_max = 0
        if policy is not None and (Path(policy) / "config.json").is_file():
            cfg_max = int(json.loads((Path(policy) / "config.json").read_text()).get("max_position_embeddings") or 0)
        self.max_context = int(max_context) if max_context and max_context > 0 else (cfg_max or 4096)
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.client = httpx.Client(timeout=timeout_s, headers=headers)

    def _one(self, r: Request, temperature: float, top_p: float, mnt: int) -> list[str]:
        import httpx

        body: dict[str, Any] = {
            "model": self.model, "messages": r.messages, "max_tokens": mnt, "n": r.n, "stop": [STOP],
            "temperature": max(temperature, 0.0), "seed": r.seed & 0x7FFFFFFF,
        }
        if temperature > 0 and top_p < 1.0:
            body["top_p"] = top_p
        last = ""
        for attempt in range(self.retries + 1):
            try:
                resp = self.client.post(self.url, json=body)
            except httpx.HTTPError as e:
                last = self._redact(f"no OpenAI-compatible server answers at {self.base_url} ({type(e).__name__}: {e})")
                time.sleep(0.5 * (attempt + 1))
                continue
            if resp.status_code >= 500:
                last = self._redact(f"server error {resp.status_code} from {self.url}: {_one_line(resp.text[:200])}")
                time.sleep(0.5 * (attempt + 1))
                continue
            if resp.status_code in (401, 403):  # the body is not quoted: servers echo the key they refused
                raise QevolveError(self._refused(resp.status_code))
            if resp.status_code != 200:
                raise QevolveError(self._redact(
                    f"--base-url {self.base_url}: HTTP {resp.status_code} from {self.url}: {_one_line(resp.text[:300])}"))
            try:
                data = resp.json()
                choices = sorted(data["choices"], key=lambda c: c.get("index", 0))
                texts = [(c["message"]["content"] or "").strip() for c in choices]
            except (ValueError, KeyError, TypeError) as e:
                raise QevolveError(f"--base-url {self.base_url}: malformed chat-completions answer ({type(e).__name__}: {e})") from None
            while len(texts) < r.n:  # servers that ignore n: ask again
                body1 = {**body, "n": 1, "seed": (body["seed"] + len(texts)) & 0x7FFFFFFF}
                texts.extend(self._one(Request(r.messages, body1["seed"], 1), temperature, top_p, mnt))
            return texts[: r.n]
        raise QevolveError(f"--base-url: {last}")

    def _refused(self, status: int) -> str:
        """The one line of a 401/403: the URL and the variable the key comes from (never the key)."""
        if self._key:
            why = f"the key in ${self.api_key_env} was refused (check it, or name another variable with --api-key-env)"
        else:
            why = (f"the server wants an API key and ${self.api_key_env} is not set: export {self.api_key_env}=... "
                   "(or name another variable with --api-key-env; docs/rollout.md)")
        return f"--base-url {self.base_url}: HTTP {status} from {self.url}: {why}"

    def _redact(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text

    def generate(self, requests: Sequence[Request], temperature: float, top_p: float = 1.0,
                 max_new_tokens: int | None = None) -> list[list[str]]:
        from concurrent.futures import ThreadPoolExecutor

        mnt = max_new_tokens or self.max_new_tokens
        if not requests:
            return []
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(requests))) as ex:
            return list(ex.map(lambda r: self._one(r, temperature, top_p, mnt), requests))

    def close(self) -> None:
        self.client.close()


def _one_line(text: str) -> str:
    """A server's answer as part of a one-line error message."""
    return " ".join(text.split())
