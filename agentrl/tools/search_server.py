"""A BM25 retrieval server over a local JSONL corpus (``agentrl serve-search``).

Corpus: one JSON object per line with ``text`` and optionally ``id`` and ``title``; the index is
built with ``bm25s`` at start-up (English stop words, no stemming: exact names matter).
``POST /retrieve`` ``{"queries": [...], "top_k": 3}`` answers one ranked list per query (passages
with score 0 left out); ``GET /health`` stays open. Bad requests get 400 ``{"error": ...}``.
A bearer token guards ``/retrieve`` when ``--token-env`` names one, with the engine's rules
(``agentrl.http_auth``). The server prints ``serving search on http://HOST:PORT`` once bound, so
``--port 0`` works for scripts and tests. See docs/tools.md.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

from agentrl.jsonl import loads, read_jsonl

MAX_TOP_K = 100
MAX_QUERIES = 256
SEARCH_TOKEN_ENV = "AGENTRL_SEARCH_TOKEN"  # the default of env.search_token_env


class BM25Index:
    """An in-memory BM25 index of passages; ``search`` is thread-safe."""

    def __init__(self, passages: list[dict[str, Any]]):
        import bm25s

        if not passages:
            raise ValueError("the corpus is empty")
        self.passages = [{"id": str(p.get("id", i)), "text": str(p["text"])} for i, p in enumerate(passages)]
        texts = [f"{p.get('title', '')} {p['text']}".strip() for p in passages]
        self._tokenizer = bm25s.tokenization.Tokenizer(stopwords="en")  # no stemmer (its default)
        tokens = self._tokenizer.tokenize(texts, return_as="tuple", show_progress=False)
        self._bm25 = bm25s.BM25()
        self._bm25.index(tokens, show_progress=False)
        self._lock = threading.Lock()  # the tokenizer's vocabulary lookups are not documented as thread-safe

    @classmethod
    def from_jsonl(cls, path: str | Path) -> BM25Index:
        return cls(load_corpus(path))

    def __len__(self) -> int:
        return len(self.passages)

    def search(self, queries: list[str], top_k: int = 3) -> list[list[dict[str, Any]]]:
        if not queries:
            return []
        k = max(1, min(top_k, len(self.passages)))
        with self._lock:
            ids = self._tokenizer.tokenize(list(queries), update_vocab=False, return_as="ids", show_progress=False)
            docs, scores = self._bm25.retrieve(
                ids,  # pyright: ignore[reportArgumentType]  # bm25s annotates str tokens; it takes ids as well
                k=k,
                show_progress=False,
                n_threads=1,
            )
        results = []
        for row_docs, row_scores in zip(docs.tolist(), scores.tolist()):
            results.append(
                [{**self.passages[d], "score": round(float(s), 4)} for d, s in zip(row_docs, row_scores) if s > 0]
            )
        return results


def load_corpus(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSONL corpus; each line needs a ``text`` string. Errors name the line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"corpus file not found: {p}")
    passages = []
    for lineno, obj in read_jsonl(p):
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise ValueError(f"{p}:{lineno} must be an object with a string 'text'")
        passages.append(obj)
    if not passages:
        raise ValueError(f"corpus {p} has no passages")
    return passages


def parse_request(body: Any) -> tuple[list[str], int]:
    """Validate a /retrieve body; raises ValueError with a message for the client."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object with 'queries' and optional 'top_k'")
    queries = body.get("queries")
    if isinstance(queries, str):
        queries = [queries]
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise ValueError("'queries' must be a list of strings")
    if len(queries) > MAX_QUERIES:
        raise ValueError(f"at most {MAX_QUERIES} queries per request")
    top_k = body.get("top_k", 3)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"'top_k' must be an integer from 1 to {MAX_TOP_K}")
    return queries, top_k


def create_app(index: BM25Index, token: str = ""):
    """The HTTP app; with ``token``, ``/retrieve`` needs ``Authorization: Bearer <token>``."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from agentrl.http_auth import BearerAuthMiddleware

    async def retrieve(request: Request) -> JSONResponse:
        try:
            queries, top_k = parse_request(loads(await request.body(), "the body"))
        except ValueError as e:  # the message names the field, or says why the body is not JSON
            return JSONResponse({"error": str(e)}, status_code=400)
        results = await run_in_threadpool(index.search, queries, top_k)
        return JSONResponse({"results": results})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "num_passages": len(index)})

    routes = [Route("/retrieve", retrieve, methods=["POST"]), Route("/health", health)]
    return Starlette(routes=routes, middleware=[Middleware(BearerAuthMiddleware, routes=routes, api_key=token)])


def serve(
    corpus: str | Path,
    host: str = "127.0.0.1",
    port: int = 8001,
    log_level: str = "warning",
    token_env: str = SEARCH_TOKEN_ENV,
) -> None:
    """Index ``corpus`` and serve it until interrupted (guarded by the token in ``token_env``, if set)."""
    import uvicorn

    from agentrl.secrets import read_secret

    token = read_secret(token_env)
    index = BM25Index.from_jsonl(corpus)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)  # connections made before uvicorn's loop starts wait in the backlog
    actual_port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(index, token), log_level=log_level, access_log=False)
    server = uvicorn.Server(config)
    guard = f"bearer token from ${token_env}" if token else "no token"
    print(f"serving search on http://{host}:{actual_port} ({len(index)} passages, {guard})", flush=True)
    server.run(sockets=[sock])
