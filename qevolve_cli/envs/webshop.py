"""WebShop adapter: a client of a running WebShop env server over HTTP (AgentGym protocol).

WebShop needs its own server (product catalogue + search index), which is not installed
with qevolve. Start one (e.g. AgentGym's ``agentenv-webshop``: ``webshop --port 36001``)
and pass its URL (``make_env("webshop", url=...)``, or ``$QEVOLVE_WEBSHOP_URL``; default
``http://127.0.0.1:36001``). Protocol (JSON over HTTP):

=======  =====================================  ==========================================
GET      ``/``                                  ``"ok"`` (health)
POST     ``/create``                            ``env_idx`` (int)
POST     ``/reset`` ``{env_idx, session_id}``   ``[observation, null]``
GET      ``/instruction_text?env_idx=``         ``"Instruction: ..."``
POST     ``/step`` ``{env_idx, action}``        ``{state, reward, done, info}``
GET      ``/observation?env_idx=``              current observation text
POST     ``/close`` ``{env_idx}``               ``{closed}``
=======  =====================================  ==========================================

Tasks: ``webshop:<session_id>`` (ETO train 1824 / test 200 session ids). Reward: the
server's final reward (on ``click[Buy Now]``) clipped to [0, 1]. No built-in expert:
use ``qevolve import --format eto`` on ETO's WebShop SFT data. When no server answers,
every call raises one ``QevolveError`` line naming the URL.
"""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from qevolve_cli.envs.base import Env, Task
from qevolve_cli.errors import QevolveError

DEFAULT_MAX_STEPS = 10
DEFAULT_URL = "http://127.0.0.1:36001"


def webshop_url(url: str | None = None) -> str:
    return (url or os.environ.get("QEVOLVE_WEBSHOP_URL") or DEFAULT_URL).rstrip("/")


class WebShopClient:
    """Thin JSON-over-HTTP client of an AgentGym-style WebShop env server."""

    def __init__(self, url: str | None = None, timeout_s: float = 60.0):
        self.url = webshop_url(url)
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: dict | None = None, query: dict | None = None) -> Any:
        full = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        req = urllib.request.Request(full, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:200].decode(errors="replace").strip()
            raise QevolveError(f"webshop server {self.url}: {method} {path} failed with HTTP {e.code}"
                               + (f": {detail}" if detail else "")) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise QevolveError(f"webshop: no WebShop server answers at {self.url} ({reason}); start one "
                               "(e.g. AgentGym agentenv-webshop) and set QEVOLVE_WEBSHOP_URL") from None
        try:
            return json.loads(raw.decode() or "null")
        except ValueError:
            raise QevolveError(f"webshop server {self.url}: {method} {path} returned non-JSON: {raw[:80]!r}") from None

    def health(self) -> bool:
        return self._call("GET", "/") is not None

    def create(self) -> int:
        idx = self._call("POST", "/create")
        if isinstance(idx, dict):
            idx = idx.get("env_idx", idx.get("id"))
        if not isinstance(idx, int):
            raise QevolveError(f"webshop server {self.url}: /create returned {idx!r}, expected an env index")
        return idx

    def reset(self, env_idx: int, session_id: int | str) -> str:
        res = self._call("POST", "/reset", {"env_idx": env_idx, "session_id": session_id})
        if isinstance(res, list):
            res = res[0] if res else ""
        if isinstance(res, dict):
            res = res.get("observation", res.get("state", ""))
        if not isinstance(res, str) or not res:
            res = self.observation(env_idx)
        return res

    def instruction_text(self, env_idx: int) -> str:
        return str(self._call("GET", "/instruction_text", query={"env_idx": env_idx}) or "")

    def observation(self, env_idx: int) -> str:
        return str(self._call("GET", "/observation", query={"env_idx": env_idx}) or "")

    def step(self, env_idx: int, action: str) -> tuple[str, float, bool, dict]:
        res = self._call("POST", "/step", {"env_idx": env_idx, "action": action})
        if isinstance(res, list) and len(res) >= 3:
            res = {"state": res[0], "reward": res[1], "done": res[2], "info": res[3] if len(res) > 3 else {}}
        if not isinstance(res, dict) or "reward" not in res or "done" not in res:
            raise QevolveError(f"webshop server {self.url}: /step returned {str(res)[:80]!r}; "
                               "expected {state, reward, done, info}")
        obs = res.get("state", res.get("observation", ""))
        return str(obs), float(res.get("reward") or 0.0), bool(res.get("done")), dict(res.get("info") or {})

    def close(self, env_idx: int) -> None:
        self._call("POST", "/close", {"env_idx": env_idx})


class WebShopEnv(Env):
    name = "webshop"
    default_max_steps = DEFAULT_MAX_STEPS

    def __init__(self, max_steps: int | None = None, url: str | None = None, timeout_s: float = 60.0, **_: Any):
        super().__init__(max_steps)
        self.client = WebShopClient(url, timeout_s)
        self._idx: int | None = None

    def _reset(self, task: Task, with_expert: bool) -> tuple[str, str]:
        if self._idx is None:
            self._idx = self.client.create()
        session = task.data.get("session", task.task_id.split(":", 1)[-1])
        obs = self.client.reset(self._idx, session)
        instr = self.client.instruction_text(self._idx).strip()
        if instr.lower().startswith("instruction:"):
            instr = instr.split(":", 1)[1].strip()
        return instr, obs.strip()

    def _step(self, command: str) -> tuple[str, float, bool]:
        obs, reward, done, _info = self.client.step(self._idx, command)
        return obs.strip(), reward, done

    def close(self) -> None:
        if self._idx is not None:
            try:
                self.client.close(self._idx)
            except QevolveError:
                pass
            self._idx = None
