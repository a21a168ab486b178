"""WebShop client against a small HTTP server (stdlib, in a thread) speaking the AgentGym protocol."""
from __future__ import annotations

import json
import socket
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from qevolve_cli.envs import act, list_tasks, make_env
from qevolve_cli.errors import QevolveError
from tests.conftest import send_json


class Shop:
    """A two-page shop: search -> results -> click item -> Buy Now (reward 0.75)."""

    def __init__(self):
        self.envs: dict[int, dict] = {}
        self.calls: list[str] = []

    def handle(self, method: str, path: str, query: dict, body):
        self.calls.append(f"{method} {path}")
        if path == "/" and method == "GET":
            return "ok"
        if path == "/create" and method == "POST":
            idx = 100 + len(self.envs)
            self.envs[idx] = {"page": "home", "session": None}
            return idx
        if path == "/reset":
            e = self.envs[body["env_idx"]]
            e.update(page="home", session=body["session_id"])
            return [self.obs(e), None]
        if path == "/instruction_text":
            e = self.envs[int(query["env_idx"][0])]
            return f"Instruction: buy item for session {e['session']}"
        if path == "/observation":
            return self.obs(self.envs[int(query["env_idx"][0])])
        if path == "/step":
            e = self.envs[body["env_idx"]]
            a = body["action"]
            if a.startswith("search[") and e["page"] == "home":
                e["page"] = "results"
            elif a == "click[B0001]" and e["page"] == "results":
                e["page"] = "item"
            elif a == "click[Buy Now]" and e["page"] == "item":
                return {"state": "Thank you for shopping with us!", "reward": 0.75, "done": True, "info": {}}
            else:
                return {"state": "Invalid action!", "reward": 0.0, "done": False, "info": {}}
            return {"state": self.obs(e), "reward": 0.0, "done": False, "info": None}
        if path == "/close":
            return {"closed": self.envs.pop(body["env_idx"], None) is not None}
        raise KeyError(path)

    @staticmethod
    def obs(e):
        return {"home": "WebShop [SEP] Instruction: [SEP] buy item [SEP] Search",
                "results": "[SEP] Back to Search [SEP] B0001 [SEP] Red shoes",
                "item": "[SEP] Red shoes [SEP] Buy Now"}[e["page"]]


@pytest.fixture
def server():
    shop = Shop()

    class H(BaseHTTPRequestHandler):
        def _go(self, method):
            u = urllib.parse.urlparse(self.path)
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n) or b"null") if n else None
            try:
                res, code = shop.handle(method, u.path, urllib.parse.parse_qs(u.query), body), 200
            except KeyError as e:
                res, code = {"detail": f"not found {e}"}, 404
            send_json(self, code, res)

        def do_GET(self):
            self._go("GET")

        def do_POST(self):
            self._go("POST")

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    th = threading.Thread(target=httpd.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", shop
    httpd.shutdown()
    httpd.server_close()


def test_episode_over_http(server):
    url, shop = server
    env = make_env("webshop", url=url)
    task = list_tasks("webshop", "test")[0]
    obs = env.reset(task)
    assert obs.startswith("WebShop [SEP]") and env.instruction == f"buy item for session {task.data['session']}"
    r1 = act(env, "Thought: search.\nAction: search[red shoes]")
    r2 = act(env, "Action: click[Nope]")
    r3 = act(env, "Thought: the first.\nAction: click[B0001]")
    r4 = act(env, "Thought: buy.\nAction: click[Buy Now]")
    assert r2.observation == "Invalid action!" and not r3.done
    assert [r.reward for r in (r1, r2, r3)] == [0.0, 0.0, 0.0] and r4.done and r4.reward == 0.75
    assert shop.calls[:3] == ["POST /create", "POST /reset", "GET /instruction_text"]
    env.close()
    assert shop.calls[-1] == "POST /close" and not shop.envs
    assert env.max_steps == 10


def test_step_limit_over_http(server):
    url, _ = server
    env = make_env("webshop", url=url, max_steps=2)
    env.reset(list_tasks("webshop", "train")[0])
    act(env, "Action: search[x]")
    r = act(env, "Action: click[nothing]")
    assert r.done and r.info["truncated"] and r.reward == 0.0


def test_no_server_is_one_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    env = make_env("webshop", url=f"http://127.0.0.1:{port}")
    with pytest.raises(QevolveError, match=rf"no WebShop server answers at http://127.0.0.1:{port}") as ei:
        env.reset(list_tasks("webshop", "test")[0])
    assert "\n" not in str(ei.value)


def test_protocol_error_is_named(server):
    url, _ = server
    env = make_env("webshop", url=url + "/wrong-prefix")
    with pytest.raises(QevolveError, match="POST /create failed with HTTP 404"):
        env.reset(list_tasks("webshop", "test")[0])
