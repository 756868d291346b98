"""The console's REST API as one person's token sees it, and the refusals it answers in words."""
from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

ENV_URL, ENV_TOKEN = "FADEN_URL", "FADEN_TOKEN"
TIMEOUT_SECONDS = 30

# (method, url, headers, body) -> (status, body): urllib's by default; tests answer with the Django test client.
Send = Callable[[str, str, dict, bytes | None], tuple[int, bytes]]


class ClientError(Exception):
    """What went wrong, in one sentence for the terminal; ``code`` is the exit status. When the console
    refused: ``status`` its HTTP status, ``said`` its sentence, ``answer`` its whole JSON answer."""

    def __init__(self, message: str, code: int = 1, *, status: int = 0, said: str = "", answer: dict | None = None):
        super().__init__(message)
        self.message, self.code, self.status, self.said, self.answer = message, code, status, said, answer or {}


def urllib_send(method: str, url: str, headers: dict, body: bytes | None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:  # noqa: S310 (the URL is checked: http or https)
            return response.status, response.read()
    except urllib.error.HTTPError as answered:
        return answered.code, answered.read()
    except (urllib.error.URLError, OSError) as failed:
        reason = getattr(failed, "reason", failed)
        raise ClientError(f"Could not reach the console at {url.split('/api/')[0]}: {reason}.") from None


class Console:
    """The console's REST API, as one person's token sees it."""

    def __init__(self, url: str, token: str, *, send: Send = urllib_send):
        url = (url or "").strip().rstrip("/")
        if not url:
            raise ClientError(f"Give the console's URL: {ENV_URL}=https://console.example.com, or --url.", code=2)
        if urllib.parse.urlsplit(url).scheme not in ("http", "https") or not urllib.parse.urlsplit(url).netloc:
            raise ClientError(f"{url} is not the console's URL: it starts with http:// or https://.", code=2)
        if not token:
            raise ClientError(f"Give an API token: {ENV_TOKEN}=... (an Administrator makes one with faden drf_create_token "
                              f"USER), or --token.", code=2)
        self.url, self._token, self._send = url, token.strip(), send

    def request(self, method: str, path: str, body: dict | None = None) -> dict:
        """The answer's JSON; a refusal raises ClientError with the console's own sentence."""
        headers = {"Authorization": f"Token {self._token}", "Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = "application/json"
            data = json.dumps(body).encode()
        status, raw = self._send(method, f"{self.url}{path}", headers, data)
        try:
            answer = json.loads(raw or b"null")
        except ValueError:
            answer = None
        if status >= 400:
            said = refusal_sentence(answer)
            if said:
                raise ClientError(f"The console refused: {said}" if status != 401 else f"The console refused the token: {said}",
                                  status=status, said=said, answer=answer)
            raise ClientError(f"The console at {self.url} answered {status}: is {ENV_URL} the console's address?",
                              status=status)
        if not isinstance(answer, dict):
            raise ClientError(f"The console at {self.url} answered with something that is not its API's JSON: "
                              f"is {ENV_URL} the console's address?")
        return answer

    def cluster_named(self, name: str) -> dict:
        found = self.request("GET", f"/api/clusters/?{urllib.parse.urlencode({'name': name})}").get("results") or []
        cluster = next((c for c in found if isinstance(c, dict) and c.get("name") == name), None)
        if cluster is None:
            raise ClientError(f"There is no cluster named {name} on {self.url}.")
        return cluster

    def ssh_certificate(self, cluster_id: int, *, public_key: str, node: str | None) -> dict:
        body = {"public_key": public_key} | ({"node": node} if node is not None else {})
        return self.request("POST", f"/api/clusters/{int(cluster_id)}/ssh-certificates/", body)

    def nccl_test_start(self, cluster_id: int, *, confirm: bool) -> dict:
        return self.request("POST", f"/api/clusters/{int(cluster_id)}/tests/", {"confirm": bool(confirm)})

    def nccl_test(self, cluster_id: int, test_id: int) -> dict:
        return self.request("GET", f"/api/clusters/{int(cluster_id)}/tests/{int(test_id)}/")


def refusal_sentence(answer) -> str:
    """The console's own sentence in a refusal: ``message`` (the console's refusals), ``detail`` (DRF's
    and the NCCL test's), else the first message of a field (DRF's validation errors)."""
    if not isinstance(answer, dict):
        return ""
    for name in ("message", "detail"):
        if isinstance(answer.get(name), str) and answer[name]:
            return answer[name]
    for value in answer.values():
        first = value[0] if isinstance(value, list) and value else value
        if isinstance(first, str) and first:
            return first
    return ""
