"""Fixtures: build the tiny model once, start real SGLang servers (with Branchwise) on free ports."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from branchwise.tools.launch import LocalServer
from branchwise.tools.tiny_model import build

MAX_ALIVE = 2  # each CPU server holds ~3 GB over 3 processes; the CI box has 24 GB


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(build(tmp_path_factory.mktemp("model") / "tiny", seed=0))


class ServerPool:
    """Servers keyed by their launch arguments; the least recently used one stops first."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.alive: OrderedDict[tuple, LocalServer] = OrderedDict()

    def get(self, *args: str, env: dict[str, str] | None = None, tp: int = 1, **kw) -> LocalServer:
        key = (args, tuple(sorted((env or {}).items())), tp, tuple(sorted(kw.items())))
        if key in self.alive:
            self.alive.move_to_end(key)
            return self.alive[key]
        while len(self.alive) >= MAX_ALIVE:
            self.alive.popitem(last=False)[1].stop()
        server = LocalServer(self.model, list(args), env=env or {}, tp=tp, **kw).start()
        self.alive[key] = server
        return server

    def stop(self, server: LocalServer) -> None:
        """Stop one server now and forget it (a module that is done with it frees the memory)."""
        server.stop()
        for key in [k for k, v in self.alive.items() if v is server]:
            del self.alive[key]

    def close(self) -> None:
        for server in self.alive.values():
            server.stop()
        self.alive.clear()


@pytest.fixture(scope="session")
def servers(tiny_model):
    pool = ServerPool(tiny_model)
    yield pool
    pool.close()
