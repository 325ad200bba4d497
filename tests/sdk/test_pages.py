"""ballast.client.pages: every reply of a paged List call, following the store's page tokens."""

from __future__ import annotations

from ballast.client import pages
from ballast.v1 import job_pb2, store_pb2


def test_pages_follows_the_tokens_until_the_last_page() -> None:
    book = {"": (["a", "b"], "t1"), "t1": (["c", "d"], "t2"), "t2": (["e"], "")}
    asked: list[str] = []

    def list_jobs(request: store_pb2.ListJobsRequest) -> store_pb2.ListJobsResponse:
        asked.append(request.page.page_token)
        ids, token = book[request.page.page_token]
        return store_pb2.ListJobsResponse(jobs=[job_pb2.Job(id=i) for i in ids], next_page_token=token)

    replies = list(pages(list_jobs, store_pb2.ListJobsRequest()))
    assert [j.id for r in replies for j in r.jobs] == ["a", "b", "c", "d", "e"] and asked == ["", "t1", "t2"]
