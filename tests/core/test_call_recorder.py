"""The one call recorder (:class:`r3bridge.rollout.forwarding.CallRecorder`): a client wrapped by
composition, one method's calls seen (sync or async, through an adapter's own step), every other
attribute the client's, a failed call recording nothing."""

from __future__ import annotations

import asyncio

import pytest

from r3bridge.rollout.forwarding import CallRecorder


class Client:
    name = "engine-0"

    def parse(self, response: dict) -> int:
        if "boom" in response:
            raise ValueError("bad response")
        return len(response)

    async def generate(self, prompt: list, *, n: int = 1) -> list:
        await asyncio.sleep(0)
        return prompt * n


def test_sync_method_hands_each_call_to_record_and_forwards_the_rest():
    seen = []
    client = CallRecorder(Client(), "parse", record=seen.append)
    assert client.parse({"a": 1, "b": 2}) == 2 and client.name == "engine-0"
    with pytest.raises(ValueError, match="bad response"):
        client.parse({"boom": 1})
    assert [(c.args, c.kwargs, c.result) for c in seen] == [(({"a": 1, "b": 2},), {}, 2)]
    assert client.results == []                 # a record callback keeps nothing itself


def test_async_method_results_kept_in_call_order_through_the_adapters_step():
    async def doubled(call, prompt, **kwargs):    # what an adapter runs instead of the method
        return await call(prompt + prompt, **kwargs)

    plain, through = CallRecorder(Client(), "generate"), CallRecorder(Client(), "generate", through=doubled)

    async def run():
        return await plain.generate([1], n=2), await through.generate([3]), await plain.generate([4])
    assert asyncio.run(run()) == ([1, 1], [3, 3], [4])
    assert plain.results == [[1, 1], [4]] and through.results == [[3, 3]]
