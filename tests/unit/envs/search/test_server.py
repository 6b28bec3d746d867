"""The retriever server over real HTTP on a free loopback port: Search-R1's request/response shapes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from agentrl.envs.search.client import RetrieverClient, RetrieverError, format_passages
from agentrl.envs.search.retriever import BM25Retriever
from agentrl.envs.search.server import RetrievalService, RetrieverServer
from tests.conftest import find_free_port

DOCS = [
    {"id": "0", "contents": '"Quorvel Guild"\nThe Quorvel Guild was founded by Dravo Kelmir in 1811.'},
    {"id": "1", "contents": '"Dravo Kelmir"\nDravo Kelmir was a luthier born in Sulketra.'},
    {"id": "2", "contents": '"Sulketra"\nSulketra is a small town known for its orchards.'},
    {"id": "3", "contents": '"Orchards"\nOrchards of Sulketra grow pears.'},
]


@pytest.fixture
def retriever(tmp_path: Path) -> BM25Retriever:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    return BM25Retriever(path)


@pytest.fixture
async def url(retriever: BM25Retriever, free_port: int):
    server = RetrieverServer(retriever, default_topk=2)
    base = await server.start(free_port)
    yield base
    await server.stop()


async def _post(url: str, body) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        async with session.post(f"{url}/retrieve", data=data) as r:
            return r.status, await r.json()


async def test_search_r1_request_with_scores(url: str) -> None:
    status, body = await _post(
        url,
        {"queries": ["who founded the Quorvel Guild", "Sulketra orchards"], "topk": 3, "return_scores": True},
    )
    assert status == 200 and len(body["result"]) == 2
    first = body["result"][0]
    assert first[0]["document"] == DOCS[0] and isinstance(first[0]["score"], float)
    assert [h["score"] for h in first] == sorted((h["score"] for h in first), reverse=True)
    assert {h["document"]["id"] for h in body["result"][1]} >= {"2", "3"}
    assert all(len(row) <= 3 for row in body["result"])


async def test_without_scores_and_default_topk(url: str) -> None:
    status, body = await _post(url, {"queries": ["Sulketra"]})  # no topk: the server's default (2)
    assert status == 200
    row = body["result"][0]
    assert len(row) == 2 and all(set(doc) == {"id", "contents"} for doc in row)
    status, body = await _post(url, {"queries": ["Sulketra"], "topk": None, "return_scores": False})
    assert status == 200 and len(body["result"][0]) == 2
    status, body = await _post(url, {"queries": []})
    assert status == 200 and body == {"result": []}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("{not json", "not JSON"),
        (["q"], "JSON object"),
        ({"query": "q"}, "unknown fields"),
        ({"queries": "q"}, "list of strings"),
        ({"queries": [1, 2]}, "list of strings"),
        ({"queries": ["q"], "topk": -1}, "topk"),
        ({"queries": ["q"], "topk": "3"}, "topk"),
        ({"queries": ["q"], "topk": 1000}, "topk"),
        ({"queries": ["q"], "return_scores": "yes"}, "return_scores"),
        ({"queries": ["q"] * 600}, "at most 512"),
    ],
)
async def test_bad_requests_get_400_and_the_server_keeps_serving(url: str, body, message: str) -> None:
    status, answer = await _post(url, body)
    assert status == 400 and message in answer["error"]
    status, answer = await _post(url, {"queries": ["Dravo Kelmir"], "topk": 1})
    assert status == 200 and answer["result"][0][0]["id"] == "1"


class Recording(BM25Retriever):
    """A retriever that records each batch it is asked, and fails on the query "boom"."""

    calls: list[list[str]]

    def search(self, queries, topk):
        self.calls = [*getattr(self, "calls", []), list(queries)]
        if "boom" in queries:
            raise RuntimeError("index on fire")
        return super().search(queries, topk)


async def test_concurrent_requests_are_batched(tmp_path: Path) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    retriever = Recording(path)
    service = RetrievalService(retriever)
    service.start()
    try:
        results = await asyncio.gather(
            service.search(["Quorvel Guild"], 1),
            service.search(["Sulketra", "Dravo Kelmir luthier"], 3),
            service.search(["pears"], 2),
        )
    finally:
        await service.stop()
    calls = retriever.calls
    assert len(calls) == 1 and len(calls[0]) == 4  # one search for all three requests
    assert [len(r) for r in results] == [1, 2, 1]
    assert results[0][0][0][0]["id"] == "0" and len(results[0][0]) == 1
    assert results[1][1][0][0]["id"] == "1" and len(results[1][0]) <= 3
    assert results[2][0][0][0]["id"] == "3" and len(results[2][0]) <= 2


async def test_client_and_passage_format(url: str) -> None:
    client = RetrieverClient(url, topk=1)  # the bare server URL works as well as .../retrieve
    try:
        results = await client.search(["Dravo Kelmir", "xyzzy"])
    finally:
        await client.close()
    assert results[1] == []
    assert (
        format_passages(results[0])
        == 'Doc 1(Title: "Dravo Kelmir") Dravo Kelmir was a luthier born in Sulketra.\n'
    )
    assert format_passages([{"contents": "T\nline one\nline two"}, {"document": {"contents": "U"}}]) == (
        "Doc 1(Title: T) line one\nline two\nDoc 2(Title: U) \n"
    )


async def test_client_errors_are_loud(url: str) -> None:
    client = RetrieverClient(f"{url}/retrieve", topk=1000)  # the server refuses topk 1000
    with pytest.raises(RetrieverError, match="refused"):
        await client.search(["q"])
    await client.close()
    dead = RetrieverClient(f"http://127.0.0.1:{find_free_port()}", retries=1, backoff_s=0.01, timeout_s=2)
    with pytest.raises(RetrieverError, match="unreachable"):
        await dead.search(["q"])
    await dead.close()


async def test_a_failing_search_is_a_500_and_the_server_keeps_serving(tmp_path: Path) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    server = RetrieverServer(Recording(path))
    url = await server.start()
    try:
        status, body = await _post(url, {"queries": ["boom"]})
        assert status == 500 and "index on fire" in body["error"]
        status, body = await _post(url, {"queries": ["pears"], "topk": 1})
        assert status == 200 and body["result"][0][0]["id"] == "3"
    finally:
        await server.stop()
