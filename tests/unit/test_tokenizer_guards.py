"""validate's TokenizerManager guards: prompt ids outside the vocabulary are a ValueError (HTTP 400); a stream's abort
task is skipped for a request that was never normalized instead of raising after the response."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from starlette.background import BackgroundTasks

from branchwise.ingress import validate

TM = SimpleNamespace(model_config=SimpleNamespace(vocab_size=10))


@pytest.mark.parametrize("ids", [None, [], [0, 9], [3]])
def test_ids_in_range_pass(ids):
    assert validate.after_validate_one_request("r", TM, object(), ids) == "r"


@pytest.mark.parametrize(("ids", "bad"), [([1, 10], 10), ([-1, 2], -1), ([10**9], 10**9)])
def test_ids_out_of_range_raise_naming_them(ids, bad):
    with pytest.raises(ValueError, match=rf"input_ids .*token id {bad}\b.*\[0, 10\)"):
        validate.after_validate_one_request(None, TM, object(), ids)


def _abort_task(ran: list[str]):
    """SGLang's create_abort_task, minus the 2 s sleep: it reads obj.is_single."""

    def create(self, obj):
        async def abort_request():
            ran.append(obj.rid if obj.is_single else "batch")

        tasks = BackgroundTasks()
        tasks.add_task(abort_request)
        return tasks

    return create


def test_abort_task_of_an_unnormalized_request_is_skipped():
    ran: list[str] = []
    with pytest.raises(AttributeError):  # SGLang's own task, after the response has been sent
        asyncio.run(_abort_task(ran)(TM, SimpleNamespace(rid="r1"))())
    tasks = validate.around_create_abort_task(_abort_task(ran), TM, SimpleNamespace(rid="r1"))
    asyncio.run(tasks())
    assert ran == []


def test_abort_task_of_a_normalized_request_runs():
    ran: list[str] = []
    tasks = validate.around_create_abort_task(_abort_task(ran), TM, SimpleNamespace(rid="r1", is_single=True))
    asyncio.run(tasks())
    assert ran == ["r1"]
