"""The ``search`` tool: ranked passages from a BM25 index, over HTTP or in-process.

With ``url`` each call POSTs ``{"queries": [query], "top_k": k}`` to ``<url>/retrieve`` of an
``agentrl serve-search`` server; with ``index`` it searches a
:class:`~agentrl.tools.search_server.BM25Index` in a worker thread. The model sees numbered
passages or ``No results.``; HTTP failures raise and become error observations. A token in
``token_env`` (default ``AGENTRL_SEARCH_TOKEN``, or its ``_FILE``) is sent as a bearer token.
See docs/tools.md.
"""

from __future__ import annotations

from typing import Any

import trio

from agentrl.secrets import bearer, read_secret
from agentrl.tools.base import Tool
from agentrl.tools.search_server import SEARCH_TOKEN_ENV


class SearchTool(Tool):
    """Search the knowledge base; returns the most relevant passages.

    Args:
        query: what to look for, for example a name or a title.
    """

    name = "search"

    def __init__(
        self,
        url: str = "",
        *,
        index: Any = None,
        top_k: int = 3,
        request_timeout_s: float = 10.0,
        token_env: str = SEARCH_TOKEN_ENV,
    ):
        if bool(url) == (index is not None):
            raise ValueError("SearchTool needs exactly one of url (a search server) or index (a BM25Index)")
        self.url = url.rstrip("/")
        self._headers = bearer(read_secret(token_env)) if url else {}
        self.index = index
        self.top_k = top_k
        self.request_timeout_s = request_timeout_s

    async def run(self, query: str) -> str:
        if not query.strip():
            raise ValueError("the query is empty")
        if self.index is not None:
            results = await trio.to_thread.run_sync(self.index.search, [query], self.top_k)
        else:
            results = await self._remote([query])
        return format_passages(results[0])

    async def _remote(self, queries: list[str]) -> list[list[dict[str, Any]]]:
        import httpx

        async with httpx.AsyncClient(timeout=self.request_timeout_s, headers=self._headers) as client:
            response = await client.post(f"{self.url}/retrieve", json={"queries": queries, "top_k": self.top_k})
        if response.status_code != 200:
            raise RuntimeError(f"search server answered HTTP {response.status_code}: {response.text[:200]}")
        return response.json()["results"]


def format_passages(passages: list[dict[str, Any]]) -> str:
    if not passages:
        return "No results."
    return "\n".join(f"[{i}] {p['text']}" for i, p in enumerate(passages, 1))
