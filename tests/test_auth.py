"""Access control (API_KEY) and secrets hygiene, against real server processes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import SERVER_STAGES, Server, run_server
from fastapi import FastAPI

from common.auth import install_auth, parse_keys
from common.settings import Settings
from loadtests.procs import redis_server

KEYS = ("sk-alpha-7f3e9c1d", "sk-beta-42aa0b6e")
WRONG_KEY = "sk-gamma-wrong-5d1c"
REDIS_PASSWORD = "r3dis-pw-9b8e7f"
LATEST = SERVER_STAGES[-1]
BODY = {"inputs": ["hello world", "bonjour"]}


def _assert_openai_error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"type", "message", "param", "code"}
    assert error["code"] == status
    return dict(error)


@pytest.fixture(scope="module")
def protected(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {"API_KEY": f"{KEYS[0]}, {KEYS[1]}"}
    with run_server(LATEST, tmp_path_factory.mktemp("auth"), env) as server:
        yield server


@pytest.mark.parametrize("path", ["/v1/embed", "/v1/embeddings"])
def test_missing_key_is_401(protected: Server, path: str) -> None:
    response = httpx.post(protected.url + path, json={"input": "x", "inputs": "x"})
    error = _assert_openai_error(response, 401)
    assert error["type"] == "authentication_error"
    assert response.headers["www-authenticate"].startswith("Bearer")


@pytest.mark.parametrize(
    "header",
    [
        f"Bearer {WRONG_KEY}",
        f"Basic {KEYS[0]}",
        "Bearer",
        KEYS[0],
        f"Bearer {KEYS[0]}x",
        f"Bearer {KEYS[0][:-1]}",
        f"Bearer {KEYS[0]},{KEYS[1]}",
    ],
)
def test_wrong_key_is_401(protected: Server, header: str) -> None:
    response = httpx.post(protected.url + "/v1/embed", json=BODY, headers={"Authorization": header})
    error = _assert_openai_error(response, 401)
    # The answer never echoes what was presented.
    assert WRONG_KEY not in response.text and KEYS[0] not in response.text
    assert error["type"] == "authentication_error"


@pytest.mark.parametrize("key", KEYS)
def test_every_configured_key_works(protected: Server, key: str) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    response = httpx.post(protected.url + "/v1/embed", json=BODY, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    assert len(response.json()["embeddings"]) == 2
    # The scheme is case-insensitive (RFC 7235).
    response = httpx.post(
        protected.url + "/v1/embeddings", json={"input": "hi"}, headers={"Authorization": f"bearer {key}"}
    )
    assert response.status_code == 200, response.text
    assert httpx.get(protected.url + "/v1/models", headers=headers).status_code == 200


def test_every_v1_route_is_protected(protected: Server) -> None:
    openapi = httpx.get(protected.url + "/openapi.json").json()
    v1 = [(p, m) for p, ops in openapi["paths"].items() if p.startswith("/v1") for m in ops]
    assert ("/v1/embed", "post") in v1 and ("/v1/models", "get") in v1
    for path, method in v1:
        response = httpx.request(method.upper(), protected.url + path)
        _assert_openai_error(response, 401)
    # Unknown /v1 paths too: no route discovery without a key.
    _assert_openai_error(httpx.get(protected.url + "/v1/no-such-route"), 401)


def test_health_and_ready_stay_open(protected: Server) -> None:
    assert httpx.get(protected.url + "/health").status_code == 200
    assert httpx.get(protected.url + "/ready").status_code == 200


def test_metrics_protected_by_default(protected: Server) -> None:
    for path in ("/metrics", "/dashboard"):
        _assert_openai_error(httpx.get(protected.url + path), 401)
        # With a key the request goes through to whatever the stage serves there.
        response = httpx.get(protected.url + path, headers={"Authorization": f"Bearer {KEYS[1]}"})
        assert response.status_code in (200, 404)


def test_unauthenticated_upload_is_not_read(protected: Server) -> None:
    """A 50 MB body without a key gets 401 before the server reads it."""

    def chunks() -> Iterator[bytes]:
        yield b'{"inputs": "'
        for _ in range(50):
            yield b"a" * 2**20

    response = httpx.post(protected.url + "/v1/embed", content=chunks(), timeout=30)
    _assert_openai_error(response, 401)
    assert httpx.get(protected.url + "/health").status_code == 200


def test_metrics_can_be_left_open(tmp_path: Path) -> None:
    env = {"API_KEY": KEYS[0], "PROTECT_METRICS": "false"}
    with run_server(LATEST, tmp_path, env) as server:
        for path in ("/metrics", "/dashboard"):
            assert httpx.get(server.url + path).status_code in (200, 404)
        _assert_openai_error(httpx.post(server.url + "/v1/embed", json=BODY), 401)


# --- secrets never leak -----------------------------------------------------------
@pytest.mark.parametrize("stage", SERVER_STAGES)
def test_secrets_never_appear_in_logs_or_answers(stage: str, tmp_path: Path) -> None:
    """Keys and the Redis password stay out of every answer and every log line, errors included."""
    secrets = [*KEYS, WRONG_KEY, REDIS_PASSWORD]
    with redis_server(password=REDIS_PASSWORD) as redis:
        env = {"API_KEY": ",".join(KEYS), "CACHE_URL": redis.url, "LOG_LEVEL": "DEBUG"}
        with run_server(stage, tmp_path, env) as server:
            good = {"Authorization": f"Bearer {KEYS[0]}"}
            bad = {"Authorization": f"Bearer {WRONG_KEY}"}
            answers: list[httpx.Response] = []
            with httpx.Client(base_url=server.url, timeout=30) as client:
                for headers in (good, bad, {}):
                    answers.append(client.post("/v1/embed", json=BODY, headers=headers))
                    answers.append(client.post("/v1/embed", content=b"{not json", headers=headers))
                    answers.append(client.post("/v1/embeddings", json={"input": 3}, headers=headers))
                    for path in (
                        "/v1/models",
                        "/v1/batcher/config",
                        "/metrics",
                        "/dashboard",
                        "/openapi.json",
                        "/health",
                        "/ready",
                    ):
                        answers.append(client.get(path, headers=headers))
                assert answers[0].status_code == 200
                # Redis dies: the cache tier fails open and logs why; the log must still hold no password.
                redis.stop()
                for i in range(3):
                    response = client.post(
                        "/v1/embed", json={"inputs": f"after redis died {i}"}, headers=good
                    )
                    assert response.status_code == 200, response.text
                    answers.append(response)
        log = server.log()  # read after the server stopped: shutdown lines included
    for secret in secrets:
        for response in answers:
            assert secret not in response.text, f"{secret!r} in {response.request.url}: {response.text[:300]}"
            assert all(secret not in v for v in response.headers.values())
        assert secret not in log, f"{secret!r} appears in the {stage} log"
    assert "Application startup complete" in log  # the grep ran over a real log, not an empty file


# --- the middleware's own rules -----------------------------------------------------
def test_parse_keys_drops_blanks_and_spaces() -> None:
    assert parse_keys(" a , b,,") == [hashlib.sha256(b"a").digest(), hashlib.sha256(b"b").digest()]
    assert parse_keys(" , ") == []


def test_api_key_of_only_commas_is_refused() -> None:
    with pytest.raises(ValueError, match="API_KEY holds no key"):
        install_auth(FastAPI(), Settings.model_validate({"api_key": ",,"}))


def test_blank_api_key_means_no_access_control() -> None:
    app = FastAPI()
    install_auth(app, Settings.model_validate({"api_key": "  "}))
    assert not app.user_middleware
    install_auth(app, Settings.model_validate({"api_key": "k"}))
    assert len(app.user_middleware) == 1
