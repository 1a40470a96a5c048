"""Helpers of the end-to-end tests (servers, requests); fixtures live in ``conftest.py``."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from sglang_dspark_plugin.serving import SGLangServer, tiny_model_args  # noqa: F401

MAX_TOKENS = 12
# Prompts of the per-configuration tests; all four are used by the concurrency test.
PROMPTS = [
    "The quick brown fox",
    "Once upon a time",
    "Write a short poem about the sea.",
    "Count with me: 1 2 3",
]
PER_CONFIG_PROMPTS = PROMPTS[:3]
STREAM_PROMPTS = PROMPTS[:2]
LOG_DIR = Path(os.environ.get("DSPARK_E2E_LOG_DIR", "/tmp/dspark-e2e-logs"))

# Every server this session started (for the no-orphan check and the timing summary).
STARTED: List["ServerRecord"] = []


@dataclass
class ServerRecord:
    name: str
    pgid: Optional[int] = None
    startup_s: Optional[float] = None
    lifetime_s: Optional[float] = None
    log: str = ""
    error: str = ""


def start_server(name: str, args: List[str], env: Optional[Dict[str, str]] = None) -> SGLangServer:
    """Start a server (raises ``ServerStartError``); the caller must ``stop()`` it."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    record = ServerRecord(name=name, log=str(LOG_DIR / f"{name}.log"))
    STARTED.append(record)
    log_path = Path(record.log)
    log_path.unlink(missing_ok=True)
    server = SGLangServer(args, env=env, log_path=log_path, name=f"e2e:{name}")
    server._record = record
    server._t0 = time.monotonic()
    try:
        server.start()
    except BaseException as exc:
        record.pgid = server.pgid
        record.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        server.stop()
        raise
    record.pgid = server.pgid
    record.startup_s = server.startup_seconds
    return server


def stop_server(server: SGLangServer) -> None:
    server.stop()
    record = getattr(server, "_record", None)
    if record is not None:
        record.lifetime_s = time.monotonic() - server._t0


# ----------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------


def openai_client(server: SGLangServer):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY", timeout=600, max_retries=0)


def model_name(server: SGLangServer) -> str:
    return server.get_json("/v1/models")["data"][0]["id"]


def generate(server: SGLangServer, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    return server.post_json(
        "/generate",
        {"text": prompt, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}},
    )


def completion(server: SGLangServer, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    resp = openai_client(server).completions.create(
        model=model_name(server), prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return {
        "text": resp.choices[0].text,
        "finish_reason": resp.choices[0].finish_reason,
        "completion_tokens": resp.usage.completion_tokens,
    }


def chat(server: SGLangServer, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    resp = openai_client(server).chat.completions.create(
        model=model_name(server),
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return {
        "text": resp.choices[0].message.content,
        "finish_reason": resp.choices[0].finish_reason,
        "completion_tokens": resp.usage.completion_tokens,
    }


def completion_stream(server: SGLangServer, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    stream = openai_client(server).completions.create(
        model=model_name(server), prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    pieces, finish, chunks = [], None, 0
    for chunk in stream:
        chunks += 1
        if chunk.choices:
            pieces.append(chunk.choices[0].text or "")
            finish = chunk.choices[0].finish_reason or finish
    return {"text": "".join(pieces), "finish_reason": finish, "chunks": chunks}


def chat_stream(server: SGLangServer, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    stream = openai_client(server).chat.completions.create(
        model=model_name(server),
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    pieces, finish, chunks = [], None, 0
    for chunk in stream:
        chunks += 1
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return {"text": "".join(pieces), "finish_reason": finish, "chunks": chunks}


def raw_post(server: SGLangServer, path: str, payload: dict, timeout: float = 300.0):
    """POST without raising on HTTP errors: returns (status, decoded body or text)."""
    req = urllib.request.Request(
        server.base_url + path,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, body = err.code, err.read()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode(errors="replace")




@dataclass
class Baseline:
    generate: Dict[str, dict] = field(default_factory=dict)  # prompt -> /generate response
    completion: Dict[str, dict] = field(default_factory=dict)
    chat: Dict[str, dict] = field(default_factory=dict)
