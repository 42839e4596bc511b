"""Reranking: /v1/rerank (also /rerank, /v1/reranking, /reranking, as llama-server routes it) in
the shape Jina's, Cohere's and llama-server's clients send, and Text Embeddings Inference's
(`texts` in, a bare list out). A reranker scores each (query, document) pair; the score is the
model's raw output, best first, as llama-server reports it."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request as HttpRequest

from localrun.backends.base import Ranked
from localrun.pool import Pool
from localrun.server import display_name, resolve_model
from localrun.server.schemas import RerankRequest
from localrun.server.streams import pool_of, run_blocking
from localrun.store import ModelInfo

router = APIRouter()


def rank(pool: Pool, model: ModelInfo, query: str, documents: list[str]) -> Ranked:
    """The model's score of each document for the query, in the documents' order (blocking)."""
    with pool.use(model, None) as session:
        return session.rerank(query, documents)


@router.post("/v1/rerank")
@router.post("/rerank")
@router.post("/v1/reranking")
@router.post("/reranking")
async def rerank(body: RerankRequest, request: HttpRequest) -> Any:
    docs = body.docs()
    model = await asyncio.to_thread(resolve_model, body.model)
    pool = pool_of(request)
    result = await run_blocking(request, lambda: rank(pool, model, body.query, docs))
    name = display_name(model.name)
    request.state.log = {"model": name}
    order = result.order(body.top_n)
    if body.texts is not None:  # Text Embeddings Inference: a bare list
        return [{"index": i, "score": result.scores[i], **({"text": docs[i]} if body.return_text else {})}
                for i in order]
    results = [{"index": i, "relevance_score": result.scores[i],
                **({"document": {"text": docs[i]}} if body.return_documents else {})} for i in order]
    tokens = result.prompt_tokens
    return {"id": f"rerank-{uuid.uuid4().hex}", "object": "list", "model": name, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "meta": {"billed_units": {"search_units": 1}}}
